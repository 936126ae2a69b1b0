use crate::gemm::WeightRef;
use crate::{Element, Result, TensorError};
use rayon::prelude::*;

/// Gathers rows of an embedding table `table: [v, h]` for `ids: [n]` into `out: [n, h]`
/// (widened to f32; quantized rows dequantized exactly). An id `>= v` is an error naming the id and the vocabulary size.
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
        WeightRef::Quant(q) => q.rows(),
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
        WeightRef::Quant(q) => {
            assert_eq!(q.cols(), h);
            out.par_chunks_mut(h)
                .zip(ids.par_iter())
                .for_each(|(o, &id)| q.dequantize_rows(id as usize..id as usize + 1, o));
        }
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

/// Backward of [`embedding_lookup`]: scatter-adds `dy: [n, h]` into the table gradient,
/// `dtable[ids[t], :] += dy[t, :]` (**accumulates**; `dtable: [v, h]`, f32). Mirrors the
/// backward of `torch.nn.functional.embedding` (`embedding_dense_backward`, no padding index).
///
/// Deterministic without atomics: the token indices are bucketed by id with a counting sort
/// (stable, so each bucket lists its tokens in order), then vocabulary rows are processed in
/// parallel, each adding its tokens' rows in token order. Every row therefore gets exactly the
/// sum a sequential `for t in 0..n` loop would give, bit for bit, for any thread count. Cost
/// `O(n·h + v)`; scratch `v + n + 1` indices.
///
/// # Panics
/// When the lengths do not match the shapes above or an id is `>= v` (caller bugs: the forward
/// already rejected out-of-range ids).
pub fn embedding_backward(ids: &[u32], dy: &[f32], dtable: &mut [f32], h: usize) {
    assert!(h > 0 && dy.len() == ids.len() * h && dtable.len().is_multiple_of(h));
    assert!(
        u32::try_from(ids.len()).is_ok(),
        "embedding_backward: more than 2^32 tokens"
    );
    let v = dtable.len() / h;
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= v) {
        panic!("embedding_backward: token id {bad} >= vocabulary size {v}");
    }
    // Counting sort: start[id]..start[id + 1] indexes `order`, the tokens with that id.
    let mut start = vec![0u32; v + 1];
    for &id in ids {
        start[id as usize + 1] += 1;
    }
    for i in 0..v {
        start[i + 1] += start[i];
    }
    let mut fill = start[..v].to_vec();
    let mut order = vec![0u32; ids.len()];
    for (t, &id) in ids.iter().enumerate() {
        order[fill[id as usize] as usize] = t as u32;
        fill[id as usize] += 1;
    }
    dtable
        .par_chunks_mut(h)
        .zip(start.par_windows(2))
        .with_min_len(64)
        .for_each(|(row, w)| {
            for &t in &order[w[0] as usize..w[1] as usize] {
                let src = &dy[t as usize * h..][..h];
                row.iter_mut().zip(src).for_each(|(d, s)| *d += s);
            }
        });
}
