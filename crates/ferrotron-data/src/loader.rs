//! Micro-batches for one data-parallel rank, prefetched on a background thread.
//!
//! Sampling is Megatron's `MegatronPretrainingSampler` (`megatron/core/datasets/
//! data_samplers.py`, `dataloader_type = "single"`): from `consumed_samples` on, the dataset is
//! walked in order in chunks of `micro_batch_size * data_parallel_size` samples; rank `r` takes
//! the `r`-th `micro_batch_size` slice of each chunk. A global batch of `num_microbatches`
//! micro-steps is thus the contiguous range `consumed..consumed + global_batch_size`, split
//! disjointly across ranks, and a run resumed with the checkpoint's `consumed_samples`
//! continues at exactly the next sample. (Shuffling is the datasets' job: their shuffle index.)
//!
//! [`DataLoader`] collates each slice into a [`MicroBatch`] on a worker thread and keeps up to
//! `prefetch` batches ready in a bounded channel (TorchAcc's AsyncLoader idea), so a training
//! step never waits on I/O unless it consumes faster than the worker reads. A worker error is
//! delivered in order as an `Err` item; dropping the loader stops and joins the worker.

use crate::gpt_dataset::{DatasetError, GptSample};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

/// A map-style dataset of fixed-length samples: [`GptDataset`](crate::gpt_dataset::GptDataset),
/// [`BlendedDataset`](crate::blended::BlendedDataset), and the SFT datasets (which use the same
/// sample type, with loss mask 0 on prompts and padding).
pub trait Dataset: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;

    /// True when there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sample `i < len()`; errors for `i` out of range or a failed read, never panics.
    fn get(&self, i: usize) -> Result<GptSample, DatasetError>;

    /// JSON identity of the dataset, hashed into the cache keys of datasets built on top of it
    /// (a blend); `null` when it has none.
    fn description(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
}

/// Megatron's `MegatronPretrainingSampler`: yields this rank's sample indices per micro-step.
#[derive(Clone, Debug)]
pub struct PretrainingSampler {
    total_samples: usize,
    next: usize,
    micro_batch_size: usize,
    data_parallel_rank: usize,
    data_parallel_size: usize,
    drop_last: bool,
}

impl PretrainingSampler {
    /// Errors (Megatron's asserts): no samples, `consumed_samples >= total_samples`,
    /// `micro_batch_size == 0`, `data_parallel_size == 0`, `rank >= size`.
    pub fn new(
        total_samples: usize,
        consumed_samples: usize,
        micro_batch_size: usize,
        data_parallel_rank: usize,
        data_parallel_size: usize,
        drop_last: bool,
    ) -> Result<PretrainingSampler, DatasetError> {
        let bad = |field, detail: String| Err(DatasetError::config(field, detail));
        if total_samples == 0 {
            return bad(
                "dataset",
                "no sample to consume: the dataset is empty".into(),
            );
        }
        if consumed_samples >= total_samples {
            return bad(
                "consumed_samples",
                format!("{consumed_samples}: no samples left of {total_samples}"),
            );
        }
        if micro_batch_size == 0 {
            return bad("micro_batch_size", "must be > 0".into());
        }
        if data_parallel_size == 0 || data_parallel_rank >= data_parallel_size {
            return bad(
                "data_parallel_rank",
                format!("rank {data_parallel_rank} of data-parallel size {data_parallel_size}"),
            );
        }
        Ok(PretrainingSampler {
            total_samples,
            next: consumed_samples,
            micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
            drop_last,
        })
    }

    /// Samples consumed by all ranks so far (the value to checkpoint).
    pub fn consumed_samples(&self) -> usize {
        self.next
    }
}

impl Iterator for PretrainingSampler {
    /// This rank's sample indices for the next micro-step (`micro_batch_size` of them; fewer or
    /// none only in a kept partial last chunk, which ranks past its end see as empty).
    type Item = Vec<usize>;

    fn next(&mut self) -> Option<Vec<usize>> {
        let chunk = self.micro_batch_size * self.data_parallel_size;
        let left = self.total_samples.saturating_sub(self.next);
        if left == 0 || (left < chunk && self.drop_last) {
            return None;
        }
        let len = left.min(chunk);
        let start = (self.data_parallel_rank * self.micro_batch_size).min(len);
        let end = (start + self.micro_batch_size).min(len);
        let out = (self.next + start..self.next + end).collect();
        self.next += len;
        Some(out)
    }
}

/// `b` samples of `s` positions stacked row-major: field `[i * s + j]` is position `j` of row `i`.
#[derive(Clone, Debug, PartialEq)]
pub struct MicroBatch {
    /// Rows `b`.
    pub micro_batch_size: usize,
    /// Positions per row `s`.
    pub seq_length: usize,
    /// `[b, s]` input ids.
    pub tokens: Vec<u32>,
    /// `[b, s]` next-token targets.
    pub labels: Vec<u32>,
    /// `[b, s]` loss weights (0 or 1).
    pub loss_mask: Vec<f32>,
    /// `[b, s]` rotary / learned position ids.
    pub position_ids: Vec<u32>,
    /// `[b, s]` attention blocks: `i` attends to `j <= i` of its row iff the ids are equal.
    pub segment_ids: Vec<u32>,
    /// `[b]` each row's [`GptSample::margin`] (a reward model's pair margins; 0 otherwise).
    pub margins: Vec<f32>,
    /// `[b]` dataset sample index of each row.
    pub sample_indices: Vec<usize>,
    /// Global samples consumed (all DP ranks) once this micro-step is done.
    pub consumed_samples: usize,
}

impl MicroBatch {
    /// Stacks samples of equal length (`sample_indices[k]` names row `k`); errors when lengths
    /// differ or the counts of samples and indices do.
    pub fn collate(
        samples: Vec<GptSample>,
        sample_indices: Vec<usize>,
        consumed_samples: usize,
    ) -> Result<MicroBatch, DatasetError> {
        if samples.len() != sample_indices.len() {
            return Err(DatasetError::index(
                "micro-batch",
                format!(
                    "{} samples, {} indices",
                    samples.len(),
                    sample_indices.len()
                ),
            ));
        }
        let s = samples.first().map_or(0, |x| x.len());
        let b = samples.len();
        let mut mb = MicroBatch {
            micro_batch_size: b,
            seq_length: s,
            tokens: Vec::with_capacity(b * s),
            labels: Vec::with_capacity(b * s),
            loss_mask: Vec::with_capacity(b * s),
            position_ids: Vec::with_capacity(b * s),
            segment_ids: Vec::with_capacity(b * s),
            margins: Vec::with_capacity(b),
            sample_indices,
            consumed_samples,
        };
        for (row, x) in samples.into_iter().enumerate() {
            let lens = [x.labels.len(), x.loss_mask.len(), x.position_ids.len()];
            if x.len() != s || lens.iter().chain([&x.segment_ids.len()]).any(|&l| l != s) {
                return Err(DatasetError::index(
                    "micro-batch",
                    format!(
                        "sample {} has {} positions, row 0 has {s}",
                        mb.sample_indices[row],
                        x.len()
                    ),
                ));
            }
            mb.tokens.extend(x.tokens);
            mb.labels.extend(x.labels);
            mb.loss_mask.extend(x.loss_mask);
            mb.position_ids.extend(x.position_ids);
            mb.segment_ids.extend(x.segment_ids);
            mb.margins.push(x.margin);
        }
        Ok(mb)
    }
}

/// Loader settings for one data-parallel rank.
#[derive(Clone, Debug)]
pub struct LoaderConfig {
    pub micro_batch_size: usize,
    pub data_parallel_rank: usize,
    pub data_parallel_size: usize,
    /// Samples already consumed by all ranks (from the checkpoint; 0 for a fresh run).
    pub consumed_samples: usize,
    /// Micro-batches kept ready ahead of the consumer (the channel bound; 0 = hand-off only).
    pub prefetch: usize,
    /// Drop a last chunk smaller than `micro_batch_size * data_parallel_size` (Megatron default).
    pub drop_last: bool,
}

impl LoaderConfig {
    /// Rank `rank` of `size`, resuming after `consumed_samples`, prefetching 2, dropping the
    /// partial last chunk.
    pub fn new(micro_batch_size: usize, rank: usize, size: usize, consumed_samples: usize) -> Self {
        LoaderConfig {
            micro_batch_size,
            data_parallel_rank: rank,
            data_parallel_size: size,
            consumed_samples,
            prefetch: 2,
            drop_last: true,
        }
    }
}

/// Iterator of `Result<MicroBatch>` read ahead on a worker thread.
pub struct DataLoader {
    rx: Option<Receiver<Result<MicroBatch, DatasetError>>>,
    stop: Arc<AtomicBool>,
    worker: Option<JoinHandle<()>>,
}

impl DataLoader {
    /// Starts the worker. Errors from the sampler's checks come back here; read errors come
    /// back from `next()`.
    pub fn new(
        dataset: Arc<dyn Dataset>,
        config: &LoaderConfig,
    ) -> Result<DataLoader, DatasetError> {
        let sampler = PretrainingSampler::new(
            dataset.len(),
            config.consumed_samples,
            config.micro_batch_size,
            config.data_parallel_rank,
            config.data_parallel_size,
            config.drop_last,
        )?;
        let (tx, rx) = sync_channel(config.prefetch);
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let worker = std::thread::Builder::new()
            .name("ferrotron-loader".into())
            .spawn(move || run_worker(dataset, sampler, tx, flag))
            .map_err(|e| DatasetError::Loader(format!("cannot start the worker thread: {e}")))?;
        Ok(DataLoader {
            rx: Some(rx),
            stop,
            worker: Some(worker),
        })
    }
}

fn run_worker(
    dataset: Arc<dyn Dataset>,
    mut sampler: PretrainingSampler,
    tx: SyncSender<Result<MicroBatch, DatasetError>>,
    stop: Arc<AtomicBool>,
) {
    while let Some(indices) = sampler.next() {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let consumed = sampler.consumed_samples();
        let batch = indices
            .iter()
            .map(|&i| dataset.get(i))
            .collect::<Result<Vec<_>, _>>()
            .and_then(|samples| MicroBatch::collate(samples, indices, consumed));
        let failed = batch.is_err();
        // Blocks while the channel is full; fails at once when the loader is dropped.
        if tx.send(batch).is_err() {
            return;
        }
        if failed {
            return;
        }
    }
}

impl Iterator for DataLoader {
    type Item = Result<MicroBatch, DatasetError>;

    fn next(&mut self) -> Option<Self::Item> {
        let rx = self.rx.as_ref()?;
        match rx.recv() {
            Ok(item) => Some(item),
            Err(_) => {
                // The worker finished or died: report a panic once, then end.
                self.rx = None;
                let joined = self.worker.take()?.join();
                joined.err().map(|p| {
                    let msg = p
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| p.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "panicked".into());
                    Err(DatasetError::Loader(format!(
                        "worker thread panicked: {msg}"
                    )))
                })
            }
        }
    }
}

impl Drop for DataLoader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.rx = None; // disconnects: a worker blocked on send returns at once
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}
