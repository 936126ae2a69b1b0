//! Context parallelism: core attention over a sequence split along `s` across the ranks of a
//! context-parallel group (Megatron-Core's `--context-parallel-size` with Transformer
//! Engine's `attn_forward_func_with_cp`, `transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py`).
//!
//! **Load-balanced split.** The sequence of `S` tokens is cut into `2·C` chunks of
//! `n = S / (2C)` tokens; rank `r` holds chunks `r` and `2C − 1 − r` (for `C = 2`: rank 0
//! holds 0 and 3, rank 1 holds 1 and 2), so every rank does the same causal work
//! (Megatron's `get_batch_on_this_cp_rank`). Every per-token input is split this way
//! ([`ContextParallel::share`]); positions stay global, so rotary embeddings, sliding windows,
//! packed documents and ALiBi see absolute positions.
//!
//! **Core attention** ([`ContextParallel::attention_forward`] / `_backward`): q, k, v are this
//! rank's `[2n, b, heads, d]` (its two chunks in order); the keys and values of the other
//! chunks come by [`CpCommType`]:
//! - `p2p` (`ring.rs`): the KV chunks travel around the ring, the next transfer in flight
//!   while the current block computes; each (query chunk, key chunk) block gives a partial
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
mod ulysses;

use std::sync::Arc;

use ferrotron_comm::Communicator;

use crate::attention::{AttentionDims, AttentionMask, AttentionPrecision};
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

    /// The global chunk indices this rank holds, in local order: `[r, 2C − 1 − r]`.
    pub fn chunks(&self) -> [usize; 2] {
        chunks_of(self.rank(), self.size())
    }

    /// Tokens per sequence on this rank for a sequence of `seq` tokens: `seq / C`.
    ///
    /// # Errors
    /// [`NnError::BadInput`] naming `seq_length` when `seq` does not divide by `2·C`.
    pub fn local_seq(&self, seq: usize) -> Result<usize> {
        let c = self.size();
        if !seq.is_multiple_of(2 * c) {
            return Err(NnError::BadInput {
                field: "seq_length".into(),
                reason: format!(
                    "{seq} tokens do not split into 2 x context_parallel_size = {} equal chunks",
                    2 * c
                ),
            });
        }
        Ok(seq / c)
    }

    /// This rank's share of a per-token array `x: [seq, width]` (`width` values per token,
    /// e.g. the micro-batch `b` of an `[s, b]` array): its two chunks, `[seq / C, width]`.
    ///
    /// # Errors
    /// As [`ContextParallel::local_seq`], or `x` not `seq · width` long.
    pub fn share<T: Copy>(&self, x: &[T], seq: usize, width: usize) -> Result<Vec<T>> {
        let n = self.local_seq(seq)? / 2;
        if x.len() != seq * width {
            return Err(NnError::BadInput {
                field: "context-parallel share".into(),
                reason: format!("{} values are not [{seq}, {width}]", x.len()),
            });
        }
        Ok(self
            .chunks()
            .iter()
            .flat_map(|&c| x[c * n * width..(c + 1) * n * width].iter().copied())
            .collect())
    }

    /// Global position of local token `t` of a rank holding `local_seq` tokens per
    /// sequence.
    pub fn global_position(&self, t: usize, local_seq: usize) -> usize {
        let n = local_seq / 2;
        self.chunks()[t / n] * n + t % n
    }

    /// Core attention over the context-parallel sequence: `out: [2n, b, a, d]` and `lse`
    /// (this rank's queries' softmax statistic; `[2n, b, a]` for `p2p` / `all_gather`, the
    /// head-split `[S, b, a/C]` for `a2a` — only the backward reads it) from this rank's
    /// `q: [2n, b, a, d]`, `k, v: [2n, b, g, d]` (after rope). `dims` are the local ones
    /// (`sq = skv = 2n`, no offsets); `mask.documents`, when set, are the **whole**
    /// sequence's `[S, b]` starts.
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

    /// Backward of [`ContextParallel::attention_forward`]: `dq: [2n, b, a, d]`, `dk, dv:
    /// [2n, b, g, d]` (**overwritten**) from the forward's inputs, `out`, `lse` and `dout`.
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

/// Global chunk indices of rank `r` of `c`.
fn chunks_of(r: usize, c: usize) -> [usize; 2] {
    [r, 2 * c - 1 - r]
}

/// What every exchange works with: the group, the local dims, the chunk length `n` and
/// per-chunk element counts.
struct Blocks<'a> {
    cp: &'a ContextParallel,
    dims: AttentionDims,
    mask: AttentionMask<'a>,
    precision: AttentionPrecision,
    /// Tokens per chunk.
    n: usize,
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
        assert!(dims.sq.is_multiple_of(2), "a rank holds two chunks");
        if let Some(docs) = mask.documents {
            assert!(
                docs.seq_len() == dims.sq * cp.size(),
                "context-parallel attention needs the whole sequence's document starts"
            );
        }
        Ok(Blocks {
            cp,
            dims,
            mask,
            precision,
            n: dims.sq / 2,
        })
    }

    /// Elements of one chunk of rows with `heads` heads.
    fn chunk_len(&self, heads: usize) -> usize {
        self.n * self.dims.batch * heads * self.dims.head_dim
    }

    /// Elements of one chunk of the queries, of the keys (or values), and of the
    /// log-sum-exp.
    fn chunk_lens(&self) -> (usize, usize, usize) {
        let d = &self.dims;
        (
            self.chunk_len(d.heads),
            self.chunk_len(d.groups),
            self.n * d.batch * d.heads,
        )
    }

    /// Dims of the block of query chunk `qc` against key chunk `kc` (global indices).
    fn block_dims(&self, qc: usize, kc: usize) -> AttentionDims {
        AttentionDims {
            sq: self.n,
            skv: self.n,
            q_offset: qc * self.n,
            kv_offset: kc * self.n,
            ..self.dims
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

/// Chunk `at` of `x` in chunks of `len` values.
fn chunk(x: &[f32], len: usize, at: usize) -> &[f32] {
    &x[at * len..][..len]
}

/// `acc += x`.
fn add(acc: &mut [f32], x: &[f32]) {
    acc.iter_mut().zip(x).for_each(|(a, &b)| *a += b);
}

/// The communicator's error as this crate's.
fn comm_err(e: ferrotron_comm::CommError) -> NnError {
    NnError::Comm(format!("context parallel: {e}"))
}
