//! The Megatron-style log lines (`training_log` and `evaluate_and_print_results` in
//! `megatron/training/training.py`) and their JSON form for `metrics.jsonl`.

use super::{DpoMetrics, MoeMetrics, OffloadStats};
use serde::{Deserialize, Serialize};
use std::fmt;

/// One training log line, aggregated over the `log_interval` iterations ending at
/// `iteration`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LogLine {
    /// Last iteration of the interval (1-based).
    pub iteration: u64,
    /// `train_iters`.
    pub train_iters: u64,
    /// Samples consumed after `iteration`.
    pub consumed_samples: u64,
    /// Mean wall time per iteration over the interval, milliseconds.
    pub elapsed_ms_per_iteration: f64,
    /// Model TFLOP/s per rank: [`num_floating_point_operations`](super::num_floating_point_operations)
    /// of the global batch / time per iteration / world size (`tp · pp · dp`), as Megatron's
    /// `throughput per GPU` (`megatron/training/training.py`, `training_log`).
    pub tflops: f64,
    /// Input tokens per second over the interval.
    pub tokens_per_second: f64,
    /// Learning rate after the last step (the next step's, as Megatron logs it).
    pub learning_rate: f64,
    /// `global_batch_size`.
    pub global_batch_size: usize,
    /// Mean of the per-iteration per-token losses over the interval's non-skipped
    /// iterations, nats.
    pub lm_loss: f64,
    /// fp16 loss scale; `None` (not printed) in fp32/bf16.
    pub loss_scale: Option<f32>,
    /// Gradient norm of the last iteration.
    pub grad_norm: Option<f64>,
    /// Skipped iterations in the interval.
    pub skipped_iterations: u64,
    /// Iterations in the interval whose loss was NaN or infinite.
    pub nan_iterations: u64,
    /// Mean time per iteration spent waiting for the data-parallel gradient reduction,
    /// milliseconds (metrics only; 0 on one rank).
    #[serde(default)]
    pub comm_wait_ms: f64,
    /// Bytes of model state (weights, gradients, optimizer state) this rank holds in memory
    /// after the interval's last step, measured from the resident pages
    /// ([`Trainer::resident_model_state_bytes`](super::Trainer::resident_model_state_bytes):
    /// what ZeRO-2/3 shard shows here). Metrics only.
    #[serde(default)]
    pub model_state_bytes: u64,
    /// The largest resident set of this process so far (`VmHWM`), bytes: with one rank per
    /// process, the rank's peak memory up to this line. Metrics only; `None` where the
    /// system does not tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_rss_bytes: Option<u64>,
    /// DPO's metrics over the interval (`None`, and not written, for language modeling);
    /// `lm_loss` is then the DPO loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dpo: Option<DpoMetrics>,
    /// The MoE layers' balancing losses over the interval (`None`, and not written, for a
    /// model without MoE layers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeMetrics>,
    /// The offloaded optimizer state after the interval, bytes moved per iteration (`None`,
    /// and not written, without offloading).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offload: Option<OffloadStats>,
}

/// One validation result (`evaluate_and_print_results`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalLine {
    /// Iteration after which validation ran.
    pub iteration: u64,
    /// Per-token mean validation loss, nats.
    pub lm_loss: f64,
    /// `exp(min(20, lm_loss))`, as Megatron.
    pub ppl: f64,
    /// DPO's metrics on the validation pairs (`None`, and not written, for language
    /// modeling); `lm_loss` is then the DPO loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dpo: Option<DpoMetrics>,
}

impl EvalLine {
    /// The line for `lm_loss` after `iteration`.
    pub fn new(iteration: u64, lm_loss: f64) -> EvalLine {
        EvalLine {
            iteration,
            lm_loss,
            ppl: lm_loss.min(20.0).exp(),
            dpo: None,
        }
    }
}

/// A checkpoint written by the loop (`save_checkpoint`'s `successfully saved checkpoint`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedLine {
    /// Iteration saved.
    pub iteration: u64,
    /// The iteration directory written.
    pub dir: String,
    /// Wall time of the save, milliseconds.
    pub elapsed_ms: f64,
}

/// What the training loop reports: serialized as one JSON object per line in
/// `metrics.jsonl`, tagged by `"kind": "train" | "valid" | "checkpoint"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum TrainLog {
    /// A training log line.
    Train(LogLine),
    /// A validation result.
    Valid(EvalLine),
    /// A checkpoint was saved.
    #[serde(rename = "checkpoint")]
    Saved(SavedLine),
}

/// Python's `'{:.{prec}E}'.format(x)`: mantissa with `prec` decimals, `E`, a signed exponent
/// of at least two digits (`3.000000E-04`; Rust's `{:E}` would print `3.000000E-4`).
pub fn format_sci(x: f64, prec: usize) -> String {
    if !x.is_finite() {
        return match x {
            x if x.is_nan() => "NAN".into(),
            x if x > 0.0 => "INF".into(),
            _ => "-INF".into(),
        };
    }
    let s = format!("{x:.prec$E}");
    let (mantissa, exp) = s.split_once('E').expect("{:E} has an exponent");
    let exp: i32 = exp.parse().expect("{:E} exponent is an integer");
    let sign = if exp < 0 { '-' } else { '+' };
    format!("{mantissa}E{sign}{:02}", exp.abs())
}

impl fmt::Display for LogLine {
    /// Megatron's field formats: `iteration {:8d}/{:8d}`, `consumed samples: {:12d}`,
    /// `elapsed time per iteration (ms): {:.1f}`, `throughput per GPU (TFLOP/s/GPU)` (`{:.1f}`
    /// in Megatron; three decimals here, where a CPU rank does hundredths of a TFLOP/s and one
    /// decimal printed 0.0), then tokens per second (Ferrotron), `learning rate: {:.6E}`,
    /// `global batch size: {:5d}`, `lm loss: {:.6E}`, `loss scale: {:.1f}` (fp16 only),
    /// `grad norm: {:.3f}`, `number of skipped iterations: {:3d}`,
    /// `number of nan iterations: {:3d}`, each closed by ` |`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            " iteration {:8}/{:8} |",
            self.iteration, self.train_iters
        )?;
        write!(f, " consumed samples: {:12} |", self.consumed_samples)?;
        write!(
            f,
            " elapsed time per iteration (ms): {:.1} |",
            self.elapsed_ms_per_iteration
        )?;
        write!(f, " throughput per GPU (TFLOP/s/GPU): {:.3} |", self.tflops)?;
        write!(f, " tokens per second: {:.1} |", self.tokens_per_second)?;
        write!(f, " learning rate: {} |", format_sci(self.learning_rate, 6))?;
        write!(f, " global batch size: {:5} |", self.global_batch_size)?;
        write!(f, " lm loss: {} |", format_sci(self.lm_loss, 6))?;
        if let Some(m) = &self.moe {
            m.fmt(f)?;
        }
        if let Some(o) = &self.offload {
            o.fmt(f)?;
        }
        if let Some(s) = self.loss_scale {
            write!(f, " loss scale: {s:.1} |")?;
        }
        if let Some(g) = self.grad_norm {
            write!(f, " grad norm: {g:.3} |")?;
        }
        write!(
            f,
            " number of skipped iterations: {:3} |",
            self.skipped_iterations
        )?;
        write!(f, " number of nan iterations: {:3} |", self.nan_iterations)?;
        match &self.dpo {
            Some(d) => d.fmt(f),
            None => Ok(()),
        }
    }
}

impl fmt::Display for EvalLine {
    /// ` validation loss at iteration 10 | lm loss value: 3.210000E+00 | lm loss PPL:
    /// 2.477909E+01 | ` (Megatron's `evaluate_and_print_results`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            " validation loss at iteration {} | lm loss value: {} | lm loss PPL: {} | ",
            self.iteration,
            format_sci(self.lm_loss, 6),
            format_sci(self.ppl, 6)
        )?;
        match &self.dpo {
            Some(d) => write!(f, "{d} "),
            None => Ok(()),
        }
    }
}

impl fmt::Display for TrainLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TrainLog::Train(l) => l.fmt(f),
            TrainLog::Valid(l) => l.fmt(f),
            TrainLog::Saved(l) => write!(
                f,
                " successfully saved checkpoint from iteration {:7} to {} [ t {:.1} ms ]",
                l.iteration, l.dir, l.elapsed_ms
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scientific_like_python() {
        assert_eq!(format_sci(3e-4, 6), "3.000000E-04");
        assert_eq!(format_sci(3.21, 6), "3.210000E+00");
        assert_eq!(format_sci(12345.0, 2), "1.23E+04");
        assert_eq!(format_sci(0.0, 1), "0.0E+00");
        assert_eq!(format_sci(1e-120, 1), "1.0E-120");
        assert_eq!(format_sci(f64::NAN, 6), "NAN");
    }

    fn line() -> LogLine {
        LogLine {
            iteration: 10,
            train_iters: 200,
            consumed_samples: 80,
            elapsed_ms_per_iteration: 1234.49,
            tflops: 1.234,
            tokens_per_second: 3317.6,
            learning_rate: 3e-4,
            global_batch_size: 8,
            lm_loss: 3.21,
            loss_scale: None,
            grad_norm: Some(1.2344),
            skipped_iterations: 0,
            nan_iterations: 0,
            comm_wait_ms: 0.0,
            model_state_bytes: 0,
            peak_rss_bytes: None,
            dpo: None,
            moe: None,
            offload: None,
        }
    }

    #[test]
    fn log_line_formats_like_megatron() {
        assert_eq!(
            line().to_string(),
            " iteration       10/     200 | consumed samples:           80 | \
             elapsed time per iteration (ms): 1234.5 | throughput per GPU (TFLOP/s/GPU): 1.234 | \
             tokens per second: 3317.6 | learning rate: 3.000000E-04 | \
             global batch size:     8 | lm loss: 3.210000E+00 | grad norm: 1.234 | \
             number of skipped iterations:   0 | number of nan iterations:   0 |"
        );
        let fp16 = LogLine {
            loss_scale: Some(65536.0),
            grad_norm: None,
            ..line()
        };
        let s = fp16.to_string();
        assert!(
            s.contains("| loss scale: 65536.0 | number of skipped"),
            "{s}"
        );
        let moe = LogLine {
            moe: Some(MoeMetrics {
                load_balancing_loss: Some(1.0123),
                z_loss: None,
            }),
            ..line()
        };
        let s = moe.to_string();
        assert!(
            s.contains("| lm loss: 3.210000E+00 | load_balancing_loss: 1.012300E+00 | grad norm"),
            "{s}"
        );
        let json = serde_json::to_value(TrainLog::Train(moe)).unwrap();
        assert_eq!(json["moe"]["load_balancing_loss"], 1.0123);
        let eval = EvalLine::new(10, 3.21).to_string();
        assert_eq!(
            eval,
            " validation loss at iteration 10 | lm loss value: 3.210000E+00 | \
             lm loss PPL: 2.477909E+01 | "
        );
        let json = serde_json::to_value(TrainLog::Train(line())).unwrap();
        assert_eq!(json["kind"], "train");
        assert_eq!(json["lm_loss"], 3.21);
        assert_eq!(json["loss_scale"], serde_json::Value::Null);
        // metrics.jsonl lines read back (a resumed run redraws its loss curve from them).
        for log in [
            TrainLog::Train(line()),
            TrainLog::Valid(EvalLine::new(10, 3.21)),
        ] {
            let text = serde_json::to_string(&log).unwrap();
            let back = serde_json::from_str::<TrainLog>(&text).unwrap();
            // serde_json's float parsing may differ in the last bit.
            match (back, &log) {
                (TrainLog::Train(a), TrainLog::Train(b)) => {
                    assert_eq!((a.iteration, a.lm_loss), (b.iteration, b.lm_loss))
                }
                (TrainLog::Valid(a), TrainLog::Valid(b)) => {
                    assert_eq!((a.iteration, a.lm_loss), (b.iteration, b.lm_loss))
                }
                (back, _) => panic!("{log:?} read back as {back:?}"),
            }
        }
    }
}
