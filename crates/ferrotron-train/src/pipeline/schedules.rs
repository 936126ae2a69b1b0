//! Pipeline schedules as pure functions: `(pp_size, pp_rank, num_microbatches[, vp]) ->
//! Vec<Action>`, the program one pipeline rank runs for one global batch (Megatron-Core
//! `megatron/core/pipeline_parallel/schedules.py`):
//!
//! - [`no_pipelining`]: one stage, forward then backward per micro-batch (gradient
//!   accumulation; `forward_backward_no_pipelining`);
//! - [`one_f_one_b`]: `pp - rank - 1` warmup forwards, then one forward + one backward per
//!   step, then the cooldown backwards (`forward_backward_pipelining_without_interleaving`);
//! - [`interleaved_one_f_one_b`]: `vp` model chunks per rank, virtual stage `c·pp + rank`
//!   for chunk `c` (`forward_backward_pipelining_with_interleaving`).
//!
//! Communication is explicit: a forward is preceded by its [`Action::RecvForward`] (except on
//! the first virtual stage) and followed by [`Action::SendForward`] (except on the last);
//! backwards mirror that. Sends never wait for the receiver (the communicator buffers them),
//! receives block. [`simulate`] runs all ranks' programs against each other and checks them.

use std::collections::{HashMap, HashSet, VecDeque};

/// One step of a pipeline rank's program; `mb` is the micro-batch, `chunk` the model chunk
/// on this rank (always 0 without interleaving).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Receive the input activation `[s·b, h]` from the previous virtual stage.
    RecvForward { mb: usize, chunk: usize },
    /// Run the chunk's forward (the loss too on the last virtual stage).
    Forward { mb: usize, chunk: usize },
    /// Send the output activation to the next virtual stage.
    SendForward { mb: usize, chunk: usize },
    /// Receive the gradient of the output activation from the next virtual stage.
    RecvBackward { mb: usize, chunk: usize },
    /// Run the chunk's backward, freeing the micro-batch's activations.
    Backward { mb: usize, chunk: usize },
    /// Send the gradient of the input activation to the previous virtual stage.
    SendBackward { mb: usize, chunk: usize },
}

/// Where a rank sits in a (possibly interleaved) pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PipelineRank {
    /// `pipeline_model_parallel_size`.
    pub pp: usize,
    /// This rank's stage.
    pub rank: usize,
    /// Model chunks per rank (`virtual_pipeline_model_parallel_size`, 1 without).
    pub vp: usize,
}

impl PipelineRank {
    /// Virtual stage of `chunk` on this rank: `chunk·pp + rank`.
    pub fn virtual_stage(&self, chunk: usize) -> usize {
        chunk * self.pp + self.rank
    }
    /// Holds the first virtual stage (the embedding) for `chunk`.
    pub fn is_first(&self, chunk: usize) -> bool {
        self.virtual_stage(chunk) == 0
    }
    /// Holds the last virtual stage (the loss) for `chunk`.
    pub fn is_last(&self, chunk: usize) -> bool {
        self.virtual_stage(chunk) + 1 == self.pp * self.vp
    }
    /// The rank holding the next virtual stage after `chunk` (the ring: the last rank's
    /// chunk `c` feeds rank 0's chunk `c + 1`).
    pub fn next_rank(&self) -> usize {
        (self.rank + 1) % self.pp
    }
    /// The rank holding the previous virtual stage.
    pub fn prev_rank(&self) -> usize {
        (self.rank + self.pp - 1) % self.pp
    }
}

/// The forward of `(mb, chunk)` with its receive and send.
fn forward(p: &PipelineRank, mb: usize, chunk: usize, out: &mut Vec<Action>) {
    if !p.is_first(chunk) {
        out.push(Action::RecvForward { mb, chunk });
    }
    out.push(Action::Forward { mb, chunk });
    if !p.is_last(chunk) {
        out.push(Action::SendForward { mb, chunk });
    }
}

/// The backward of `(mb, chunk)` with its receive and send.
fn backward(p: &PipelineRank, mb: usize, chunk: usize, out: &mut Vec<Action>) {
    if !p.is_last(chunk) {
        out.push(Action::RecvBackward { mb, chunk });
    }
    out.push(Action::Backward { mb, chunk });
    if !p.is_first(chunk) {
        out.push(Action::SendBackward { mb, chunk });
    }
}

/// One stage: forward and backward of each micro-batch in turn.
pub fn no_pipelining(num_microbatches: usize) -> Vec<Action> {
    one_f_one_b(1, 0, num_microbatches)
}

/// Megatron's 1F1B on stage `rank` of `pp`: `warmup = min(pp − rank − 1, M)` forwards,
/// then `M − warmup` steps of one forward and one backward, then the remaining backwards.
/// At most `warmup + 1` micro-batches hold activations at once.
pub fn one_f_one_b(pp: usize, rank: usize, num_microbatches: usize) -> Vec<Action> {
    let p = PipelineRank { pp, rank, vp: 1 };
    let m = num_microbatches;
    let warmup = (pp - rank - 1).min(m);
    let mut out = Vec::with_capacity(6 * m);
    for mb in 0..warmup {
        forward(&p, mb, 0, &mut out);
    }
    for i in 0..m - warmup {
        forward(&p, warmup + i, 0, &mut out);
        backward(&p, i, 0, &mut out);
    }
    for mb in m - warmup..m {
        backward(&p, mb, 0, &mut out);
    }
    out
}

/// Megatron's interleaved 1F1B on stage `rank` of `pp` with `vp` chunks per rank. Forward
/// step `k` runs chunk `(k mod pp·vp) / pp` on micro-batch `(k / (pp·vp))·pp + k mod pp`;
/// backward steps walk the chunks in reverse. Warmup: `(pp − rank − 1)·2 + (vp − 1)·pp`
/// forwards (all of them when `M == pp`).
///
/// # Errors
/// `num_microbatches` not a positive multiple of `pp` (Megatron's requirement), `vp < 2`
/// or `pp < 2`, with a message naming the sizes.
pub fn interleaved_one_f_one_b(
    pp: usize,
    rank: usize,
    num_microbatches: usize,
    vp: usize,
) -> Result<Vec<Action>, String> {
    let m = num_microbatches;
    if pp < 2 || vp < 2 {
        return Err(format!(
            "the interleaved schedule needs pipeline_model_parallel_size >= 2 and \
             virtual_pipeline_model_parallel_size >= 2, got {pp} and {vp}"
        ));
    }
    if m == 0 || !m.is_multiple_of(pp) {
        return Err(format!(
            "the interleaved schedule needs the number of micro-batches ({m}) to be a positive \
             multiple of pipeline_model_parallel_size ({pp})"
        ));
    }
    let p = PipelineRank { pp, rank, vp };
    let total = m * vp;
    let step = |k: usize, fwd: bool| {
        let in_group = k % (pp * vp);
        let chunk = in_group / pp;
        let chunk = if fwd { chunk } else { vp - 1 - chunk };
        (k / (pp * vp) * pp + in_group % pp, chunk)
    };
    let warmup = if m == pp {
        total
    } else {
        ((pp - rank - 1) * 2 + (vp - 1) * pp).min(total)
    };
    let mut out = Vec::with_capacity(6 * total);
    for k in 0..warmup {
        let (mb, chunk) = step(k, true);
        forward(&p, mb, chunk, &mut out);
    }
    for k in 0..total - warmup {
        let (mb, chunk) = step(k + warmup, true);
        forward(&p, mb, chunk, &mut out);
        let (mb, chunk) = step(k, false);
        backward(&p, mb, chunk, &mut out);
    }
    for k in total - warmup..total {
        let (mb, chunk) = step(k, false);
        backward(&p, mb, chunk, &mut out);
    }
    Ok(out)
}

/// A message on a simulated link: (0 activation | 1 gradient, micro-batch, the receiver's
/// chunk).
type Message = (u8, usize, usize);

/// What [`simulate`] measured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Simulation {
    /// Per rank, the most micro-batch chunks holding activations at once.
    pub peak_in_flight: Vec<usize>,
    /// Rounds of the lock-step simulation until every program finished (a rough length
    /// of the pipeline, bubbles included).
    pub rounds: usize,
}

/// Runs every rank's program (`programs[r]` for stage `r` of `pp`, `vp` chunks) against the
/// others over untagged first-in-first-out links, one per (sender, receiver) pair — what the
/// communicators' `send`/`recv` provide: a receive waits for the next message on its link
/// and fails when that message is another one (with `pp = 2` the ring's two directions
/// share a link, so activations and gradients must arrive in the order they are expected).
/// Checks that no program deadlocks, every message sent is received, each forward comes
/// before its backward on its rank, and every (micro-batch, chunk) runs exactly one forward
/// and one backward on every rank.
///
/// # Errors
/// The first violation, naming the rank and action.
pub fn simulate(
    programs: &[Vec<Action>],
    vp: usize,
    num_microbatches: usize,
) -> Result<Simulation, String> {
    let mut sim = Sim::new(programs);
    let mut rounds = 0;
    while sim.running() {
        rounds += 1;
        let mut progressed = false;
        for r in 0..programs.len() {
            progressed |= sim.run_rank(r)?;
        }
        if !progressed {
            return Err(sim.deadlock());
        }
    }
    sim.check_drained()?;
    sim.check_complete(vp, num_microbatches)?;
    Ok(Simulation {
        peak_in_flight: sim.peak,
        rounds,
    })
}

/// The state of a [`simulate`] run: where each rank is in its program, the links between
/// ranks, and what each rank has run.
struct Sim<'a> {
    programs: &'a [Vec<Action>],
    /// link (from, to) -> messages in sending order
    links: HashMap<(usize, usize), VecDeque<Message>>,
    /// Per rank, the index of the next action to run.
    pc: Vec<usize>,
    /// Per rank, the (micro-batch, chunk)s forwarded and not yet backwarded.
    alive: Vec<HashSet<(usize, usize)>>,
    /// Per rank, the most entries `alive` has held.
    peak: Vec<usize>,
    /// Per rank, how often each (forward?, micro-batch, chunk) ran.
    done: Vec<HashMap<(bool, usize, usize), usize>>,
}

impl<'a> Sim<'a> {
    /// Every rank at the start of its program, no message sent.
    fn new(programs: &'a [Vec<Action>]) -> Sim<'a> {
        let pp = programs.len();
        Sim {
            programs,
            links: HashMap::new(),
            pc: vec![0; pp],
            alive: vec![HashSet::new(); pp],
            peak: vec![0; pp],
            done: vec![HashMap::new(); pp],
        }
    }

    /// Whether some rank has actions left.
    fn running(&self) -> bool {
        self.pc.iter().zip(self.programs).any(|(&i, p)| i < p.len())
    }

    /// Runs rank `r` until it blocks on a receive or finishes; returns whether it ran anything.
    fn run_rank(&mut self, r: usize) -> Result<bool, String> {
        let mut progressed = false;
        while let Some(&a) = self.programs[r].get(self.pc[r]) {
            if !self.step(r, a)? {
                break;
            }
            self.pc[r] += 1;
            progressed = true;
        }
        Ok(progressed)
    }

    /// Runs action `a` on rank `r`; false when it is a receive whose message has not arrived.
    fn step(&mut self, r: usize, a: Action) -> Result<bool, String> {
        match a {
            Action::RecvForward { mb, chunk } => return self.receive(r, a, (0, mb, chunk)),
            Action::RecvBackward { mb, chunk } => return self.receive(r, a, (1, mb, chunk)),
            Action::SendForward { mb, chunk } => self.send_forward(r, mb, chunk),
            Action::SendBackward { mb, chunk } => self.send_backward(r, mb, chunk),
            Action::Forward { mb, chunk } => self.forward(r, a, mb, chunk)?,
            Action::Backward { mb, chunk } => self.backward(r, a, mb, chunk)?,
        }
        Ok(true)
    }

    /// Takes `expected` off the link from the previous (activation) or next (gradient) rank;
    /// false when the link is empty, an error when another message is first.
    fn receive(&mut self, r: usize, a: Action, expected: Message) -> Result<bool, String> {
        let pp = self.programs.len();
        let from = if expected.0 == 1 {
            (r + 1) % pp
        } else {
            (r + pp - 1) % pp
        };
        let Some(&got) = self.links.get(&(from, r)).and_then(VecDeque::front) else {
            return Ok(false);
        };
        if got != expected {
            return Err(format!(
                "rank {r}: {a:?} finds (kind, mb, chunk) {got:?} first on the link from rank \
                 {from}"
            ));
        }
        self.links.get_mut(&(from, r)).map(VecDeque::pop_front);
        Ok(true)
    }

    /// Sends an activation to the next virtual stage: rank + 1 same chunk, or rank 0 next
    /// chunk.
    fn send_forward(&mut self, r: usize, mb: usize, chunk: usize) {
        let (to, c) = if r + 1 < self.programs.len() {
            (r + 1, chunk)
        } else {
            (0, chunk + 1)
        };
        self.links.entry((r, to)).or_default().push_back((0, mb, c));
    }

    /// Sends a gradient to the previous virtual stage: rank - 1 same chunk, or the last rank
    /// previous chunk.
    fn send_backward(&mut self, r: usize, mb: usize, chunk: usize) {
        let (to, c) = if r > 0 {
            (r - 1, chunk)
        } else {
            (self.programs.len() - 1, chunk.wrapping_sub(1))
        };
        self.links.entry((r, to)).or_default().push_back((1, mb, c));
    }

    /// Records a forward on rank `r`: its activations are now held.
    fn forward(&mut self, r: usize, a: Action, mb: usize, chunk: usize) -> Result<(), String> {
        if !self.alive[r].insert((mb, chunk)) {
            return Err(format!("rank {r}: second forward of {a:?}"));
        }
        self.peak[r] = self.peak[r].max(self.alive[r].len());
        *self.done[r].entry((true, mb, chunk)).or_default() += 1;
        Ok(())
    }

    /// Records a backward on rank `r`: the activations of its forward are released.
    fn backward(&mut self, r: usize, a: Action, mb: usize, chunk: usize) -> Result<(), String> {
        if !self.alive[r].remove(&(mb, chunk)) {
            return Err(format!("rank {r}: {a:?} before its forward"));
        }
        *self.done[r].entry((false, mb, chunk)).or_default() += 1;
        Ok(())
    }

    /// The deadlock error: where each unfinished rank is stuck.
    fn deadlock(&self) -> String {
        let stuck: Vec<String> = (0..self.programs.len())
            .filter(|&r| self.pc[r] < self.programs[r].len())
            .map(|r| format!("rank {r} at {:?}", self.programs[r][self.pc[r]]))
            .collect();
        format!("deadlock: {}", stuck.join(", "))
    }

    /// Checks that every message sent was received.
    fn check_drained(&self) -> Result<(), String> {
        if let Some(((from, to), q)) = self.links.iter().find(|(_, q)| !q.is_empty()) {
            return Err(format!(
                "message (kind, mb, chunk) {:?} from rank {from} to rank {to} never received",
                q.front()
            ));
        }
        Ok(())
    }

    /// Checks that every (micro-batch, chunk) ran exactly one forward and one backward on
    /// every rank.
    fn check_complete(&self, vp: usize, num_microbatches: usize) -> Result<(), String> {
        for (r, d) in self.done.iter().enumerate() {
            for mb in 0..num_microbatches {
                for chunk in 0..vp {
                    for fwd in [true, false] {
                        if d.get(&(fwd, mb, chunk)) != Some(&1) {
                            let what = if fwd { "forward" } else { "backward" };
                            return Err(format!(
                                "rank {r}: micro-batch {mb} chunk {chunk} has no single {what}"
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
