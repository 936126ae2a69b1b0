use crate::gemm::WeightRef;
use crate::{Element, Result, TensorError};
use rayon::prelude::*;

/// Gathers rows of an embedding table `table: [v, h]` for `ids: [n]` into `out: [n, h]`
/// (widened to f32). An id `>= v` is an error naming the id and the vocabulary size.
pub fn embedding_lookup(
    table: WeightRef<'_>,
    h: usize,
    ids: &[u32],
    out: &mut [f32],
) -> Result<()> {
    assert_eq!(out.len(), ids.len() * h);
    let v = match table {
        WeightRef::F32(t) => t.len() / h,
        WeightRef::BF16(t) => t.len() / h,
        WeightRef::F16(t) => t.len() / h,
    };
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= v) {
        return Err(TensorError::IndexOutOfRange {
            what: "token id",
            index: bad as usize,
            size: v,
        });
    }
    match table {
        WeightRef::F32(t) => gather(t, h, ids, out),
        WeightRef::BF16(t) => gather(t, h, ids, out),
        WeightRef::F16(t) => gather(t, h, ids, out),
    }
    Ok(())
}

fn gather<E: Element>(table: &[E], h: usize, ids: &[u32], out: &mut [f32]) {
    out.par_chunks_mut(h)
        .zip(ids.par_iter())
        .for_each(|(o, &id)| {
            let row = &table[id as usize * h..][..h];
            o.iter_mut().zip(row).for_each(|(o, e)| *o = e.to_f32());
        });
}
