//! Shared state of one in-process group: an abortable rendezvous, the buffers each rank
//! published for the running collective, and a mailbox per (sender, receiver) pair.
//!
//! A collective is two rendezvous: every rank publishes its buffer addresses and arrives
//! (abortable: a rank whose peer failed stops waiting); then each rank reads and writes only
//! its own part of every rank's buffers (chunk `rank` of a reduction, its own output
//! otherwise), and arrives again (not abortable, and reached even when the body panics), so
//! no buffer is touched after its owner returned. Reductions sum in rank order: every rank
//! gets the same bits.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::error::{CommError, Result};

/// How long a waiting rank sleeps before it looks at the abort flag again (a failing rank
/// also wakes every waiter at once).
const ABORT_POLL: Duration = Duration::from_millis(100);

/// The first failure of a world; once set every wait returns [`CommError::Aborted`].
#[derive(Default)]
pub(crate) struct AbortFlag {
    set: AtomicBool,
    first: Mutex<Option<(usize, String)>>,
}

impl AbortFlag {
    /// Records `rank`'s failure (only the first is kept). Returns true if it was the first.
    pub(crate) fn raise(&self, rank: usize, reason: String) -> bool {
        let mut first = lock(&self.first);
        let is_first = first.is_none();
        if is_first {
            *first = Some((rank, reason));
        }
        self.set.store(true, Ordering::SeqCst);
        is_first
    }

    /// The first failure, if any.
    pub(crate) fn first(&self) -> Option<(usize, String)> {
        lock(&self.first).clone()
    }

    fn check(&self) -> Result<()> {
        if !self.set.load(Ordering::SeqCst) {
            return Ok(());
        }
        let (rank, reason) = self.first().unwrap_or((usize::MAX, "unknown".into()));
        Err(CommError::Aborted { rank, reason })
    }
}

/// Locks, ignoring poisoning: the state is plain counters and addresses that a panicking
/// rank cannot leave half-updated.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What a rank published for the collective in flight: addresses as integers (they are
/// only dereferenced between the two rendezvous, while the owner waits), lengths in bytes,
/// and the call's arguments, which must agree across ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Slot {
    pub input: usize,
    pub input_len: usize,
    pub output: usize,
    pub output_len: usize,
    /// Operation, element type, reduction and root, packed for the agreement check.
    pub signature: (u8, u8, u8, usize),
}

impl Slot {
    /// A collective working in place on one buffer of `len` bytes at `addr`.
    pub(crate) fn in_place(addr: usize, len: usize, signature: (u8, u8, u8, usize)) -> Slot {
        Slot {
            input: addr,
            input_len: len,
            output: addr,
            output_len: len,
            signature,
        }
    }
}

#[derive(Default)]
struct Rendezvous {
    arrived: usize,
    generation: u64,
}

type Mailbox = (Mutex<VecDeque<Vec<u8>>>, Condvar);

/// One group's shared state.
pub(crate) struct GroupShared {
    pub(crate) world_ranks: Vec<usize>,
    rendezvous: Mutex<Rendezvous>,
    arrived: Condvar,
    slots: Mutex<Vec<Slot>>,
    mailboxes: Vec<Mailbox>,
    abort: Arc<AbortFlag>,
}

impl GroupShared {
    pub(crate) fn new(world_ranks: Vec<usize>, abort: Arc<AbortFlag>) -> Self {
        let n = world_ranks.len();
        GroupShared {
            rendezvous: Mutex::default(),
            arrived: Condvar::new(),
            slots: Mutex::new(vec![Slot::default(); n]),
            mailboxes: (0..n * n)
                .map(|_| (Mutex::default(), Condvar::new()))
                .collect(),
            world_ranks,
            abort,
        }
    }

    pub(crate) fn size(&self) -> usize {
        self.world_ranks.len()
    }

    /// Wakes every waiter (after the abort flag was raised).
    pub(crate) fn wake_all(&self) {
        drop(lock(&self.rendezvous));
        self.arrived.notify_all();
        for (queue, cv) in &self.mailboxes {
            drop(lock(queue));
            cv.notify_all();
        }
    }

    /// Waits until every rank arrived; with `abortable`, gives up when the world aborts.
    fn arrive(&self, abortable: bool) -> Result<()> {
        let mut st = lock(&self.rendezvous);
        st.arrived += 1;
        if st.arrived == self.size() {
            st.arrived = 0;
            st.generation += 1;
            self.arrived.notify_all();
            return Ok(());
        }
        let generation = st.generation;
        while st.generation == generation {
            if abortable && let Err(e) = self.abort.check() {
                // Leave uncounted: a later arriver must not complete the rendezvous (and go
                // on to touch buffers) as if this rank were still here.
                st.arrived -= 1;
                return Err(e);
            }
            st = self
                .arrived
                .wait_timeout(st, ABORT_POLL)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        Ok(())
    }

    /// Runs one collective: publish `slot` for `rank`, rendezvous, check every rank called
    /// the same operation, run `body` on all ranks' slots, rendezvous again.
    pub(crate) fn collective(
        &self,
        rank: usize,
        op: &'static str,
        slot: Slot,
        body: impl FnOnce(&[Slot]) -> Result<()>,
    ) -> Result<()> {
        lock(&self.slots)[rank] = slot;
        self.arrive(true)?;
        let slots = lock(&self.slots).clone();
        // Arrive again even if `body` panics, so no peer returns while we still write.
        struct Depart<'a>(&'a GroupShared);
        impl Drop for Depart<'_> {
            fn drop(&mut self) {
                let _ = self.0.arrive(false);
            }
        }
        let _depart = Depart(self);
        if let Some(other) = slots.iter().find(|s| s.signature != slot.signature) {
            return Err(crate::error::mismatch(
                op,
                format!(
                    "ranks disagree on the call (this rank {:?}, another {:?}): every rank must \
                     call the same collective with the same type, op and root",
                    slot.signature, other.signature
                ),
            ));
        }
        body(&slots)
    }

    /// Queues a copy of `buf` for `dst`.
    pub(crate) fn send(&self, src: usize, dst: usize, buf: &[u8]) -> Result<()> {
        self.abort.check()?;
        let (queue, cv) = &self.mailboxes[src * self.size() + dst];
        lock(queue).push_back(buf.to_vec());
        cv.notify_all();
        Ok(())
    }

    /// Takes the next message from `src` to `dst`, waiting for it (abortable).
    pub(crate) fn recv(&self, src: usize, dst: usize) -> Result<Vec<u8>> {
        let (queue, cv) = &self.mailboxes[src * self.size() + dst];
        let mut q = lock(queue);
        loop {
            if let Some(msg) = q.pop_front() {
                return Ok(msg);
            }
            self.abort.check()?;
            q = cv
                .wait_timeout(q, ABORT_POLL)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}
