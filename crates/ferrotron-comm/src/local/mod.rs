//! [`LocalComm`]: ranks as threads of one process, communicating through shared memory.
//!
//! [`run_local`] starts `world_size` rank threads, hands each its world communicator and
//! returns their results in rank order. Sub-groups come from [`Communicator::split`]. A rank that returns an error or panics aborts the world: every rank
//! waiting in a collective or a receive stops with [`CommError::Aborted`], and `run_local`
//! returns the failing rank's own error — no hang, and the root cause rather than its echoes.
//!
//! Each rank runs inside its own rayon thread pool (the cores of the current pool split
//! evenly, at least one thread each): a rank blocked in a collective inside a parallel
//! kernel's scope must not hold a worker that another rank needs to reach the same
//! collective, which a shared pool cannot guarantee.

mod group;
mod launch;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use group::{AbortFlag, GroupShared, Slot, lock};
pub use launch::{FailureCause, RankFailure, run_local, threads_per_rank};

use crate::communicator::{
    Communicator, ElemType, ReduceOp, check_rank, chunk_len, deliver, part_range, reduce_into,
};
use crate::error::{Result, mismatch};

/// Identifies a group created by a split: (parent group id, split number on the parent, color).
type SplitKey = (u64, u64, usize);

/// State shared by all ranks of one [`run_local`] world.
struct World {
    abort: Arc<AbortFlag>,
    groups: Mutex<HashMap<SplitKey, (u64, Arc<GroupShared>)>>,
    next_group_id: AtomicU64,
}

impl World {
    fn abort(&self, rank: usize, reason: String) {
        self.abort.raise(rank, reason);
        for (_, g) in lock(&self.groups).values() {
            g.wake_all();
        }
    }
}

/// One rank's handle on one in-process group (the world, or a group from [`Communicator::split`]).
pub struct LocalComm {
    world: Arc<World>,
    group: Arc<GroupShared>,
    group_id: u64,
    rank: usize,
    splits: AtomicU64,
}

impl fmt::Debug for LocalComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalComm")
            .field("rank", &self.rank)
            .field("world_ranks", &self.group.world_ranks)
            .finish()
    }
}

impl LocalComm {
    /// This rank's index in the whole world.
    pub fn world_rank(&self) -> usize {
        self.group.world_ranks[self.rank]
    }

    /// World ranks of this group's members, in group-rank order.
    pub fn world_ranks(&self) -> &[usize] {
        &self.group.world_ranks
    }

    /// [`Communicator::split`] with the concrete type: collective over this group. Ranks passing the same `color` form a
    /// new group, ordered by (`key`, rank here); `None` (MPI_UNDEFINED) joins no group.
    ///
    /// # Errors
    /// Another rank failed.
    pub fn split_local(&self, color: Option<usize>, key: usize) -> Result<Option<LocalComm>> {
        let seq = self.splits.fetch_add(1, Ordering::SeqCst);
        let n = self.group.size();
        let mine = [color.map_or(0, |c| c as u64 + 1), key as u64];
        let mut all = vec![0u64; 2 * n];
        all[2 * self.rank..2 * self.rank + 2].copy_from_slice(&mine);
        self.all_gather_bytes(bytemuck::cast_slice_mut(&mut all))?;
        let Some(color) = color else {
            return Ok(None);
        };
        let mut members: Vec<(u64, usize)> = (0..n)
            .filter(|&r| all[2 * r] == color as u64 + 1)
            .map(|r| (all[2 * r + 1], r))
            .collect();
        members.sort_unstable();
        let rank = members
            .iter()
            .position(|&(_, r)| r == self.rank)
            .expect("this rank is a member of its own color");
        let world_ranks: Vec<usize> = members
            .iter()
            .map(|&(_, r)| self.group.world_ranks[r])
            .collect();
        let (group_id, group) = lock(&self.world.groups)
            .entry((self.group_id, seq, color))
            .or_insert_with(|| {
                let id = self.world.next_group_id.fetch_add(1, Ordering::SeqCst);
                let g = GroupShared::new(world_ranks, self.world.abort.clone());
                (id, Arc::new(g))
            })
            .clone();
        Ok(Some(LocalComm {
            world: self.world.clone(),
            group,
            group_id,
            rank,
            splits: AtomicU64::new(0),
        }))
    }
}

/// The raw bytes `range` of a buffer another rank published.
///
/// # Safety
/// Between the two rendezvous of a collective, the owner does not touch its buffer and
/// no other rank writes `range` of it.
unsafe fn peer<'a>(addr: usize, range: std::ops::Range<usize>) -> &'a [u8] {
    unsafe { std::slice::from_raw_parts((addr + range.start) as *const u8, range.len()) }
}

/// As [`peer`], writable.
///
/// # Safety
/// As [`peer`], and no other rank reads or writes `range` of it.
#[allow(clippy::mut_from_ref)]
unsafe fn peer_mut<'a>(addr: usize, range: std::ops::Range<usize>) -> &'a mut [u8] {
    unsafe { std::slice::from_raw_parts_mut((addr + range.start) as *mut u8, range.len()) }
}

/// A reduction result buffer aligned for every element type (8 bytes).
struct Scratch {
    words: Vec<u64>,
    len: usize,
}

impl Scratch {
    fn new(len: usize) -> Self {
        Scratch {
            words: vec![0; len.div_ceil(8)],
            len,
        }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }
}

fn same_lengths(op: &'static str, slots: &[Slot]) -> Result<()> {
    let first = (slots[0].input_len, slots[0].output_len);
    if let Some(s) = slots.iter().find(|s| (s.input_len, s.output_len) != first) {
        return Err(mismatch(
            op,
            format!(
                "ranks passed buffers of different lengths ({first:?} and {:?} bytes)",
                (s.input_len, s.output_len)
            ),
        ));
    }
    Ok(())
}

fn ty_code(ty: ElemType) -> u8 {
    ty as u8
}
fn op_code(op: ReduceOp) -> u8 {
    op as u8
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.size()
    }

    fn all_reduce_bytes(&self, buf: &mut [u8], ty: ElemType, op: ReduceOp) -> Result<()> {
        chunk_len("all_reduce", buf.len(), 1, ty)?;
        let addr = buf.as_mut_ptr() as usize;
        let slot = Slot::in_place(addr, buf.len(), (1, ty_code(ty), op_code(op), 0));
        let (n, me) = (self.size(), self.rank);
        self.group.collective(me, "all_reduce", slot, |slots| {
            same_lengths("all_reduce", slots)?;
            // This rank reduces part `me` of every buffer and writes it back to all of them.
            let part = part_range(buf.len(), ty.size(), n, me);
            let mut acc = Scratch::new(part.len());
            let acc = acc.bytes_mut();
            {
                // SAFETY: only this rank touches part `me` of any buffer until the rendezvous.
                let ins: Vec<&[u8]> = slots
                    .iter()
                    .map(|s| unsafe { peer(s.input, part.clone()) })
                    .collect();
                reduce_into(acc, &ins, ty, op)?;
            }
            for s in slots {
                // SAFETY: as above; the input views were dropped.
                unsafe { peer_mut(s.output, part.clone()) }.copy_from_slice(acc);
            }
            Ok(())
        })
    }

    fn reduce_scatter_bytes(&self, buf: &mut [u8], ty: ElemType, op: ReduceOp) -> Result<()> {
        let (n, me) = (self.size(), self.rank);
        let chunk = chunk_len("reduce_scatter", buf.len(), n, ty)?;
        let addr = buf.as_mut_ptr() as usize;
        let slot = Slot::in_place(addr, buf.len(), (2, ty_code(ty), op_code(op), 0));
        self.group.collective(me, "reduce_scatter", slot, |slots| {
            same_lengths("reduce_scatter", slots)?;
            let mine = me * chunk..(me + 1) * chunk;
            let mut acc = Scratch::new(chunk);
            let acc = acc.bytes_mut();
            {
                // SAFETY: chunk `me` of every buffer is read only by this rank, and written
                // only by this rank after the reads.
                let ins: Vec<&[u8]> = slots
                    .iter()
                    .map(|s| unsafe { peer(s.input, mine.clone()) })
                    .collect();
                reduce_into(acc, &ins, ty, op)?;
            }
            // SAFETY: as above.
            unsafe { peer_mut(slots[me].output, mine) }.copy_from_slice(acc);
            Ok(())
        })
    }

    fn all_gather_bytes(&self, buf: &mut [u8]) -> Result<()> {
        let (n, me) = (self.size(), self.rank);
        let chunk = chunk_len("all_gather", buf.len(), n, ElemType::U8)?;
        let addr = buf.as_mut_ptr() as usize;
        let slot = Slot::in_place(addr, buf.len(), (3, 0, 0, 0));
        self.group.collective(me, "all_gather", slot, |slots| {
            same_lengths("all_gather", slots)?;
            for (r, s) in slots.iter().enumerate().filter(|&(r, _)| r != me) {
                let range = r * chunk..(r + 1) * chunk;
                // SAFETY: chunk `r` of rank `r`'s buffer is only read; chunk `r` of this
                // rank's buffer is written only by this rank.
                let src = unsafe { peer(s.input, range.clone()) };
                unsafe { peer_mut(addr, range) }.copy_from_slice(src);
            }
            Ok(())
        })
    }

    fn broadcast_bytes(&self, buf: &mut [u8], root: usize) -> Result<()> {
        check_rank("broadcast", root, self.size())?;
        let me = self.rank;
        let addr = buf.as_mut_ptr() as usize;
        let len = buf.len();
        let slot = Slot::in_place(addr, buf.len(), (4, 0, 0, root));
        self.group.collective(me, "broadcast", slot, |slots| {
            same_lengths("broadcast", slots)?;
            if me != root {
                // SAFETY: the root's buffer is only read; this rank's only written by itself.
                let src = unsafe { peer(slots[root].input, 0..len) };
                unsafe { peer_mut(addr, 0..len) }.copy_from_slice(src);
            }
            Ok(())
        })
    }

    fn all_to_all_bytes(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        let (n, me) = (self.size(), self.rank);
        let chunk = chunk_len("all_to_all", input.len(), n, ElemType::U8)?;
        if output.len() != input.len() {
            return Err(mismatch(
                "all_to_all",
                format!("output of {} bytes, input of {}", output.len(), input.len()),
            ));
        }
        let slot = Slot {
            input: input.as_ptr() as usize,
            input_len: input.len(),
            output: output.as_mut_ptr() as usize,
            output_len: output.len(),
            signature: (5, 0, 0, 0),
        };
        let out_addr = slot.output;
        self.group.collective(me, "all_to_all", slot, |slots| {
            same_lengths("all_to_all", slots)?;
            for (r, s) in slots.iter().enumerate() {
                // SAFETY: inputs are only read; this rank's output only written by itself.
                let src = unsafe { peer(s.input, me * chunk..(me + 1) * chunk) };
                unsafe { peer_mut(out_addr, r * chunk..(r + 1) * chunk) }.copy_from_slice(src);
            }
            Ok(())
        })
    }

    fn send_bytes(&self, buf: &[u8], dest: usize) -> Result<()> {
        check_rank("send", dest, self.size())?;
        self.group.send(self.rank, dest, buf)
    }

    fn recv_bytes(&self, buf: &mut [u8], src: usize) -> Result<()> {
        check_rank("recv", src, self.size())?;
        let msg = self.group.recv(src, self.rank)?;
        deliver(&msg, buf, src)
    }

    fn barrier(&self) -> Result<()> {
        let slot = Slot {
            signature: (6, 0, 0, 0),
            ..Slot::default()
        };
        self.group
            .collective(self.rank, "barrier", slot, |_| Ok(()))
    }

    fn split(&self, color: Option<usize>, key: usize) -> Result<Option<Arc<dyn Communicator>>> {
        Ok(self
            .split_local(color, key)?
            .map(|c| Arc::new(c) as Arc<dyn Communicator>))
    }
}
