//! [`run_local`]: starting the rank threads of an in-process world and collecting their
//! results or the first failure.

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use super::group::{GroupShared, lock};
use super::{LocalComm, World};

/// Why a [`run_local`] world failed: the first rank that failed and how.
#[derive(Debug)]
pub struct RankFailure<E> {
    /// World rank that failed first.
    pub rank: usize,
    /// Its error, or its panic message.
    pub cause: FailureCause<E>,
}

/// A rank's error or panic.
#[derive(Debug)]
pub enum FailureCause<E> {
    /// The rank function returned `Err`.
    Error(E),
    /// The rank panicked with this message.
    Panic(String),
}

impl<E: fmt::Display> fmt::Display for RankFailure<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.cause {
            FailureCause::Error(e) => write!(f, "rank {}: {e}", self.rank),
            FailureCause::Panic(m) => write!(f, "rank {} panicked: {m}", self.rank),
        }
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for RankFailure<E> {}

/// The rayon threads each of `world_size` in-process ranks gets: the current pool's split
/// evenly, at least one.
pub fn threads_per_rank(world_size: usize) -> usize {
    (rayon::current_num_threads() / world_size.max(1)).max(1)
}

/// Runs `f` on `world_size` rank threads (named `rank-<r>`), each with its world
/// [`LocalComm`] and its own rayon pool of `current_num_threads() / world_size` threads (at
/// least 1), and returns the results in rank order.
///
/// # Errors
/// The first rank to return `Err` or to panic, as [`RankFailure`]; the others were aborted.
/// `world_size == 0` is reported as a failure of rank 0.
pub fn run_local<T, E, F>(world_size: usize, f: F) -> std::result::Result<Vec<T>, RankFailure<E>>
where
    T: Send,
    E: Send + fmt::Display,
    F: Fn(LocalComm) -> std::result::Result<T, E> + Sync,
{
    if world_size == 0 {
        return Err(RankFailure {
            rank: 0,
            cause: FailureCause::Panic("run_local needs world_size >= 1".into()),
        });
    }
    let (world, shared) = new_world(world_size);
    let threads = threads_per_rank(world_size);
    let outcomes: Vec<std::result::Result<T, FailureCause<E>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let comm = LocalComm {
                    world: world.clone(),
                    group: shared.clone(),
                    group_id: 0,
                    rank,
                    splits: AtomicU64::new(0),
                };
                let (f, world) = (&f, &world);
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || run_rank(f, comm, world, rank, threads))
                    .expect("spawning a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|p| Err(FailureCause::Panic(panic_message(p.as_ref()))))
            })
            .collect()
    });
    collect_outcomes(outcomes, world.abort.first().map(|(rank, _)| rank))
}

/// A fresh world of `world_size` ranks and its world group, registered for abort wake-ups.
fn new_world(world_size: usize) -> (Arc<World>, Arc<GroupShared>) {
    let world = Arc::new(World {
        abort: Arc::default(),
        groups: Mutex::default(),
        next_group_id: AtomicU64::new(1),
    });
    let shared = Arc::new(GroupShared::new(
        (0..world_size).collect(),
        world.abort.clone(),
    ));
    // Registered (for abort wake-ups) under a key no split can produce.
    lock(&world.groups).insert((u64::MAX, 0, 0), (0, shared.clone()));
    (world, shared)
}

/// The body of rank thread `rank`: runs `f` in the rank's own rayon pool of `threads`
/// threads and, on an error or panic, aborts the world with the reason.
fn run_rank<T, E, F>(
    f: &F,
    comm: LocalComm,
    world: &World,
    rank: usize,
    threads: usize,
) -> std::result::Result<T, FailureCause<E>>
where
    T: Send,
    E: Send + fmt::Display,
    F: Fn(LocalComm) -> std::result::Result<T, E> + Sync,
{
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(move |i| format!("rank-{rank}-worker-{i}"))
        .build();
    let run = || match &pool {
        Ok(pool) => pool.install(|| f(comm)),
        // No pool (thread limit): run on the shared one.
        Err(_) => f(comm),
    };
    let outcome = match catch_unwind(AssertUnwindSafe(run)) {
        Ok(Ok(v)) => return Ok(v),
        Ok(Err(e)) => FailureCause::Error(e),
        Err(payload) => FailureCause::Panic(panic_message(payload.as_ref())),
    };
    let reason = match &outcome {
        FailureCause::Error(e) => e.to_string(),
        FailureCause::Panic(m) => format!("panicked: {m}"),
    };
    world.abort(rank, reason);
    Err(outcome)
}

/// The results in rank order, or the failure of rank `first` (the first to abort the world;
/// the lowest failed rank when none did).
fn collect_outcomes<T, E>(
    outcomes: Vec<std::result::Result<T, FailureCause<E>>>,
    first: Option<usize>,
) -> std::result::Result<Vec<T>, RankFailure<E>> {
    let mut results = Vec::with_capacity(outcomes.len());
    let mut failures: Vec<(usize, FailureCause<E>)> = Vec::new();
    for (rank, o) in outcomes.into_iter().enumerate() {
        match o {
            Ok(v) => results.push(v),
            Err(cause) => failures.push((rank, cause)),
        }
    }
    if failures.is_empty() {
        return Ok(results);
    }
    let pos = failures
        .iter()
        .position(|(r, _)| Some(*r) == first)
        .unwrap_or(0);
    let (rank, cause) = failures.swap_remove(pos);
    Err(RankFailure { rank, cause })
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}
