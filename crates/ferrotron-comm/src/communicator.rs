//! The [`Communicator`] trait: the collectives and point-to-point messages of one process
//! group, as `torch.distributed` offers them to Megatron-Core.
//!
//! Backends implement the byte-level methods (`*_bytes`) with an element-type tag; users call
//! the typed methods of [`Collectives`] (implemented for every communicator, including
//! `dyn Communicator`): `all_reduce(&mut [f32], ReduceOp::Sum)`, `all_gather`, ...
//!
//! Semantics (same as NCCL / MPI): every rank of the group calls the same collectives in the
//! same order with buffers of matching lengths; a mismatch is an error on every rank. Ranks are
//! the group-local ranks `0..size()`. Reductions are deterministic: every rank gets the same
//! bits, summed in rank order.

use std::sync::Arc;

use half::bf16;

use crate::error::{Result, mismatch};

/// Element type of a communication buffer (what a reduction adds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElemType {
    /// `f32`.
    F32,
    /// `f64` (scalars: token counts, squared norms).
    F64,
    /// `bf16`, reduced in f32 and rounded once (`grad_reduce_in_fp32 = false`).
    Bf16,
    /// Raw bytes: no reduction, only movement.
    U8,
}

impl ElemType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            ElemType::F32 => 4,
            ElemType::F64 => 8,
            ElemType::Bf16 => 2,
            ElemType::U8 => 1,
        }
    }
}

/// A type that can be sent through a [`Communicator`].
pub trait Element: bytemuck::Pod + Send {
    /// Its tag.
    const TYPE: ElemType;
}
impl Element for f32 {
    const TYPE: ElemType = ElemType::F32;
}
impl Element for f64 {
    const TYPE: ElemType = ElemType::F64;
}
impl Element for bf16 {
    const TYPE: ElemType = ElemType::Bf16;
}
impl Element for u8 {
    const TYPE: ElemType = ElemType::U8;
}

/// Reduction of [`Collectives::all_reduce`] and [`Collectives::reduce_scatter`]
/// (`torch.distributed.ReduceOp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum over ranks.
    Sum,
    /// Sum over ranks divided by the group size.
    Avg,
    /// Element-wise maximum (NaN wins, so an inf/NaN check cannot miss one).
    Max,
    /// Element-wise minimum.
    Min,
}

/// One process group. Object safe: hold groups as `Arc<dyn Communicator>`.
///
/// Lengths are in bytes and must be whole elements of `ty`. `reduce_scatter` and
/// `all_gather` work in place on a buffer of `size()` equal chunks, chunk `r` belonging to
/// rank `r` (Megatron reduce-scatters a gradient bucket into the rank's shard of the same
/// bucket and all-gathers the parameters the same way); [`Collectives`] adds the
/// out-of-place forms. `all_to_all` sends chunk `r` of `input` to rank `r` and receives
/// rank `r`'s chunk into chunk `r` of `output`.
pub trait Communicator: Send + Sync {
    /// This rank in the group, `0..size()`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// In place: every rank's `buf` becomes the reduction of all ranks' `buf`.
    ///
    /// # Errors
    /// Mismatched lengths, a non-reducible `ty` ([`ElemType::U8`]), or another rank failed.
    fn all_reduce_bytes(&self, buf: &mut [u8], ty: ElemType, op: ReduceOp) -> Result<()>;
    /// In place: chunk `rank()` of `buf` becomes the reduction of chunk `rank()` of every
    /// rank's `buf`; the other chunks are left unspecified.
    ///
    /// # Errors
    /// As [`all_reduce_bytes`](Self::all_reduce_bytes), or `buf` not `size()` chunks.
    fn reduce_scatter_bytes(&self, buf: &mut [u8], ty: ElemType, op: ReduceOp) -> Result<()>;
    /// In place: chunk `r` of every rank's `buf` becomes chunk `r` of rank `r`'s `buf`.
    ///
    /// # Errors
    /// Mismatched lengths, or another rank failed.
    fn all_gather_bytes(&self, buf: &mut [u8]) -> Result<()>;
    /// Every rank's `buf` becomes rank `root`'s.
    ///
    /// # Errors
    /// Mismatched lengths or roots, or another rank failed.
    fn broadcast_bytes(&self, buf: &mut [u8], root: usize) -> Result<()>;
    /// Chunk `r` of `input` goes to rank `r`; chunk `r` of `output` comes from rank `r`.
    ///
    /// # Errors
    /// Mismatched lengths, or another rank failed.
    fn all_to_all_bytes(&self, input: &[u8], output: &mut [u8]) -> Result<()>;
    /// Sends `buf` to rank `dest`; returns once `buf` may be reused (the message may still
    /// be in flight). Messages between a pair arrive in order.
    ///
    /// # Errors
    /// `dest` outside the group, or another rank failed.
    fn send_bytes(&self, buf: &[u8], dest: usize) -> Result<()>;
    /// Receives the next message from rank `src` into `buf` (its length must match).
    ///
    /// # Errors
    /// `src` outside the group, a message of another length, or another rank failed.
    fn recv_bytes(&self, buf: &mut [u8], src: usize) -> Result<()>;
    /// Returns once every rank of the group has called it.
    ///
    /// # Errors
    /// Another rank failed.
    fn barrier(&self) -> Result<()>;
    /// `MPI_Comm_split`, collective over this group: ranks passing the same `color` form a
    /// new group ordered by (`key`, rank here); `None` (MPI_UNDEFINED) joins none.
    ///
    /// # Errors
    /// Another rank failed, or the backend could not create the group.
    fn split(&self, color: Option<usize>, key: usize) -> Result<Option<Arc<dyn Communicator>>>;
}

/// The typed collectives, for every [`Communicator`] (also `dyn Communicator`).
pub trait Collectives: Communicator {
    /// [`Communicator::all_reduce_bytes`] on `buf`.
    ///
    /// # Errors
    /// As the byte-level method.
    fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_bytes(bytemuck::cast_slice_mut(buf), T::TYPE, op)
    }
    /// [`Communicator::reduce_scatter_bytes`]: in place, the result in chunk `rank()`.
    ///
    /// # Errors
    /// As the byte-level method.
    fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.reduce_scatter_bytes(bytemuck::cast_slice_mut(buf), T::TYPE, op)
    }
    /// Out of place: `output` (`input.len() / size()` long) = the reduction of chunk
    /// `rank()` of every rank's `input`. Copies `input` once.
    ///
    /// # Errors
    /// As the byte-level method, or `output` of the wrong length.
    fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let n = output.len();
        if input.len() != n * self.size() {
            return Err(mismatch(
                "reduce_scatter",
                format!(
                    "input of {} elements is not {} x output ({n})",
                    input.len(),
                    self.size()
                ),
            ));
        }
        let mut scratch = input.to_vec();
        self.reduce_scatter_in_place(&mut scratch, op)?;
        let r = self.rank();
        output.copy_from_slice(&scratch[r * n..(r + 1) * n]);
        Ok(())
    }
    /// [`Communicator::all_gather_bytes`]: in place, this rank's part in chunk `rank()`.
    ///
    /// # Errors
    /// As the byte-level method.
    fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.all_gather_bytes(bytemuck::cast_slice_mut(buf))
    }
    /// Out of place: `output` (`size() · input.len()` long) = every rank's `input` in rank
    /// order.
    ///
    /// # Errors
    /// As the byte-level method, or `output` of the wrong length.
    fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let n = input.len();
        if output.len() != n * self.size() {
            return Err(mismatch(
                "all_gather",
                format!(
                    "output of {} elements is not {} x input ({n})",
                    output.len(),
                    self.size()
                ),
            ));
        }
        let r = self.rank();
        output[r * n..(r + 1) * n].copy_from_slice(input);
        self.all_gather_in_place(output)
    }
    /// [`Communicator::broadcast_bytes`].
    ///
    /// # Errors
    /// As the byte-level method.
    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast_bytes(bytemuck::cast_slice_mut(buf), root)
    }
    /// [`Communicator::all_to_all_bytes`].
    ///
    /// # Errors
    /// As the byte-level method.
    fn all_to_all<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.all_to_all_bytes(
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        )
    }
    /// All-to-all with per-rank sizes (`torch.distributed.all_to_all_single` with
    /// `input_split_sizes` / `output_split_sizes`, MPI's `Alltoallv`; what MoE token
    /// dispatchers and Ulysses attention exchange): `input` is `send_counts[r]` elements for
    /// each rank `r` in rank order, `output` receives `recv_counts[r]` elements from each rank
    /// `r` in rank order. Every rank first learns what each peer will send it (an all-to-all
    /// of the counts) and all fail together if any count disagrees; the data then goes by
    /// [`send`](Self::send) / [`recv`](Self::recv) (sends before receives; every backend's
    /// sends complete without waiting for their receive).
    ///
    /// # Errors
    /// [`CommError::Mismatch`](crate::CommError::Mismatch) when a counts list is not `size()`
    /// long, does not add up to its buffer's length, or `recv_counts[r]` differs from what
    /// rank `r` sends (on every rank when on any); transport errors as the methods used.
    fn all_to_all_v<T: Element>(
        &self,
        input: &[T],
        send_counts: &[usize],
        output: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let (n, me) = (self.size(), self.rank());
        // Every rank fails when any does: first on counts that do not fit their buffers,
        // then on counts that disagree with what the peers send.
        let fail_together = |problem: Option<String>| -> Result<()> {
            let flag = problem.as_ref().map_or(0.0, |_| (me + 1) as f64);
            let worst = self.all_reduce_scalar(flag, ReduceOp::Max)?;
            match problem {
                Some(reason) => Err(mismatch("all_to_all_v", reason)),
                None if worst > 0.0 => Err(mismatch(
                    "all_to_all_v",
                    format!("rank {}'s counts are wrong", worst as usize - 1),
                )),
                None => Ok(()),
            }
        };
        fail_together(split_problem(
            n,
            (input.len(), send_counts),
            (output.len(), recv_counts),
        ))?;
        let sends: Vec<f64> = send_counts.iter().map(|&c| c as f64).collect();
        let mut incoming = vec![0f64; n];
        self.all_to_all(&sends, &mut incoming)?;
        fail_together(
            (0..n)
                .find(|&r| incoming[r] != recv_counts[r] as f64)
                .map(|r| {
                    format!(
                        "rank {me} expects {} elements from rank {r}, which sends {}",
                        recv_counts[r], incoming[r]
                    )
                }),
        )?;
        let offsets = |counts: &[usize]| {
            counts
                .iter()
                .scan(0, |at, &c| {
                    *at += c;
                    Some(*at - c..*at)
                })
                .collect::<Vec<_>>()
        };
        let (from, to) = (offsets(send_counts), offsets(recv_counts));
        for r in (0..n).filter(|&r| r != me) {
            self.send(&input[from[r].clone()], r)?;
        }
        output[to[me].clone()].copy_from_slice(&input[from[me].clone()]);
        for r in (0..n).filter(|&r| r != me) {
            self.recv(&mut output[to[r].clone()], r)?;
        }
        Ok(())
    }
    /// [`Communicator::send_bytes`].
    ///
    /// # Errors
    /// As the byte-level method.
    fn send<T: Element>(&self, buf: &[T], dest: usize) -> Result<()> {
        self.send_bytes(bytemuck::cast_slice(buf), dest)
    }
    /// [`Communicator::recv_bytes`].
    ///
    /// # Errors
    /// As the byte-level method.
    fn recv<T: Element>(&self, buf: &mut [T], src: usize) -> Result<()> {
        self.recv_bytes(bytemuck::cast_slice_mut(buf), src)
    }
    /// All-reduce of one scalar.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    fn all_reduce_scalar(&self, value: f64, op: ReduceOp) -> Result<f64> {
        let mut v = [value];
        self.all_reduce(&mut v, op)?;
        Ok(v[0])
    }
}

impl<C: Communicator + ?Sized> Collectives for C {}

/// What is wrong with [`Collectives::all_to_all_v`]'s arguments on this rank alone: each
/// `(buffer length, counts)` pair must have `n` counts adding up to the length.
fn split_problem(n: usize, send: (usize, &[usize]), recv: (usize, &[usize])) -> Option<String> {
    [("send", send), ("recv", recv)]
        .into_iter()
        .find_map(|(name, (len, counts))| {
            let sum: usize = counts.iter().sum();
            (counts.len() != n || sum != len).then(|| {
                format!(
                    "{name}_counts {counts:?} ({} for {n} ranks, sum {sum}) for a buffer of {len}",
                    counts.len()
                )
            })
        })
}

/// Checks that `len` bytes split into `parts` equal chunks of whole `ty` elements; returns
/// the chunk length in bytes.
///
/// # Errors
/// [`CommError::Mismatch`](crate::CommError::Mismatch) naming `op` otherwise.
pub(crate) fn chunk_len(op: &'static str, len: usize, parts: usize, ty: ElemType) -> Result<usize> {
    if parts == 0 || !len.is_multiple_of(parts) || !(len / parts).is_multiple_of(ty.size()) {
        return Err(mismatch(
            op,
            format!(
                "{len} bytes do not split into {parts} equal chunks of whole {ty:?} elements ({} \
                 bytes each)",
                ty.size()
            ),
        ));
    }
    Ok(len / parts)
}

/// Checks that `rank` is a member of a group of `size` for `op`.
///
/// # Errors
/// [`CommError::Rank`](crate::CommError::Rank) otherwise.
pub(crate) fn check_rank(op: &'static str, rank: usize, size: usize) -> Result<()> {
    if rank >= size {
        return Err(crate::CommError::Rank { op, rank, size });
    }
    Ok(())
}

/// Copies a received message into `buf`, whose length must match.
///
/// # Errors
/// [`CommError::Mismatch`](crate::CommError::Mismatch) naming the sender and both lengths.
pub(crate) fn deliver(msg: &[u8], buf: &mut [u8], src: usize) -> Result<()> {
    if msg.len() != buf.len() {
        return Err(mismatch(
            "recv",
            format!(
                "rank {src} sent {} bytes, the receive buffer holds {}",
                msg.len(),
                buf.len()
            ),
        ));
    }
    buf.copy_from_slice(msg);
    Ok(())
}

/// The byte range of part `r` of `parts` near-equal parts of `len` bytes, cut at whole
/// elements of `elem` bytes (how an all-reduce splits the reduction work over ranks).
pub(crate) fn part_range(
    len: usize,
    elem: usize,
    parts: usize,
    r: usize,
) -> std::ops::Range<usize> {
    let elems = len / elem;
    (r * elems / parts) * elem..((r + 1) * elems / parts) * elem
}

/// `out = reduce(inputs[0], inputs[1], ...)` element-wise, in rank order (deterministic).
/// `out` may not alias an input. `Avg` divides the sum by `inputs.len()`; bf16 is reduced in
/// f32 and rounded once.
///
/// # Errors
/// [`ElemType::U8`] cannot be reduced.
pub(crate) fn reduce_into(
    out: &mut [u8],
    inputs: &[&[u8]],
    ty: ElemType,
    op: ReduceOp,
) -> Result<()> {
    match ty {
        ElemType::F32 => reduce_slice::<f32>(bytemuck::cast_slice_mut(out), &cast_all(inputs), op),
        ElemType::F64 => reduce_slice::<f64>(bytemuck::cast_slice_mut(out), &cast_all(inputs), op),
        ElemType::Bf16 => reduce_bf16(bytemuck::cast_slice_mut(out), &cast_all(inputs), op),
        ElemType::U8 => return Err(mismatch("reduce", "u8 buffers cannot be reduced")),
    }
    Ok(())
}

fn cast_all<'a, T: bytemuck::Pod>(inputs: &[&'a [u8]]) -> Vec<&'a [T]> {
    inputs.iter().map(|b| bytemuck::cast_slice(b)).collect()
}

/// The element-wise reduction over `ins` (at least one) into `out`. NaN wins Max and Min.
fn reduce_slice<T>(out: &mut [T], ins: &[&[T]], op: ReduceOp)
where
    T: Copy + PartialOrd + std::ops::AddAssign + std::ops::DivAssign + From<u16>,
{
    out.copy_from_slice(ins[0]);
    #[allow(clippy::eq_op)] // `v != v`: NaN
    for x in &ins[1..] {
        let pairs = out.iter_mut().zip(x.iter());
        match op {
            ReduceOp::Sum | ReduceOp::Avg => pairs.for_each(|(o, &v)| *o += v),
            ReduceOp::Max => pairs.for_each(|(o, &v)| {
                if v > *o || v != v {
                    *o = v;
                }
            }),
            ReduceOp::Min => pairs.for_each(|(o, &v)| {
                if v < *o || v != v {
                    *o = v;
                }
            }),
        }
    }
    if op == ReduceOp::Avg {
        let n = T::from(ins.len() as u16);
        out.iter_mut().for_each(|o| *o /= n);
    }
}

/// bf16 reduced in f32, chunk by chunk, rounded once.
fn reduce_bf16(out: &mut [bf16], ins: &[&[bf16]], op: ReduceOp) {
    const CHUNK: usize = 4096;
    let mut wide: Vec<Vec<f32>> = vec![Vec::with_capacity(CHUNK); ins.len()];
    let mut acc = vec![0.0f32; CHUNK];
    for start in (0..out.len()).step_by(CHUNK) {
        let end = (start + CHUNK).min(out.len());
        for (w, x) in wide.iter_mut().zip(ins) {
            w.clear();
            w.extend(x[start..end].iter().map(|v| v.to_f32()));
        }
        let views: Vec<&[f32]> = wide.iter().map(Vec::as_slice).collect();
        let acc = &mut acc[..end - start];
        reduce_slice(acc, &views, op);
        for (o, &a) in out[start..end].iter_mut().zip(acc.iter()) {
            *o = bf16::from_f32(a);
        }
    }
}
