//! Gradient buckets assembled from a backward's [`GradReady`](ferrotron_model::GradReady)
//! reports: each parameter's final gradient is copied into its bucket's staging buffer, and
//! when the bucket's last parameter has reported, the staged bucket (padding zero) is handed
//! out whole for its reduction — what `overlap_grad_reduce` (`overlap.rs`) and ZeRO-2
//! (`grad_shards.rs`) reduce.

use std::ops::Range;

use ferrotron_optim::{ParamAndGradBuffer, ParamId};

/// One bucket being staged.
struct Staged {
    range: Range<usize>,
    /// Parameters of the bucket; reports left until it is complete.
    params: usize,
    waiting_for: usize,
    /// Times the bucket was completed.
    completed: usize,
    staging: Vec<f32>,
}

/// The staging of every bucket of a buffer.
pub(super) struct BucketStaging {
    buckets: Vec<Staged>,
    /// Per parameter: its bucket and flat range (`None` for a frozen one).
    params: Vec<Option<(usize, Range<usize>)>>,
}

impl BucketStaging {
    /// Empty staging for the buckets of `buffer`.
    pub(super) fn new(buffer: &ParamAndGradBuffer) -> BucketStaging {
        let mut buckets: Vec<Staged> = (buffer.buckets().iter())
            .map(|b| Staged {
                range: b.start..b.end,
                params: 0,
                waiting_for: 0,
                completed: 0,
                staging: Vec::new(),
            })
            .collect();
        let params = (0..buffer.params().len())
            .map(|i| {
                let info = buffer.info(ParamId(i));
                let bucket = info.bucket_id?;
                buckets[bucket].params += 1;
                Some((bucket, info.range()))
            })
            .collect();
        for b in &mut buckets {
            b.waiting_for = b.params;
        }
        BucketStaging { buckets, params }
    }

    /// Copies parameter `i`'s final gradient (`grads[i]`, one slice per parameter) into its
    /// bucket. When that was the bucket's last parameter, returns the bucket and its staged
    /// gradients `[bucket length]` (the bucket then fills again from the next backward). A
    /// frozen parameter is ignored.
    ///
    /// # Errors
    /// `i` is not a parameter of the buffer.
    pub(super) fn stage(
        &mut self,
        i: usize,
        grads: &[&mut [f32]],
    ) -> Result<Option<(usize, Vec<f32>)>, String> {
        let (b, range) = match (self.params.get(i), grads.get(i)) {
            (Some(Some(p)), Some(_)) => p.clone(),
            (Some(None), _) => return Ok(None), // frozen: no gradient
            _ => return Err(format!("parameter {i} is not in the gradient buffer")),
        };
        let grad = &*grads[i];
        let bucket = &mut self.buckets[b];
        if bucket.staging.is_empty() {
            bucket.staging = vec![0f32; bucket.range.len()];
        }
        let at = range.start - bucket.range.start;
        bucket.staging[at..at + range.len()].copy_from_slice(grad);
        bucket.waiting_for -= 1;
        if bucket.waiting_for > 0 {
            return Ok(None);
        }
        bucket.waiting_for = bucket.params;
        bucket.completed += 1;
        Ok(Some((b, std::mem::take(&mut bucket.staging))))
    }

    /// The first bucket not completed `times` times: (bucket, times completed, parameters
    /// that did not report in its last partial fill).
    pub(super) fn incomplete(&self, times: usize) -> Option<(usize, usize, usize)> {
        (self.buckets.iter().enumerate())
            .find(|(_, b)| b.completed != times)
            .map(|(i, b)| (i, b.completed, b.waiting_for))
    }

    /// Bucket `b`'s flat range in the buffer.
    pub(super) fn range(&self, b: usize) -> Range<usize> {
        self.buckets[b].range.clone()
    }
}
