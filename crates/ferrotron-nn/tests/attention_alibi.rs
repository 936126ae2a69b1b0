//! ALiBi (Press et al. 2022) in the three attention kernels: the slopes against HF Bloom's
//! `_get_alibi_slopes`; the inference kernel, the training forward and the backward against an
//! f64 reference with dense scores + `slope_h·(j − i)` + mask + softmax (GQA, query offsets,
//! sliding windows, packed documents, several key blocks); gradients against central finite
//! differences of that reference; zero slopes bitwise equal to no ALiBi; tensor-parallel
//! slices of the slopes; and HF's key-position form `slope_h·j` giving the same softmax.

use ferrotron_nn::attention::AttentionPrecision::F32;
use ferrotron_nn::attention::{
    AttentionDims, AttentionMask, DocumentStarts, alibi_slopes, core_attention,
    core_attention_backward, core_attention_forward_train, document_starts,
};

const EOD: u32 = 0;

/// HF Bloom's slopes, printed by the pinned venv (`/work/main/tools/.venv`: transformers 5.23,
/// torch 2.15, CPU) with
/// `[repr(np.float32(x)) for x in modeling_bloom._get_alibi_slopes(n, torch.device("cpu"))]`
/// (the slopes `build_alibi_tensor` multiplies by the key positions; checked equal to
/// `build_alibi_tensor(torch.ones(1, 2), n, torch.float32)[:, 0, 1]`).
#[test]
fn slopes_match_hf_bloom() {
    let hf: [(usize, &[f32]); 4] = [
        (4, &[0.25, 0.0625, 0.015625, 0.00390625]),
        (6, &[0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]),
        (
            8,
            &[
                0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625,
            ],
        ),
        (
            12,
            &[
                0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625, 0.70710677,
                0.35355338, 0.17677668, 0.08838834,
            ],
        ),
    ];
    for (n, want) in hf {
        let got = alibi_slopes(n);
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(want), "{n} heads: {got:?}");
    }
}

/// 40 heads (Baichuan-13B's count), produced as in [`slopes_match_hf_bloom`]: the f32 base
/// `2^−1/4` raised in f32 (so the 8th slope is `0.25000003`, not `0.25`). Torch's vectorized
/// CPU `pow` (1-ulp accurate) rounds the 15th slope down to `0x3d9837f2`; the exact power
/// `0.0743254610…` rounds to `0x3d9837f3`, which `alibi_slopes` returns. Everything else is
/// bit-identical.
#[test]
// `0.7071068` is HF's `(2^−1/4 in f32)²`, one ulp above `FRAC_1_SQRT_2 as f32`.
#[allow(clippy::approx_constant)]
fn slopes_for_40_heads_match_hf_bloom_to_one_ulp() {
    let hf: [f32; 40] = [
        0.8408964,
        0.7071068,
        0.5946036,
        0.5,
        0.42044824,
        0.3535534,
        0.2973018,
        0.25000003,
        0.21022414,
        0.17677672,
        0.14865091,
        0.12500001,
        0.10511207,
        0.08838837,
        0.07432546,
        0.062500015,
        0.052556038,
        0.044194184,
        0.037162732,
        0.031250007,
        0.02627802,
        0.022097094,
        0.018581368,
        0.015625006,
        0.013139011,
        0.011048548,
        0.009290684,
        0.007812503,
        0.006569506,
        0.005524274,
        0.0046453425,
        0.003906252,
        0.91700405,
        0.7711054,
        0.6484198,
        0.5452539,
        0.45850205,
        0.38555273,
        0.32420993,
        0.27262697,
    ];
    let got = alibi_slopes(40);
    assert_eq!(got.len(), 40);
    for (i, (&g, &w)) in got.iter().zip(&hf).enumerate() {
        if i == 14 {
            assert_eq!((w.to_bits(), g.to_bits()), (0x3d98_37f2, 0x3d98_37f3));
        } else {
            assert_eq!(g.to_bits(), w.to_bits(), "slope {i}: {g} vs {w}");
        }
    }
}

#[test]
#[should_panic(expected = "num_heads")]
fn slopes_need_a_head() {
    alibi_slopes(0);
}

/// One test case: sizes, the mask (window, optional packed documents) and the slopes.
#[derive(Clone)]
struct Case {
    dims: AttentionDims,
    window: Option<usize>,
    /// `[s, b]` document starts, or `None` for one document per row.
    starts: Option<Vec<u32>>,
    slopes: Option<Vec<f32>>,
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

fn f32s(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&v| v as f32).collect()
}

/// Outputs of the f32 kernels: training forward, backward, inference kernel.
struct Run {
    out: Vec<f32>,
    lse: Vec<f32>,
    grads: [Vec<f32>; 3],
    inference: Vec<f32>,
}

/// Where HF adds the bias: `slope·(j − i)` (ours) or `slope·j` (Bloom's key position).
#[derive(Clone, Copy, PartialEq)]
enum BiasForm {
    Relative,
    KeyPosition,
}

impl Case {
    fn mask(&self) -> AttentionMask<'_> {
        AttentionMask {
            sliding_window: self.window,
            documents: self
                .starts
                .as_deref()
                .map(|s| DocumentStarts::new(s, self.dims.batch).unwrap()),
            alibi_slopes: self.slopes.as_deref(),
        }
    }

    fn qi(&self, t: usize, j: usize, h: usize) -> usize {
        ((t * self.dims.batch + j) * self.dims.heads + h) * self.dims.head_dim
    }

    fn ki(&self, p: usize, j: usize, gh: usize) -> usize {
        ((p * self.dims.batch + j) * self.dims.groups + gh) * self.dims.head_dim
    }

    /// Dense mask, written out: causal, window `i − j < w`, same document (`j >= start(i)`).
    fn visible(&self, t: usize, j: usize, p: usize) -> bool {
        let i = self.dims.q_offset + t;
        p <= i
            && self.window.is_none_or(|w| i - p < w)
            && self
                .starts
                .as_ref()
                .is_none_or(|s| p >= s[t * self.dims.batch + j] as usize)
    }

    /// Scores of one query row over all keys: `q·k/√d + bias`, `-inf` where masked.
    fn scores(
        &self,
        q: &[f64],
        k: &[f64],
        t: usize,
        j: usize,
        h: usize,
        form: BiasForm,
    ) -> Vec<f64> {
        let AttentionDims {
            skv,
            heads: a,
            groups: g,
            head_dim: d,
            q_offset,
            ..
        } = self.dims;
        let qr = &q[self.qi(t, j, h)..][..d];
        let slope = self.slopes.as_ref().map_or(0.0, |s| s[h] as f64);
        let i = (q_offset + t) as f64;
        (0..skv)
            .map(|p| {
                if !self.visible(t, j, p) {
                    return f64::NEG_INFINITY;
                }
                let kr = &k[self.ki(p, j, h / (a / g))..][..d];
                let dot = qr.iter().zip(kr).map(|(x, y)| x * y).sum::<f64>();
                let bias = match form {
                    BiasForm::Relative => slope * (p as f64 - i),
                    BiasForm::KeyPosition => slope * p as f64,
                };
                dot / (d as f64).sqrt() + bias
            })
            .collect()
    }

    /// f64 reference with a dense softmax: `(out, lse, [dq, dk, dv])`; the bias is a constant,
    /// so `dS` reaches `q` and `k` through `q·k/√d` only.
    fn reference(
        &self,
        [q, k, v, dout]: &[Vec<f64>; 4],
        form: BiasForm,
    ) -> (Vec<f64>, Vec<f64>, [Vec<f64>; 3]) {
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
            let s = self.scores(q, k, t, j, h, form);
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

    /// `q, k, v, dout`, reproducible (xorshift64*), rounded to f32.
    fn inputs(&self, seed: u64) -> [Vec<f64>; 4] {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut random = |n: usize, scale: f64| -> Vec<f64> {
            (0..n)
                .map(|_| {
                    state ^= state >> 12;
                    state ^= state << 25;
                    state ^= state >> 27;
                    let u = (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64;
                    ((2.0 * u / (1u64 << 53) as f64 - 1.0) * scale) as f32 as f64
                })
                .collect()
        };
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
        [
            random(nq, 1.5),
            random(nk, 1.5),
            random(nk, 1.0),
            random(nq, 1.0),
        ]
    }

    fn run_f32(&self, x: &[Vec<f64>; 4]) -> Run {
        let (dims, mask) = (self.dims, self.mask());
        let [q, k, v, dout] = x.each_ref().map(|x| f32s(x));
        let mut out = vec![0f32; q.len()];
        let mut lse = vec![0f32; q.len() / dims.head_dim];
        core_attention_forward_train(&q, &k, &v, &mut out, &mut lse, dims, mask, F32);
        let mut dq = vec![f32::NAN; q.len()];
        let (mut dk, mut dv) = (vec![f32::NAN; k.len()], vec![f32::NAN; v.len()]);
        core_attention_backward(
            &q, &k, &v, &out, &dout, &lse, &mut dq, &mut dk, &mut dv, dims, mask, F32,
        );
        let mut inference = vec![f32::NAN; q.len()];
        core_attention(&q, &k, &v, &mut inference, dims, mask);
        Run {
            out,
            lse,
            grads: [dq, dk, dv],
            inference,
        }
    }

    fn name(&self) -> String {
        let AttentionDims {
            sq,
            skv,
            batch,
            heads,
            groups,
            head_dim,
            q_offset,
            ..
        } = self.dims;
        format!(
            "sq={sq} skv={skv} b={batch} a={heads} g={groups} d={head_dim} off={q_offset} \
             w={:?} docs={}",
            self.window,
            self.starts.is_some()
        )
    }

    /// All three kernels against the f64 reference; returns the inputs and the f32 run.
    fn check_against_reference(&self, seed: u64, tol: f64) -> ([Vec<f64>; 4], Run) {
        let x = self.inputs(seed);
        let got = self.run_f32(&x);
        let (out, lse, grads) = self.reference(&x, BiasForm::Relative);
        let name = self.name();
        check(&format!("{name} forward out"), &got.out, &out, tol);
        check(&format!("{name} forward lse"), &got.lse, &lse, tol);
        check(&format!("{name} core_attention"), &got.inference, &out, tol);
        for (i, what) in ["dq", "dk", "dv"].into_iter().enumerate() {
            check(&format!("{name} {what}"), &got.grads[i], &grads[i], tol);
        }
        // The bias matters here: without it the outputs are far from the ALiBi reference.
        let plain = Case {
            slopes: None,
            ..self.clone()
        };
        let (plain_out, ..) = plain.reference(&x, BiasForm::Relative);
        let scale = out.iter().fold(0f64, |m, v| m.max(v.abs()));
        let diff = out
            .iter()
            .zip(&plain_out)
            .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            diff / scale > 1e-2,
            "{name}: ALiBi changes out by only {diff:e}"
        );
        (x, got)
    }
}

fn dims(
    sq: usize,
    skv: usize,
    batch: usize,
    heads: usize,
    groups: usize,
    head_dim: usize,
    q_offset: usize,
) -> AttentionDims {
    AttentionDims {
        sq,
        skv,
        batch,
        heads,
        groups,
        head_dim,
        q_offset,
        kv_offset: 0,
    }
}

/// `[s, b]` document starts of sequences whose EODs sit at the given positions.
fn starts(s: usize, eods: &[&[usize]]) -> Vec<u32> {
    let b = eods.len();
    let tokens: Vec<u32> = (0..s * b)
        .map(|i| {
            let (t, j) = (i / b, i % b);
            if eods[j].contains(&t) { EOD } else { 1 }
        })
        .collect();
    document_starts(&tokens, b, EOD).unwrap()
}

fn case(dims: AttentionDims, window: Option<usize>) -> Case {
    Case {
        dims,
        window,
        starts: None,
        slopes: Some(alibi_slopes(dims.heads)),
    }
}

/// Sequence 0: documents [0, 41), [41, 64), [64, 128), [128, 150) (boundaries on key-block
/// edges); sequence 1: [0, 1), [1, 101), [101, 102), [102, 150); GQA a=4, g=2.
fn packed_case(window: Option<usize>) -> Case {
    Case {
        starts: Some(starts(150, &[&[40, 63, 127], &[0, 100, 101, 149]])),
        ..case(dims(150, 150, 2, 4, 2, 20, 0), window)
    }
}

#[test]
fn kernels_match_f64_reference_with_gqa_windows_and_offsets() {
    // Inference-sized (a KV-cache step of 3 queries after 4 cached keys), GQA a=4, g=2.
    for window in [None, Some(2), Some(3)] {
        case(dims(3, 7, 2, 4, 2, 5, 4), window).check_against_reference(41, 1e-5);
    }
    // Three 64-key blocks, windows across block edges, query offset 13.
    for window in [None, Some(70), Some(5)] {
        case(dims(137, 150, 2, 4, 2, 20, 13), window).check_against_reference(42, 1e-5);
    }
    // Plain multi-head (a = g = 3: slopes of a non-power-of-two count), d = 80.
    for window in [None, Some(33)] {
        case(dims(70, 70, 1, 3, 3, 80, 0), window).check_against_reference(43, 1e-5);
    }
    // 12 heads in 4 groups (HF's extra odd-power slopes), query offset 30.
    case(dims(40, 70, 1, 12, 4, 16, 30), None).check_against_reference(44, 1e-5);
}

#[test]
fn kernels_match_f64_reference_with_documents() {
    for window in [None, Some(5), Some(70)] {
        packed_case(window).check_against_reference(45, 1e-5);
    }
}

/// The reference's own gradients and the kernels' against central differences of the
/// reference loss `Σ out ⊙ dout`.
fn check_finite_differences(case: &Case, seed: u64) {
    let (x, got) = case.check_against_reference(seed, 1e-6);
    let (_, _, reference) = case.reference(&x, BiasForm::Relative);
    let loss = |x: &[Vec<f64>; 4]| -> f64 {
        let (out, ..) = case.reference(x, BiasForm::Relative);
        out.iter().zip(&x[3]).map(|(a, b)| a * b).sum()
    };
    let eps = 1e-6;
    for (i, what) in ["dq", "dk", "dv"].into_iter().enumerate() {
        let mut xp = x.clone();
        let numeric: Vec<f64> = (0..x[i].len())
            .map(|e| {
                xp[i][e] = x[i][e] + eps;
                let up = loss(&xp);
                xp[i][e] = x[i][e] - eps;
                let down = loss(&xp);
                xp[i][e] = x[i][e];
                (up - down) / (2.0 * eps)
            })
            .collect();
        let name = format!("{} {what}", case.name());
        check(
            &format!("{name} f64 reference vs finite differences"),
            &f32s(&reference[i]),
            &numeric,
            1e-6,
        );
        check(
            &format!("{name} vs finite differences"),
            &got.grads[i],
            &numeric,
            1e-5,
        );
    }
}

#[test]
fn backward_matches_finite_differences() {
    // Query offset 4, GQA a=4, g=2, batch 2; with a window, keys 0 and 1 are seen by no query.
    for window in [None, Some(3)] {
        check_finite_differences(&case(dims(5, 9, 2, 4, 2, 6, 4), window), 46);
    }
    // Packed: sequence 0 = [0, 3), [3, 6), [6, 9); sequence 1 = [0, 4), [4, 9).
    for window in [None, Some(2)] {
        let packed = Case {
            starts: Some(starts(9, &[&[2, 5], &[3]])),
            ..case(dims(9, 9, 2, 4, 2, 6, 0), window)
        };
        check_finite_differences(&packed, 47);
    }
}

/// `j − i` does not depend on where a document starts: a packed row equals its documents run
/// alone, with the same slopes.
#[test]
fn packed_row_equals_documents_run_alone() {
    for window in [None, Some(30)] {
        let packed = packed_case(window);
        let x = packed.inputs(48);
        let got = packed.run_f32(&x);
        let AttentionDims {
            sq,
            batch: b,
            heads: a,
            groups: g,
            head_dim: d,
            ..
        } = packed.dims;
        let docs = DocumentStarts::new(packed.starts.as_deref().unwrap(), b).unwrap();
        for j in 0..b {
            let mut lo = 0;
            while lo < sq {
                let hi = docs.end(lo, j);
                let rows = |x: &[f64], width: usize| -> Vec<f64> {
                    (lo..hi)
                        .flat_map(|t| x[(t * b + j) * width..][..width].to_vec())
                        .collect()
                };
                let alone = Case {
                    dims: dims(hi - lo, hi - lo, 1, a, g, d, 0),
                    starts: None,
                    ..packed.clone()
                };
                let alone_x = [
                    rows(&x[0], a * d),
                    rows(&x[1], g * d),
                    rows(&x[2], g * d),
                    rows(&x[3], a * d),
                ];
                let run = alone.run_f32(&alone_x);
                let pick = |x: &[f32], width: usize| -> Vec<f64> {
                    rows(&x.iter().map(|&v| v as f64).collect::<Vec<_>>(), width)
                };
                let name = |what: &str| format!("w={window:?} seq {j} doc [{lo}, {hi}) {what}");
                check(&name("out"), &run.out, &pick(&got.out, a * d), 1e-6);
                check(&name("lse"), &run.lse, &pick(&got.lse, a), 1e-6);
                for (i, width) in [a * d, g * d, g * d].into_iter().enumerate() {
                    let what = ["dq", "dk", "dv"][i];
                    check(
                        &name(what),
                        &run.grads[i],
                        &pick(&got.grads[i], width),
                        1e-6,
                    );
                }
                lo = hi;
            }
        }
    }
}

fn bitwise_equal(name: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{name}");
    let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    assert!(same, "{name}: not bitwise equal");
}

/// Zero slopes add `±0` to every score: all kernels give bitwise the results of the path
/// without ALiBi (which the `attention_*` tests check against their references).
#[test]
fn zero_slopes_equal_no_alibi_bitwise() {
    let cases = [
        case(dims(137, 150, 2, 4, 2, 20, 13), Some(70)),
        case(dims(70, 70, 1, 3, 3, 80, 0), None),
        packed_case(Some(5)),
    ];
    for c in cases {
        let x = c.inputs(49);
        let zero = Case {
            slopes: Some(vec![0.0; c.dims.heads]),
            ..c.clone()
        };
        let none = Case {
            slopes: None,
            ..c.clone()
        };
        let (z, n) = (zero.run_f32(&x), none.run_f32(&x));
        let name = c.name();
        bitwise_equal(&format!("{name} out"), &z.out, &n.out);
        bitwise_equal(&format!("{name} lse"), &z.lse, &n.lse);
        bitwise_equal(
            &format!("{name} core_attention"),
            &z.inference,
            &n.inference,
        );
        for i in 0..3 {
            bitwise_equal(&format!("{name} grad {i}"), &z.grads[i], &n.grads[i]);
        }
    }
}

/// Two tensor-parallel ranks, each with half the heads and groups and its slice of the slopes,
/// give bitwise the full call's results.
#[test]
fn tensor_parallel_ranks_pass_their_slice_of_the_slopes() {
    let full = case(dims(100, 110, 2, 8, 4, 16, 10), Some(40));
    let x = full.inputs(50);
    let got = full.run_f32(&x);
    let AttentionDims {
        sq,
        skv,
        batch: b,
        heads: a,
        groups: g,
        head_dim: d,
        ..
    } = full.dims;
    let all = alibi_slopes(a);
    let (ar, gr) = (a / 2, g / 2);
    // Columns `rank·width..` of the rows of a `[rows, 2·width]` tensor.
    let half = |x: &[f64], width: usize, rank: usize| -> Vec<f64> {
        x.chunks(2 * width)
            .flat_map(|row| row[rank * width..][..width].to_vec())
            .collect()
    };
    let half32 = |x: &[f32], width: usize, rank: usize| -> Vec<f32> {
        x.chunks(2 * width)
            .flat_map(|row| row[rank * width..][..width].to_vec())
            .collect()
    };
    for rank in 0..2 {
        let local = Case {
            dims: dims(sq, skv, b, ar, gr, d, full.dims.q_offset),
            slopes: Some(all[rank * ar..][..ar].to_vec()),
            ..full.clone()
        };
        let xr = [
            half(&x[0], ar * d, rank),
            half(&x[1], gr * d, rank),
            half(&x[2], gr * d, rank),
            half(&x[3], ar * d, rank),
        ];
        let run = local.run_f32(&xr);
        let name = format!("rank {rank}");
        bitwise_equal(&name, &run.out, &half32(&got.out, ar * d, rank));
        bitwise_equal(&name, &run.lse, &half32(&got.lse, ar, rank));
        bitwise_equal(&name, &run.inference, &half32(&got.inference, ar * d, rank));
        for (i, width) in [ar * d, gr * d, gr * d].into_iter().enumerate() {
            bitwise_equal(&name, &run.grads[i], &half32(&got.grads[i], width, rank));
        }
    }
}

/// HF Bloom adds `slope·j` (key position) where the kernels add `slope·(j − i)`: the same
/// softmax, since the two differ by `slope·i`, constant along a query row (only the logsumexp
/// shifts, by `slope·i`).
#[test]
fn hf_key_position_bias_gives_the_same_softmax() {
    for c in [
        case(dims(137, 150, 2, 4, 2, 20, 13), Some(70)),
        packed_case(None),
    ] {
        let x = c.inputs(51);
        let (out, lse, grads) = c.reference(&x, BiasForm::Relative);
        let (hf_out, hf_lse, hf_grads) = c.reference(&x, BiasForm::KeyPosition);
        let close = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-10);
        assert!(close(&out, &hf_out));
        for i in 0..3 {
            assert!(close(&grads[i], &hf_grads[i]));
        }
        let AttentionDims {
            batch: b,
            heads: a,
            q_offset,
            ..
        } = c.dims;
        let slopes = c.slopes.as_ref().unwrap();
        for (r, (l, hf)) in lse.iter().zip(&hf_lse).enumerate() {
            let (t, h) = (r / (b * a), r % a);
            let shift = slopes[h] as f64 * (q_offset + t) as f64;
            assert!(
                (l + shift - hf).abs() < 1e-9,
                "row {r}: {l} + {shift} vs {hf}"
            );
        }
        // And the kernels agree with the HF form's output.
        check(
            &format!("{} vs HF form", c.name()),
            &c.run_f32(&x).out,
            &hf_out,
            1e-5,
        );
    }
}

#[test]
#[should_panic(expected = "3 ALiBi slopes for 4 query heads")]
fn inference_rejects_wrong_slope_count() {
    let slopes = [0.5; 3];
    let mask = AttentionMask {
        alibi_slopes: Some(&slopes),
        ..Default::default()
    };
    let (q, kv) = (vec![0f32; 4 * 2], vec![0f32; 2 * 2]);
    core_attention(
        &q,
        &kv,
        &kv,
        &mut [0f32; 8],
        dims(1, 1, 1, 4, 2, 2, 0),
        mask,
    );
}

#[test]
#[should_panic(expected = "5 ALiBi slopes for 4 query heads")]
fn training_rejects_wrong_slope_count() {
    let slopes = [0.5; 5];
    let mask = AttentionMask {
        alibi_slopes: Some(&slopes),
        ..Default::default()
    };
    let (q, kv) = (vec![0f32; 4 * 2], vec![0f32; 2 * 2]);
    let (mut out, mut lse) = (vec![0f32; 8], vec![0f32; 4]);
    core_attention_forward_train(
        &q,
        &kv,
        &kv,
        &mut out,
        &mut lse,
        dims(1, 1, 1, 4, 2, 2, 0),
        mask,
        F32,
    );
}
