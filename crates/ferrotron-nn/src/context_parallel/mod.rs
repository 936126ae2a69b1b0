//! Context parallelism: core attention over a sequence split along `s` across the ranks of a
//! context-parallel group (Megatron-Core's `--context-parallel-size` with Transformer
//! Engine's `attn_forward_func_with_cp`, `transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py`).
//!
//! **Load-balanced split** ([`SequenceSplit`], `split.rs`). The sequence of `S` tokens is cut
//! into `2·C` chunks of `n = S / (2C)` tokens; rank `r` holds chunks `r` and `2C − 1 − r`
//! (for `C = 2`: rank 0 holds 0 and 3, rank 1 holds 1 and 2), so every rank does the same
//! causal work (Megatron's `get_batch_on_this_cp_rank`). Packed rows (document starts given)
//! are split **per document** the same way (Megatron's THD path). Every per-token input is
//! split this way ([`SequenceSplit::share`]); positions stay global, so rotary embeddings,
//! sliding windows and ALiBi see absolute positions.
//!
//! **Core attention** ([`ContextParallel::attention_forward`] / `_backward`): q, k, v are this
//! rank's `[S/C, b, heads, d]` (its runs in order); the keys and values of the other ranks
//! come by [`CpCommType`]:
//! - `p2p` (`ring.rs`): the KV travels around the ring, the next transfer in flight while the
//!   current blocks compute; each (query run, key run) block of one document gives a partial
//!   output and log-sum-exp merged exactly ([`merge_partial`]); the backward passes dK/dV
//!   around the ring;
//! - `all_gather` (`gather.rs`): the whole sequence's K/V gathered once, dK/dV
//!   reduce-scattered back;
//! - `a2a` (`ulysses.rs`, DeepSpeed-Ulysses): all-to-alls trade the sequence split for a head
//!   split, attention runs over the whole sequence on `heads / C` heads.
//!
//! The result is the single rank's attention up to f32 rounding (the merge of `p2p`).

mod gather;
mod ring;
mod split;
mod ulysses;

pub use split::{Run, SequenceSplit};

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use ferrotron_comm::Communicator;

use crate::attention::{
    AttentionDims, AttentionMask, AttentionPrecision, DocumentStarts, core_attention_backward,
};
use crate::{NnError, Result};

/// How the keys and values of the other chunks reach a rank (Megatron's `--cp-comm-type`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CpCommType {
    /// Ring exchange of KV chunks, overlapped with the blocks' compute.
    #[default]
    P2p,
    /// The whole sequence's K/V all-gathered before attention.
    AllGather,
    /// All-to-all from a sequence split to a head split (DeepSpeed-Ulysses); the local query
    /// heads and KV heads must divide by the group size.
    A2a,
}

impl CpCommType {
    /// Megatron's name (`p2p`, `all_gather`, `a2a`).
    pub fn name(self) -> &'static str {
        match self {
            CpCommType::P2p => "p2p",
            CpCommType::AllGather => "all_gather",
            CpCommType::A2a => "a2a",
        }
    }

    /// The type named `name` (Megatron's names), or `None`.
    pub fn from_name(name: &str) -> Option<CpCommType> {
        [CpCommType::P2p, CpCommType::AllGather, CpCommType::A2a]
            .into_iter()
            .find(|t| t.name() == name)
    }
}

/// A rank's context-parallel group and how its attention exchanges keys and values.
#[derive(Clone)]
pub struct ContextParallel {
    comm: Arc<dyn Communicator>,
    comm_type: CpCommType,
}

impl std::fmt::Debug for ContextParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContextParallel")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("comm_type", &self.comm_type)
            .finish()
    }
}

impl ContextParallel {
    /// The group `comm` exchanging keys and values by `comm_type`.
    pub fn new(comm: Arc<dyn Communicator>, comm_type: CpCommType) -> ContextParallel {
        ContextParallel { comm, comm_type }
    }

    /// Context-parallel rank `r`.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Context-parallel size `C`.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// The exchange of keys and values.
    pub fn comm_type(&self) -> CpCommType {
        self.comm_type
    }

    /// The group.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// How a micro-batch of `seq` positions and `batch` rows splits over the group: by
    /// documents when `documents` (the whole sequence's `[seq, batch]` starts) are given,
    /// else by chunks ([`SequenceSplit`]).
    ///
    /// # Errors
    /// [`NnError::BadInput`] naming `seq_length` when `seq` does not divide by `2·C`.
    pub fn split(
        &self,
        seq: usize,
        batch: usize,
        documents: Option<DocumentStarts>,
    ) -> Result<SequenceSplit> {
        SequenceSplit::new(seq, batch, self.size(), documents)
    }

    /// Core attention over the context-parallel sequence: `out: [S/C, b, a, d]` and `lse`
    /// (this rank's queries' softmax statistic; `[S/C, b, a]` for `p2p` / `all_gather`, the
    /// head-split `[S, b, a/C]` for `a2a` — only the backward reads it) from this rank's
    /// `q: [S/C, b, a, d]`, `k, v: [S/C, b, g, d]` (after rope, split as
    /// [`ContextParallel::split`] says). `dims` are the local ones (`sq = skv = S/C`, no
    /// offsets); `mask.documents`, when set, are the **whole** sequence's `[S, b]` starts (and
    /// the split is by documents).
    ///
    /// # Errors
    /// [`NnError::Comm`] when an exchange fails; [`NnError::BadInput`] for `a2a` with heads
    /// that do not divide by `C`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_forward(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
        lse: &mut [f32],
        dims: AttentionDims,
        mask: AttentionMask,
        precision: AttentionPrecision,
    ) -> Result<()> {
        let io = Blocks::new(self, dims, mask, precision)?;
        match self.comm_type {
            CpCommType::P2p => ring::forward(&io, [q, k, v], out, lse),
            CpCommType::AllGather => gather::forward(&io, [q, k, v], out, lse),
            CpCommType::A2a => ulysses::forward(&io, [q, k, v], out, lse),
        }
    }

    /// Backward of [`ContextParallel::attention_forward`]: `dq: [S/C, b, a, d]`, `dk, dv:
    /// [S/C, b, g, d]` (**overwritten**) from the forward's inputs, `out`, `lse` and `dout`.
    ///
    /// # Errors
    /// As the forward.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward(
        &self,
        [q, k, v]: [&[f32]; 3],
        out: &[f32],
        dout: &[f32],
        lse: &[f32],
        [dq, dk, dv]: [&mut [f32]; 3],
        dims: AttentionDims,
        mask: AttentionMask,
        precision: AttentionPrecision,
    ) -> Result<()> {
        let io = Blocks::new(self, dims, mask, precision)?;
        let grads = [dq, dk, dv];
        match self.comm_type {
            CpCommType::P2p => ring::backward(&io, [q, k, v], [out, dout, lse], grads),
            CpCommType::AllGather => gather::backward(&io, [q, k, v], [out, dout, lse], grads),
            CpCommType::A2a => ulysses::backward(&io, [q, k, v], [out, dout, lse], grads),
        }
    }
}

/// What every exchange works with: the group, the local dims, the mask, and every rank's
/// tokens.
struct Blocks<'a> {
    cp: &'a ContextParallel,
    dims: AttentionDims,
    mask: AttentionMask<'a>,
    precision: AttentionPrecision,
    split: SequenceSplit,
}

impl<'a> Blocks<'a> {
    fn new(
        cp: &'a ContextParallel,
        dims: AttentionDims,
        mask: AttentionMask<'a>,
        precision: AttentionPrecision,
    ) -> Result<Blocks<'a>> {
        assert!(
            dims.sq == dims.skv && dims.q_offset == 0 && dims.kv_offset == 0,
            "context-parallel attention takes the local dims ({dims:?})"
        );
        let seq = dims.sq * cp.size();
        if let Some(docs) = mask.documents {
            assert!(
                docs.seq_len() == seq,
                "context-parallel attention needs the whole sequence's document starts"
            );
        }
        let split = cp.split(seq, dims.batch, mask.documents)?;
        Ok(Blocks {
            cp,
            dims,
            mask,
            precision,
            split,
        })
    }

    /// Values per token of a row with `heads` heads.
    fn width(&self, heads: usize) -> usize {
        heads * self.dims.head_dim
    }

    /// Rows `run.rows` of tokens `tokens` of a local or whole-sequence array `x: [s, b, w]`.
    fn take<'x>(&self, x: &'x [f32], w: usize, run: &Run, tokens: Range<usize>) -> Cow<'x, [f32]> {
        split::take(x, self.dims.batch, w, &run.rows, tokens)
    }

    /// Writes `src` into rows `run.rows` of tokens `tokens` of `x: [s, b, w]`.
    fn put(&self, x: &mut [f32], w: usize, run: &Run, tokens: Range<usize>, src: &[f32]) {
        split::put(x, self.dims.batch, w, &run.rows, tokens, src);
    }

    /// Adds `src` into rows `run.rows` of tokens `tokens` of `x: [s, b, w]`.
    fn put_add(&self, x: &mut [f32], w: usize, run: &Run, tokens: Range<usize>, src: &[f32]) {
        split::put_add(x, self.dims.batch, w, &run.rows, tokens, src);
    }

    /// Dims of query run `q` against `skv` keys from position `kv_offset`.
    fn block_dims(&self, q: &Run, kv_offset: usize, skv: usize) -> AttentionDims {
        AttentionDims {
            sq: q.len,
            skv,
            batch: q.rows.len(),
            q_offset: q.start,
            kv_offset,
            ..self.dims
        }
    }

    /// One block's backward: query run `run` (its rows of this rank's `[q, out, dout, lse]`)
    /// against the keys and values at tokens `kv_tokens` of `[k, v]` (the run's rows; at
    /// positions from `kv_start`): the block's `[dq, dk, dv]`.
    fn block_backward(
        &self,
        [q, out, dout, lse]: [&[f32]; 4],
        run: &Run,
        [k, v]: [&[f32]; 2],
        (kv_tokens, kv_start): (Range<usize>, usize),
    ) -> [Vec<f32>; 3] {
        let (a, wq, wk) = (
            self.dims.heads,
            self.width(self.dims.heads),
            self.width(self.dims.groups),
        );
        let [qx, ox, dox] = [q, out, dout].map(|x| self.take(x, wq, run, run.local_tokens()));
        let lx = self.take(lse, a, run, run.local_tokens());
        let [kx, vx] = [k, v].map(|x| self.take(x, wk, run, kv_tokens.clone()));
        let mut grads = [qx.len(), kx.len(), vx.len()].map(|n| vec![0f32; n]);
        let [bq, bk, bv] = &mut grads;
        core_attention_backward(
            &qx,
            &kx,
            &vx,
            &ox,
            &dox,
            &lx,
            bq,
            bk,
            bv,
            self.block_dims(run, kv_start, kv_tokens.len()),
            self.block_mask(),
            self.precision,
        );
        grads
    }

    /// The mask of a block of runs: the blocks of a document split pair runs of one document,
    /// so only the window and ALiBi remain (they compare absolute positions).
    fn block_mask(&self) -> AttentionMask<'a> {
        AttentionMask {
            documents: None,
            ..self.mask
        }
    }
}

/// Folds a partial attention result into an accumulated one (FlashAttention's online
/// softmax across blocks; TE's `flash_attn_fwd_out_correction`): per query row and head,
/// `lse = log(e^lse_acc + e^lse_b)`, `out = out_acc·e^(lse_acc − lse) + out_b·e^(lse_b − lse)`.
/// Rows the block did not reach (`lse_b = −∞`) are unchanged. `out*: [rows, d]`, `lse*:
/// [rows]`.
pub fn merge_partial(out_acc: &mut [f32], lse_acc: &mut [f32], out_b: &[f32], lse_b: &[f32]) {
    let d = out_acc.len() / lse_acc.len().max(1);
    for (r, (la, &lb)) in lse_acc.iter_mut().zip(lse_b).enumerate() {
        if lb == f32::NEG_INFINITY {
            continue;
        }
        let (oa, ob) = (&mut out_acc[r * d..][..d], &out_b[r * d..][..d]);
        if *la == f32::NEG_INFINITY {
            oa.copy_from_slice(ob);
            *la = lb;
            continue;
        }
        let m = la.max(lb);
        let (wa, wb) = ((*la - m).exp(), (lb - m).exp());
        let sum = wa + wb;
        let (wa, wb) = (wa / sum, wb / sum);
        for (a, &b) in oa.iter_mut().zip(ob) {
            *a = *a * wa + b * wb;
        }
        *la = m + sum.ln();
    }
}

/// The communicator's error as this crate's.
fn comm_err(e: ferrotron_comm::CommError) -> NnError {
    NnError::Comm(format!("context parallel: {e}"))
}
