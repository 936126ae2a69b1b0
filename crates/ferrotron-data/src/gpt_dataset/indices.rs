//! The three GPT indices, ported from Megatron-Core `gpt_dataset.py` (`_get_num_epochs`,
//! `_build_document_index`, `_build_shuffle_index`, the `separate_final_epoch` rule in
//! `_build_document_sample_shuffle_indices`) and `helpers.cpp` (`build_sample_idx`).

use super::DatasetError;
use super::numpy_rng::RandomState;

/// Megatron's threshold: the last epoch is shuffled on its own when it contributes fewer than
/// `int(0.8 * samples_per_epoch)` samples.
pub const SEPARATE_FINAL_EPOCH_THRESHOLD: f64 = 0.80;

/// How many epochs of the split, and whether the last one is shuffled separately.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpochPlan {
    pub num_epochs: usize,
    pub separate_final_epoch: bool,
    /// Samples before the final epoch (`num_samples_sans_final_epoch`); the separate part of the
    /// shuffle index starts here. Only meaningful when `separate_final_epoch`.
    pub num_samples_sans_final_epoch: usize,
}

/// `_get_num_epochs` plus the final-epoch separation rule. `tokens_per_epoch` is the token count
/// of the split, `num_samples = None` asks for exactly one epoch.
pub fn plan_epochs(
    tokens_per_epoch: u64,
    num_samples: Option<usize>,
    seq_length: usize,
    extra: usize,
) -> Result<EpochPlan, DatasetError> {
    if seq_length == 0 {
        return Err(DatasetError::config("seq_length", "must be > 0"));
    }
    let (t, s, x) = (tokens_per_epoch as u128, seq_length as u128, extra as u128);
    let Some(n) = num_samples else {
        return Ok(EpochPlan {
            num_epochs: 1,
            separate_final_epoch: false,
            num_samples_sans_final_epoch: 0,
        });
    };
    let requested = n as u128 * s + x;
    if t == 0 {
        return Err(DatasetError::index(
            "num_samples",
            format!("{n} samples requested from a split with no tokens"),
        ));
    }
    // Smallest E >= 1 with E * t >= requested (Megatron's loop, in closed form).
    let epochs = requested.div_ceil(t).max(1);
    let num_epochs = usize::try_from(epochs).map_err(|_| {
        DatasetError::index("num_samples", format!("{n} samples need {epochs} epochs"))
    })?;
    if num_epochs == 1 {
        return Ok(EpochPlan {
            num_epochs,
            separate_final_epoch: false,
            num_samples_sans_final_epoch: 0,
        });
    }
    let sans_final = ((epochs - 1) * t - x) / s;
    let from_final = n as i128 - sans_final as i128;
    let per_epoch = (t - x) / s;
    let threshold = (SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch as f64) as i128;
    Ok(EpochPlan {
        num_epochs,
        separate_final_epoch: from_final < threshold,
        num_samples_sans_final_epoch: sans_final as usize,
    })
}

/// `_build_document_index`: the split's documents repeated `num_epochs` times and shuffled as
/// one array, or (separate final epoch) the first `num_epochs - 1` shuffled together, then the
/// last epoch shuffled alone with the same generator. `[num_epochs * documents.len()]`.
pub fn build_document_index(
    documents: std::ops::Range<u32>,
    num_epochs: usize,
    rng: &mut RandomState,
    separate_final_epoch: bool,
) -> Result<Vec<u32>, DatasetError> {
    let per_epoch = documents.len();
    let total = per_epoch
        .checked_mul(num_epochs)
        .filter(|&t| t <= i32::MAX as usize);
    let Some(total) = total else {
        return Err(DatasetError::index(
            "document index",
            format!("{num_epochs} epochs x {per_epoch} documents exceed Megatron's int32 index"),
        ));
    };
    let mut index = Vec::with_capacity(total);
    for _ in 0..num_epochs {
        index.extend(documents.clone());
    }
    if !separate_final_epoch || num_epochs == 1 {
        rng.shuffle(&mut index);
    } else {
        let (first, last) = index.split_at_mut(total - per_epoch);
        rng.shuffle(first);
        rng.shuffle(last);
    }
    Ok(index)
}

/// `helpers.cpp: build_sample_idx`: `[num_samples + 1]` pairs `(position in document_index,
/// token offset in that document)`; sample `i` spans from pair `i` to pair `i + 1` and holds
/// `seq_length + extra` tokens (consecutive samples share the boundary token when `extra = 1`).
///
/// `sizes` are the token counts of all sequences of the indexed dataset; `document_index` the
/// shuffled document index. With `drop_last_partial_sequence = false` (valid split option) the
/// last sample may be short and ends at the last document's end.
pub fn build_sample_index(
    sizes: &[u32],
    document_index: &[u32],
    seq_length: usize,
    num_epochs: usize,
    tokens_per_epoch: u64,
    drop_last_partial_sequence: bool,
    extra: usize,
) -> Result<Vec<[u32; 2]>, DatasetError> {
    if seq_length == 0 {
        return Err(DatasetError::config("seq_length", "must be > 0"));
    }
    let total = num_epochs as i64 * tokens_per_epoch as i64 - extra as i64;
    let num_samples = if total <= 0 {
        0
    } else if drop_last_partial_sequence {
        total / seq_length as i64
    } else {
        // C++: ceil(float(total) / seq_length) in single precision.
        ((total as f32) / (seq_length as f32)).ceil() as i64
    } as usize;
    let size_of = |pos: usize| -> Result<i64, DatasetError> {
        let doc = *document_index.get(pos).ok_or_else(|| {
            DatasetError::index(
                "sample index",
                format!("document position {pos} out of range"),
            )
        })?;
        sizes.get(doc as usize).map(|&l| l as i64).ok_or_else(|| {
            DatasetError::index(
                "sample index",
                format!("document {doc} is not in the dataset"),
            )
        })
    };
    let mut out = Vec::with_capacity(num_samples + 1);
    let mut pos = 0usize;
    let mut offset = 0i64;
    out.push([0, 0]);
    while out.len() <= num_samples {
        let mut remaining = (seq_length + extra) as i64;
        while remaining != 0 {
            let length = size_of(pos)? - offset;
            remaining -= length;
            if remaining <= 0 {
                offset += remaining + length - extra as i64;
                remaining = 0;
            } else {
                if pos + 1 == document_index.len() {
                    if out.len() != num_samples || drop_last_partial_sequence {
                        return Err(DatasetError::index(
                            "sample index",
                            format!("documents ran out at sample {} of {num_samples}", out.len()),
                        ));
                    }
                    // Megatron stores `size - extra`, i.e. -1 after an empty last document; we
                    // clamp to 0 and the sample reader clamps its read the same way.
                    offset = (size_of(pos)? - extra as i64).max(0);
                    break;
                }
                pos += 1;
                offset = 0;
            }
        }
        let pos32 = u32::try_from(pos)
            .map_err(|_| DatasetError::index("sample index", "document position exceeds u32"))?;
        out.push([pos32, offset as u32]);
    }
    Ok(out)
}

/// `_build_shuffle_index`: `0..num_samples` shuffled, then (when `total_size > num_samples`,
/// i.e. a separate final epoch) `num_samples..total_size` shuffled on its own and appended.
pub fn build_shuffle_index(
    num_samples: usize,
    total_size: usize,
    rng: &mut RandomState,
) -> Result<Vec<u32>, DatasetError> {
    if total_size >= u32::MAX as usize - 1 || num_samples > total_size {
        return Err(DatasetError::index(
            "shuffle index",
            format!("{num_samples} of {total_size} samples: more than this index supports"),
        ));
    }
    let mut index: Vec<u32> = (0..total_size as u32).collect();
    let (first, last) = index.split_at_mut(num_samples);
    rng.shuffle(first);
    if num_samples != total_size {
        rng.shuffle(last);
    }
    Ok(index)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_follow_megatron() {
        // 100 tokens per epoch, seq 10: 9 samples per epoch ((100-1)/10).
        let p = plan_epochs(100, Some(9), 10, 1).unwrap();
        assert_eq!((p.num_epochs, p.separate_final_epoch), (1, false));
        // 20 samples: 201 tokens -> 3 epochs; 19 before the last, 1 from it < int(0.8*9)=7.
        let p = plan_epochs(100, Some(20), 10, 1).unwrap();
        assert_eq!(p.num_epochs, 3);
        assert!(p.separate_final_epoch);
        assert_eq!(p.num_samples_sans_final_epoch, 19);
        assert!(plan_epochs(0, Some(1), 10, 1).is_err());
        assert_eq!(plan_epochs(0, None, 10, 1).unwrap().num_epochs, 1);
    }

    #[test]
    fn sample_index_walks_documents() {
        // Two documents of 5 and 7 tokens, seq 4 + 1 extra token.
        let idx = build_sample_index(&[5, 7], &[0, 1], 4, 1, 12, true, 1).unwrap();
        assert_eq!(idx, vec![[0, 0], [0, 4], [1, 3]]);
        let short = build_sample_index(&[5, 7], &[0, 1], 4, 1, 12, false, 1).unwrap();
        assert_eq!(short, vec![[0, 0], [0, 4], [1, 3], [1, 6]]);
    }
}
