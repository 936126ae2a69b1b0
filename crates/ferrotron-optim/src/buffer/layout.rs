//! Placement of parameters in the flat buffer and its split into buckets.
//!
//! Mirrors the layout pass of Megatron-Core's `_ParamAndGradBuffer.__init__`
//! (megatron/core/distributed/param_and_grad_buffer.py): params are placed in reverse
//! registration order (so buckets fill in backward order), each param start is padded to a
//! multiple of 64 elements, a bucket is closed once it holds `>= bucket_size` elements, and
//! each bucket end is padded to a multiple of `lcm(data_parallel_size, 128)` so that the bucket
//! splits into `dp` equal shards for reduce-scatter / the distributed optimizer.

use std::ops::Range;

use ferrotron_tensor::DType;
use serde::{Deserialize, Serialize};

use crate::error::{Result, config_err};

/// Megatron's default DDP bucket size in elements: `max(40_000_000, 1_000_000 * dp_size)`
/// (megatron/core/distributed/distributed_data_parallel.py).
pub fn default_bucket_size(data_parallel_size: usize) -> usize {
    40_000_000usize.max(1_000_000 * data_parallel_size)
}

/// Alignment of each parameter's start (elements) when `pad_for_sharding`: 64 values = 128
/// bytes at 16-bit precision (Megatron `_pad_start_of_param_if_needed`).
pub const PARAM_START_ALIGN: usize = 64;
/// Bucket ends are padded to a multiple of `lcm(dp, 128)` when `pad_for_sharding`
/// (Megatron `_pad_end_of_bucket_if_needed`, 256-byte alignment at 16-bit precision).
pub const BUCKET_END_ALIGN: usize = 128;

/// How a [`ParamAndGradBuffer`](crate::ParamAndGradBuffer) lays out its parameters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferConfig {
    /// Storage type of the parameter buffer: f32, bf16 or f16. Gradients are always f32.
    /// Serialized as `"f32"` / `"bf16"` / `"f16"`.
    #[serde(with = "dtype_serde")]
    pub param_dtype: DType,
    /// Data-parallel size the buckets must split evenly over (1 on a single rank).
    pub data_parallel_size: usize,
    /// Close a bucket once it holds at least this many elements; `None` puts every parameter
    /// in one bucket (Megatron does that when `overlap_grad_reduce` is off).
    pub bucket_size: Option<usize>,
    /// Place parameters in reverse registration order (Megatron always does: the model
    /// registers first-layer-first, backward produces gradients last-layer-first, so reverse
    /// order lets bucket 0 complete first during backward). `false` keeps registration order.
    pub reverse_order: bool,
    /// Pad param starts to 64 and bucket ends to `lcm(dp, 128)` elements, and give a
    /// `shared_embedding` parameter its own bucket. Megatron pads only with
    /// `use_distributed_optimizer`; we default to `true` so DDP and ZeRO-1 runs share one
    /// layout (and one checkpoint format). Costs < 64 elements per param + 128 per bucket.
    pub pad_for_sharding: bool,
}

impl BufferConfig {
    /// Megatron defaults for `param_dtype` on `data_parallel_size` ranks: bucket size
    /// [`default_bucket_size`], reverse order, padding on.
    pub fn new(param_dtype: DType, data_parallel_size: usize) -> Self {
        BufferConfig {
            param_dtype,
            data_parallel_size,
            bucket_size: Some(default_bucket_size(data_parallel_size.max(1))),
            reverse_order: true,
            pad_for_sharding: true,
        }
    }

    /// Checks `data_parallel_size >= 1` and `bucket_size >= 1`.
    ///
    /// # Errors
    /// [`OptimError::Config`](crate::OptimError::Config) naming the field.
    pub fn validate(&self) -> Result<()> {
        if self.data_parallel_size == 0 {
            return Err(config_err("data_parallel_size must be >= 1, got 0"));
        }
        if self.bucket_size == Some(0) {
            return Err(config_err(
                "ddp_bucket_size must be >= 1 (or unset for a single bucket), got 0",
            ));
        }
        Ok(())
    }

    /// Elements each bucket's (padded) size is a multiple of: `lcm(dp, 128)` when padding,
    /// else 1.
    pub fn bucket_size_divisor(&self) -> usize {
        if self.pad_for_sharding {
            lcm(self.data_parallel_size, BUCKET_END_ALIGN)
        } else {
            1
        }
    }
}

/// Index of a parameter in registration order (the order of
/// [`ParamAndGradBuffer::params`](crate::ParamAndGradBuffer::params)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ParamId(pub usize);

impl ParamId {
    /// The registration index.
    pub fn index(self) -> usize {
        self.0
    }
}

/// `DType` as its short name (`ferrotron-tensor` has no serde).
mod dtype_serde {
    use ferrotron_tensor::DType;
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(d: &DType, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(d)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DType, D::Error> {
        let name = String::deserialize(d)?;
        DType::parse(&name).ok_or_else(|| D::Error::custom(format!("unknown dtype `{name}`")))
    }
}

/// Properties of a parameter that the optimizer and the gradient statistics look at.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamFlags {
    /// A norm weight or a bias: excluded from weight decay by default.
    pub is_norm_or_bias: bool,
    /// An embedding (input embedding or output layer) weight.
    pub is_embedding: bool,
    /// The word embedding tied between the first and last pipeline stage (Megatron's
    /// `shared_embedding`); with `pad_for_sharding` it gets a bucket of its own so both
    /// stages shard it identically.
    pub shared_embedding: bool,
    /// Leave this gradient out of the global grad norm: set it on tensor-parallel duplicates
    /// on tp rank > 0 and on the last stage's copy of a tied embedding (Megatron's
    /// `param_is_not_tensor_parallel_duplicate` / `param_is_not_shared` filter).
    pub exclude_from_grad_norm: bool,
    /// Frozen (Megatron's `requires_grad = False`, e.g. a LoRA model's base): registered so
    /// every per-parameter list keeps the model's order, but it takes no elements of the
    /// buffer, no bucket, no gradient and no optimizer state.
    #[serde(default)]
    pub frozen: bool,
    /// A routed experts' parameter of an expert-parallel model: its gradient is reduced over
    /// the expert-data-parallel group, not the data-parallel one, so it never shares a
    /// bucket with other parameters (Megatron keeps expert parameters in buffers of their
    /// own).
    #[serde(default)]
    pub expert_parallel: bool,
    /// The FSDP unit of a ZeRO-2/3 layout (Megatron-FSDP's `fsdp_unit_modules`: the
    /// embedding, a transformer layer, the output head), numbered in model order: a bucket
    /// never holds two units, so a unit's gradients are reduce-scattered and its parameters
    /// all-gathered together, bucket by bucket. 0 for every parameter otherwise.
    #[serde(default)]
    pub fsdp_unit: u32,
}

impl ParamFlags {
    /// Megatron's default rule (`get_param_groups`): a parameter is treated as norm/bias (no
    /// weight decay) when it is 1-D or its name ends with `.bias`.
    pub fn from_name_and_shape(name: &str, shape: &[usize]) -> Self {
        ParamFlags {
            is_norm_or_bias: shape.len() == 1 || name.ends_with(".bias"),
            ..ParamFlags::default()
        }
    }
}

/// Where one parameter lives in the buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamInfo {
    /// Registration name, e.g. `decoder.layers.0.self_attention.linear_qkv.weight`.
    pub name: String,
    /// Logical shape (row-major); `numel` is its product.
    pub shape: Vec<usize>,
    /// Number of elements in the buffer: the shape's product, 0 for a frozen parameter.
    pub numel: usize,
    /// First flat element index in the param and grad buffers.
    pub offset: usize,
    /// Index of the bucket holding this parameter; `None` for a frozen one.
    pub bucket_id: Option<usize>,
    /// Weight-decay / norm / embedding flags.
    pub flags: ParamFlags,
}

impl ParamInfo {
    /// Flat index range `offset..offset + numel`.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel
    }
}

/// One bucket: a contiguous, padded flat range whose gradients are communicated together.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketInfo {
    /// Bucket index (0 = the bucket filled first during backward when `reverse_order`).
    pub id: usize,
    /// First flat element index.
    pub start: usize,
    /// One past the last element, padding included (a multiple of the bucket divisor).
    pub end: usize,
    /// Elements from `start` up to the end of the last parameter (Megatron's
    /// `numel_unpadded`: alignment gaps between params included, end padding excluded).
    pub numel_unpadded: usize,
    /// Parameters in buffer order.
    pub params: Vec<ParamId>,
    /// Holds expert-parallel parameters (all of its parameters are, or none).
    #[serde(default)]
    pub expert_parallel: bool,
}

impl BucketInfo {
    /// Flat range `start..end`.
    pub fn range(&self) -> Range<usize> {
        self.start..self.end
    }

    /// The contiguous shard of this bucket owned by data-parallel rank `dp_rank` out of
    /// `dp_size` (Megatron's `shard_buffer`): `start + r * len/dp .. start + (r+1) * len/dp`.
    ///
    /// # Panics
    /// When `dp_rank >= dp_size` or the bucket length is not divisible by `dp_size` (it always
    /// is for the `dp_size` the buffer was built with and `pad_for_sharding`).
    pub fn shard_range(&self, dp_rank: usize, dp_size: usize) -> Range<usize> {
        assert!(dp_rank < dp_size, "dp_rank {dp_rank} >= dp_size {dp_size}");
        let len = self.end - self.start;
        assert!(
            len.is_multiple_of(dp_size),
            "bucket {} has {len} elements, not divisible by dp_size {dp_size}",
            self.id
        );
        let shard = len / dp_size;
        self.start + dp_rank * shard..self.start + (dp_rank + 1) * shard
    }
}

/// Result of the layout pass: per-param offsets and bucket ids, the buckets, the total size.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    /// (offset, bucket_id) per param id.
    pub placements: Vec<(usize, Option<usize>)>,
    pub buckets: Vec<BucketInfo>,
    pub numel: usize,
}

fn pad_to(n: usize, divisor: usize) -> usize {
    n.div_ceil(divisor) * divisor
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn lcm(a: usize, b: usize) -> usize {
    a / gcd(a, b) * b
}

/// Closes the open bucket at `end` (padded up to `divisor`); returns the padded end.
fn close_bucket(
    buckets: &mut Vec<BucketInfo>,
    end: usize,
    divisor: usize,
    start: &mut usize,
    (members, expert_parallel): (&mut Vec<ParamId>, bool),
) -> usize {
    let padded_end = pad_to(end, divisor);
    buckets.push(BucketInfo {
        id: buckets.len(),
        start: *start,
        end: padded_end,
        numel_unpadded: end - *start,
        params: std::mem::take(members),
        expert_parallel,
    });
    *start = padded_end;
    padded_end
}

/// Computes the layout of params with the given element counts and flags (indexed by
/// registration id). Megatron's algorithm, see the module docs; a frozen parameter is left
/// out (no elements, no bucket), as Megatron builds its buffers from the parameters that
/// require gradients.
pub(crate) fn compute_layout(config: &BufferConfig, params: &[(usize, ParamFlags)]) -> Layout {
    let divisor = config.bucket_size_divisor();
    let pad = config.pad_for_sharding;
    let mut placements = vec![(0usize, None); params.len()];
    let mut buckets: Vec<BucketInfo> = Vec::new();
    let mut bucket_start = 0usize;
    let mut bucket_params: Vec<ParamId> = Vec::new();
    let mut param_start = 0usize;
    let mut param_end = 0usize;
    let mut bucket_expert = false;
    let mut bucket_unit = 0u32;

    let order: Vec<usize> = if config.reverse_order {
        (0..params.len()).rev().collect()
    } else {
        (0..params.len()).collect()
    };
    for id in order {
        let (numel, flags) = params[id];
        if flags.frozen {
            placements[id] = (param_start, None);
            continue;
        }
        if pad {
            param_start = pad_to(param_start, PARAM_START_ALIGN);
        }
        let own_bucket = pad && flags.shared_embedding;
        // Expert-parallel parameters and the others never share a bucket, nor do two FSDP
        // units.
        let switch = flags.expert_parallel != bucket_expert || flags.fsdp_unit != bucket_unit;
        if (own_bucket || switch) && !bucket_params.is_empty() {
            param_start = close_bucket(
                &mut buckets,
                param_start,
                divisor,
                &mut bucket_start,
                (&mut bucket_params, bucket_expert),
            );
        }
        bucket_expert = flags.expert_parallel;
        bucket_unit = flags.fsdp_unit;
        param_end = param_start + numel;
        placements[id] = (param_start, Some(buckets.len()));
        bucket_params.push(ParamId(id));
        let full = config
            .bucket_size
            .is_some_and(|size| param_end - bucket_start >= size);
        param_start = if full || own_bucket {
            close_bucket(
                &mut buckets,
                param_end,
                divisor,
                &mut bucket_start,
                (&mut bucket_params, bucket_expert),
            )
        } else {
            param_end
        };
    }
    if !bucket_params.is_empty() {
        close_bucket(
            &mut buckets,
            param_end,
            divisor,
            &mut bucket_start,
            (&mut bucket_params, bucket_expert),
        );
    }
    let numel = buckets.last().map_or(0, |b| b.end);
    Layout {
        placements,
        buckets,
        numel,
    }
}
