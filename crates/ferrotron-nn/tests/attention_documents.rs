//! Per-document masks of packed rows (Megatron's `reset_attention_mask`): document starts follow
//! Megatron's EOD rule; the training forward/backward and the inference kernel equal an f64
//! reference whose mask is built straight from the EOD positions (GQA, batch 2, with and
//! without sliding windows, several key blocks); gradients match finite differences; and a
//! packed row equals running each of its documents alone.

use ferrotron_nn::attention::AttentionPrecision::F32;
use ferrotron_nn::attention::{
    AttentionDims, AttentionMask, DocumentStarts, core_attention, core_attention_backward,
    core_attention_forward_train, document_starts,
};

const EOD: u32 = 0;

/// xorshift64*: reproducible inputs, rounded to f32 so both paths see the same numbers.
fn random(n: usize, scale: f64, state: &mut u64) -> Vec<f64> {
    (0..n)
        .map(|_| {
            *state ^= *state >> 12;
            *state ^= *state << 25;
            *state ^= *state >> 27;
            let u = (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64;
            ((2.0 * u / (1u64 << 53) as f64 - 1.0) * scale) as f32 as f64
        })
        .collect()
}

fn f32s(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&v| v as f32).collect()
}

/// `[s, b]` tokens with [`EOD`] at the given positions of each sequence (other tokens non-EOD).
fn packed_tokens(s: usize, eods: &[&[usize]]) -> Vec<u32> {
    let b = eods.len();
    (0..s * b)
        .map(|i| {
            let (t, j) = (i / b, i % b);
            if eods[j].contains(&t) {
                EOD
            } else {
                1 + i as u32
            }
        })
        .collect()
}

/// One packed case: sizes, `[s, b]` tokens and the sliding window.
#[derive(Clone)]
struct Case {
    dims: AttentionDims,
    tokens: Vec<u32>,
    window: Option<usize>,
}

impl Case {
    /// Megatron's mask read literally: `tril`, then `mask[(i + 1):, :(i + 1)] = 0` for each
    /// EOD index `i` of the sequence; plus the window `t − p < w`.
    fn visible(&self, t: usize, j: usize, p: usize) -> bool {
        let b = self.dims.batch;
        let split = (p..t).any(|i| self.tokens[i * b + j] == EOD);
        p <= t && !split && self.window.is_none_or(|w| t - p < w)
    }

    fn qi(&self, t: usize, j: usize, h: usize) -> usize {
        ((t * self.dims.batch + j) * self.dims.heads + h) * self.dims.head_dim
    }

    fn ki(&self, p: usize, j: usize, gh: usize) -> usize {
        ((p * self.dims.batch + j) * self.dims.groups + gh) * self.dims.head_dim
    }

    /// Scaled scores of one query row over all keys, `-inf` where masked.
    fn scores(&self, q: &[f64], k: &[f64], t: usize, j: usize, h: usize) -> Vec<f64> {
        let AttentionDims {
            skv,
            heads: a,
            groups: g,
            head_dim: d,
            ..
        } = self.dims;
        let qr = &q[self.qi(t, j, h)..][..d];
        (0..skv)
            .map(|p| match self.visible(t, j, p) {
                true => {
                    let kr = &k[self.ki(p, j, h / (a / g))..][..d];
                    qr.iter().zip(kr).map(|(x, y)| x * y).sum::<f64>() / (d as f64).sqrt()
                }
                false => f64::NEG_INFINITY,
            })
            .collect()
    }

    /// Reference in f64 with an explicit masked softmax: `(out, lse, [dq, dk, dv])`.
    fn reference(&self, [q, k, v, dout]: &[Vec<f64>; 4]) -> (Vec<f64>, Vec<f64>, [Vec<f64>; 3]) {
        let AttentionDims {
            sq,
            batch: b,
            heads: a,
            groups: g,
            head_dim: d,
            ..
        } = self.dims;
        let scale = 1.0 / (d as f64).sqrt();
        let (mut out, mut lse) = (vec![0f64; q.len()], vec![0f64; sq * b * a]);
        let mut grads = [
            vec![0f64; q.len()],
            vec![0f64; k.len()],
            vec![0f64; v.len()],
        ];
        for (t, j, h) in
            (0..sq).flat_map(|t| (0..b).flat_map(move |j| (0..a).map(move |h| (t, j, h))))
        {
            let s = self.scores(q, k, t, j, h);
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
            let p: Vec<f64> = s.iter().map(|x| (x - m).exp() / z).collect();
            lse[(t * b + j) * a + h] = m + z.ln();
            let (o, gh) = (self.qi(t, j, h), h / (a / g));
            let key = |pos: usize| self.ki(pos, j, gh);
            let dp: Vec<f64> = (0..p.len())
                .map(|pos| (0..d).map(|c| dout[o + c] * v[key(pos) + c]).sum())
                .collect();
            let delta: f64 = p.iter().zip(&dp).map(|(x, y)| x * y).sum();
            for pos in 0..p.len() {
                let ds = p[pos] * (dp[pos] - delta);
                for c in 0..d {
                    out[o + c] += p[pos] * v[key(pos) + c];
                    grads[0][o + c] += ds * k[key(pos) + c] * scale;
                    grads[1][key(pos) + c] += ds * q[o + c] * scale;
                    grads[2][key(pos) + c] += p[pos] * dout[o + c];
                }
            }
        }
        (out, lse, grads)
    }

    fn inputs(&self, seed: u64) -> [Vec<f64>; 4] {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let AttentionDims {
            sq,
            skv,
            batch,
            heads,
            groups,
            head_dim,
            ..
        } = self.dims;
        let (nq, nk) = (
            sq * batch * heads * head_dim,
            skv * batch * groups * head_dim,
        );
        [1.5, 1.5, 1.0, 1.0]
            .into_iter()
            .zip([nq, nk, nk, nq])
            .map(|(scale, n)| random(n, scale, &mut state))
            .collect::<Vec<_>>()
            .try_into()
            .unwrap()
    }
}

/// Outputs of the f32 training kernels.
struct Run {
    out: Vec<f32>,
    lse: Vec<f32>,
    grads: [Vec<f32>; 3],
}

fn run_f32(x: &[Vec<f64>; 4], dims: AttentionDims, mask: AttentionMask) -> Run {
    let [q, k, v, dout] = x.each_ref().map(|x| f32s(x));
    let mut out = vec![0f32; q.len()];
    let mut lse = vec![0f32; q.len() / dims.head_dim];
    core_attention_forward_train(&q, &k, &v, &mut out, &mut lse, dims, mask, F32);
    let mut dq = vec![f32::NAN; q.len()];
    let (mut dk, mut dv) = (vec![f32::NAN; k.len()], vec![f32::NAN; v.len()]);
    core_attention_backward(
        &q, &k, &v, &out, &dout, &lse, &mut dq, &mut dk, &mut dv, dims, mask, F32,
    );
    Run {
        out,
        lse,
        grads: [dq, dk, dv],
    }
}

/// `max |got − want| / max |want|`, printed and checked against `tol`.
fn check(name: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{name}");
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    let err = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (&g, &w)| m.max((g as f64 - w).abs()));
    println!(
        "{name}: max abs err {err:.3e}, relative {:.3e}",
        err / scale
    );
    assert!(
        err / scale <= tol,
        "{name}: relative error {:e} > {tol:e}",
        err / scale
    );
}

/// Kernels vs the f64 reference (training forward, inference kernel, backward).
fn check_case(case: &Case, seed: u64, tol: f64) -> ([Vec<f64>; 4], Run) {
    let starts = document_starts(&case.tokens, case.dims.batch, EOD).unwrap();
    let mask = AttentionMask {
        sliding_window: case.window,
        documents: Some(DocumentStarts::new(&starts, case.dims.batch).unwrap()),
        alibi_slopes: None,
    };
    let x = case.inputs(seed);
    let got = run_f32(&x, case.dims, mask);
    let (out, lse, grads) = case.reference(&x);
    let w = case.window;
    check(&format!("w={w:?} forward out"), &got.out, &out, tol);
    check(&format!("w={w:?} forward lse"), &got.lse, &lse, tol);
    let mut inf = vec![0f32; got.out.len()];
    let [q, k, v, _] = x.each_ref().map(|x| f32s(x));
    core_attention(&q, &k, &v, &mut inf, case.dims, mask);
    check(&format!("w={w:?} core_attention"), &inf, &out, tol);
    for (i, name) in ["dq", "dk", "dv"].into_iter().enumerate() {
        check(&format!("w={w:?} {name}"), &got.grads[i], &grads[i], tol);
    }
    (x, got)
}

#[test]
fn document_starts_follow_megatron_eod_rule() {
    // [s, b] with b = 2: sequence 0 = [5, EOD, 7, 8, EOD, 9], sequence 1 = [EOD, EOD, 3, 4, 5, EOD].
    let seqs: [[u32; 6]; 2] = [[5, EOD, 7, 8, EOD, 9], [EOD, EOD, 3, 4, 5, EOD]];
    let tokens: Vec<u32> = (0..12).map(|i| seqs[i % 2][i / 2]).collect();
    let starts = document_starts(&tokens, 2, EOD).unwrap();
    let per_seq = |j: usize| (0..6).map(|t| starts[t * 2 + j]).collect::<Vec<_>>();
    assert_eq!(per_seq(0), [0, 0, 2, 2, 2, 5]);
    assert_eq!(per_seq(1), [0, 1, 2, 2, 2, 2]);
    // The same ranges as Megatron's mask matrix, for every query and both sequences.
    let case = Case {
        dims: AttentionDims {
            sq: 6,
            skv: 6,
            batch: 2,
            heads: 1,
            groups: 1,
            head_dim: 1,
            q_offset: 0,
            kv_offset: 0,
        },
        tokens,
        window: None,
    };
    let docs = DocumentStarts::new(&starts, 2).unwrap();
    for window in [None, Some(2)] {
        let case = Case {
            window,
            ..case.clone()
        };
        let mask = AttentionMask {
            sliding_window: window,
            documents: Some(docs),
            alibi_slopes: None,
        };
        for (t, j) in (0..6).flat_map(|t| (0..2).map(move |j| (t, j))) {
            let want: Vec<usize> = (0..6).filter(|&p| case.visible(t, j, p)).collect();
            assert_eq!(
                mask.key_range(t, j).collect::<Vec<_>>(),
                want,
                "t={t} j={j}"
            );
            let last = (t..6).filter(|&u| case.visible(u, j, t)).max().unwrap();
            assert_eq!(mask.last_query(t, j), last, "key {t} j={j} w={window:?}");
        }
    }
    assert_eq!(docs.end(2, 0), 5);
    assert_eq!(docs.end(0, 1), 1);
    assert_eq!(docs.end(5, 1), 6);
    for (tokens, b) in [(&case.tokens[..7], 2), (&case.tokens[..], 0)] {
        let err = document_starts(tokens, b, EOD).unwrap_err().to_string();
        assert!(err.starts_with("tokens:"), "{err}");
    }
}

#[test]
fn document_starts_reject_broken_structure() {
    for (starts, b) in [
        (&[1u32][..], 1),             // the first token must start a document
        (&[0, 0, 1][..], 1),          // start 1 at t = 2: neither the previous start nor 2
        (&[0, 1, 1, 0][..], 1),       // goes back to an earlier document
        (&[0, 0, 0, 0, 2, 1][..], 2), // sequence 1 jumps to start 1 at t = 2
        (&[0, 0, 0][..], 2),          // not [s, 2]
        (&[][..], 0),
    ] {
        let err = DocumentStarts::new(starts, b).unwrap_err().to_string();
        assert!(err.starts_with("doc_starts:"), "{starts:?}: {err}");
    }
    let ok = DocumentStarts::new(&[0, 1, 1, 3, 3], 1).unwrap();
    assert_eq!(
        (ok.seq_len(), ok.start(2, 0), ok.end(1, 0), ok.end(3, 0)),
        (5, 1, 3, 5)
    );
}

#[test]
#[should_panic(expected = "doc_starts")]
fn documents_with_a_query_offset_are_rejected() {
    let dims = AttentionDims {
        sq: 2,
        skv: 3,
        batch: 1,
        heads: 1,
        groups: 1,
        head_dim: 1,
        q_offset: 1,
        kv_offset: 0,
    };
    let starts = [0, 0];
    let mask = AttentionMask {
        sliding_window: None,
        documents: Some(DocumentStarts::new(&starts, 1).unwrap()),
        alibi_slopes: None,
    };
    core_attention(&[1.0; 2], &[1.0; 3], &[1.0; 3], &mut [0.0; 2], dims, mask);
}

#[test]
fn small_packed_case_matches_finite_differences() {
    // Sequence 0: documents [0, 3), [3, 6), [6, 9); sequence 1: [0, 4), [4, 9). GQA a=4, g=2.
    let dims = AttentionDims {
        sq: 9,
        skv: 9,
        batch: 2,
        heads: 4,
        groups: 2,
        head_dim: 6,
        q_offset: 0,
        kv_offset: 0,
    };
    let tokens = packed_tokens(9, &[&[2, 5], &[3]]);
    for window in [None, Some(2)] {
        let case = Case {
            dims,
            tokens: tokens.clone(),
            window,
        };
        let (x, got) = check_case(&case, 31, 1e-6);
        let loss = |x: &[Vec<f64>; 4]| -> f64 {
            case.reference(x)
                .0
                .iter()
                .zip(&x[3])
                .map(|(a, b)| a * b)
                .sum()
        };
        let eps = 1e-6;
        for (i, name) in ["dq", "dk", "dv"].into_iter().enumerate() {
            let numeric: Vec<f64> = (0..x[i].len())
                .map(|e| {
                    let mut xp = x.clone();
                    xp[i][e] += eps;
                    let mut xm = x.clone();
                    xm[i][e] -= eps;
                    (loss(&xp) - loss(&xm)) / (2.0 * eps)
                })
                .collect();
            check(
                &format!("w={window:?} {name} vs finite differences"),
                &got.grads[i],
                &numeric,
                1e-5,
            );
        }
    }
}

/// Sequence 0: documents [0, 41), [41, 64), [64, 128), [128, 150) (boundaries on key-block
/// edges); sequence 1: [0, 1), [1, 101), [101, 102), [102, 150) (one-token documents, EOD last).
fn multi_block_case(window: Option<usize>) -> Case {
    Case {
        dims: AttentionDims {
            sq: 150,
            skv: 150,
            batch: 2,
            heads: 4,
            groups: 2,
            head_dim: 20,
            q_offset: 0,
            kv_offset: 0,
        },
        tokens: packed_tokens(150, &[&[40, 63, 127], &[0, 100, 101, 149]]),
        window,
    }
}

#[test]
fn packed_multi_block_case_matches_f64_reference() {
    for window in [None, Some(5), Some(70)] {
        check_case(&multi_block_case(window), 32, 1e-5);
    }
}

#[test]
fn packed_row_equals_documents_run_alone() {
    for window in [None, Some(30)] {
        let case = multi_block_case(window);
        let (x, packed) = check_case(&case, 33, 1e-5);
        let AttentionDims {
            batch: b,
            heads: a,
            groups: g,
            head_dim: d,
            ..
        } = case.dims;
        let starts = document_starts(&case.tokens, b, EOD).unwrap();
        let docs = DocumentStarts::new(&starts, b).unwrap();
        for j in 0..b {
            let mut lo = 0;
            while lo < case.dims.sq {
                let hi = docs.end(lo, j);
                let n = hi - lo;
                let dims = AttentionDims {
                    sq: n,
                    skv: n,
                    batch: 1,
                    q_offset: 0,
                    kv_offset: 0,
                    ..case.dims
                };
                let mask = AttentionMask {
                    sliding_window: window,
                    documents: None,
                    alibi_slopes: None,
                };
                // Rows lo..hi of sequence j, `width` values each, from an [s, b, width] tensor.
                let rows = |x: &[f64], width: usize| -> Vec<f64> {
                    (lo..hi)
                        .flat_map(|t| x[(t * b + j) * width..][..width].to_vec())
                        .collect()
                };
                let alone_x = [
                    rows(&x[0], a * d),
                    rows(&x[1], g * d),
                    rows(&x[2], g * d),
                    rows(&x[3], a * d),
                ];
                let alone = run_f32(&alone_x, dims, mask);
                let pick = |x: &[f32], width: usize| -> Vec<f64> {
                    let x: Vec<f64> = x.iter().map(|&v| v as f64).collect();
                    rows(&x, width)
                };
                let name = |what: &str| format!("w={window:?} seq {j} doc [{lo}, {hi}) {what}");
                check(&name("out"), &alone.out, &pick(&packed.out, a * d), 1e-6);
                check(&name("lse"), &alone.lse, &pick(&packed.lse, a), 1e-6);
                for (i, width) in [a * d, g * d, g * d].into_iter().enumerate() {
                    let what = ["dq", "dk", "dv"][i];
                    check(
                        &name(what),
                        &alone.grads[i],
                        &pick(&packed.grads[i], width),
                        1e-6,
                    );
                }
                lo = hi;
            }
        }
    }
}
