//! `[optimizer]`'s offload keys into an [`OffloadConfig`]: the policy by Pai-Megatron-Patch's
//! names, the fraction, the directory (it must exist; that it takes a file and has the free
//! space is checked when the optimizer is built, before training) and the auto policy's
//! budget.

use super::sections::RawConfig;
use ferrotron_optim::offload::{OffloadConfig, OffloadPolicy};

/// The offload settings of `r`, every problem pushed to `p` naming its key.
pub(super) fn offload(r: &RawConfig, p: &mut Vec<String>) -> OffloadConfig {
    let o = &r.optimizer;
    let policy = match o.optimizer_offload_policy.as_str() {
        "none" => OffloadPolicy::None,
        "static" => {
            let fraction = o.optimizer_offload_fraction;
            if !(0.0..=1.0).contains(&fraction) {
                p.push(format!(
                    "optimizer.optimizer_offload_fraction ({fraction}) must be in [0, 1]"
                ));
            }
            OffloadPolicy::Static { fraction }
        }
        "auto" => {
            let gib = o.offload_memory_budget_gib.unwrap_or_else(|| {
                p.push(
                    "optimizer.offload_memory_budget_gib is required with \
                     optimizer_offload_policy = \"auto\""
                        .to_string(),
                );
                0.0
            });
            if gib.is_nan() || gib < 0.0 {
                p.push(format!(
                    "optimizer.offload_memory_budget_gib ({gib}) must be non-negative"
                ));
            }
            if r.parallel.pipeline_model_parallel_size > 1 {
                p.push(
                    "not supported yet: optimizer_offload_policy = \"auto\" with \
                     pipeline_model_parallel_size > 1 (a stage's passes do not measure their \
                     activation peak)"
                        .to_string(),
                );
            }
            OffloadPolicy::Auto {
                budget_bytes: (gib.max(0.0) * (1u64 << 30) as f64) as u64,
            }
        }
        other => {
            p.push(format!(
                "optimizer.optimizer_offload_policy: `{other}` is not one of none, static, auto"
            ));
            OffloadPolicy::None
        }
    };
    if o.offload_chunk_size == Some(0) {
        p.push("optimizer.offload_chunk_size must be at least 1".to_string());
    }
    match (&o.offload_path, policy) {
        (None, OffloadPolicy::None) => {}
        (None, _) => p.push(
            "optimizer.offload_path is required with an optimizer_offload_policy".to_string(),
        ),
        (Some(dir), _) => {
            // Writability and free space: when the optimizer is built, before training.
            if !dir.is_dir() {
                p.push(format!(
                    "optimizer.offload_path {} is not a directory",
                    dir.display()
                ));
            }
        }
    }
    OffloadConfig {
        policy,
        path: o.offload_path.clone(),
        chunk_size: o.offload_chunk_size,
    }
}
