//! Context-parallel core attention against one rank: at cp 2 and 4 (in-process ranks, each
//! with its load-balanced share of the sequence), every comm type (`p2p` ring, `all_gather`,
//! `a2a`) gives each rank the one-rank output, dQ, dK and dV of its tokens — causal, with
//! packed documents, a sliding window and ALiBi, GQA, batch 2, chunks spanning several key
//! blocks — in f32 (1e-5) and with bf16 products (one rank's bf16 result, 2e-2 as TE's
//! cp tests); and the partial-result merge is exact against one softmax.

use ferrotron_comm::run_local;
use ferrotron_nn::attention::{
    AttentionDims, AttentionMask, AttentionPrecision, DocumentStarts, alibi_slopes,
    core_attention_backward, core_attention_forward_train,
};
use ferrotron_nn::context_parallel::merge_partial;
use ferrotron_nn::{ContextParallel, CpCommType};
use std::sync::Arc;

mod common;
use common::values;

const B: usize = 2;
const A: usize = 4;
const G: usize = 2;
const D: usize = 8;

/// One case: sequence length, mask options.
#[derive(Clone, Copy)]
struct Case {
    seq: usize,
    documents: bool,
    /// Many documents shorter than `2·C` (with `documents`).
    short_documents: bool,
    window: Option<usize>,
    alibi: bool,
    precision: AttentionPrecision,
}

/// `[s, b]` document starts: sequence 0 splits at 5 and 2s/3, sequence 1 at s/2 + 1; with
/// `short`, sequence 0 is documents of 1, 2, ..., 7, 1, 2, ... tokens (most shorter than
/// `2·C` at cp 4: ranks hold nothing of some).
fn starts(s: usize, short: bool) -> Vec<u32> {
    let short_cuts = (1..=7).cycle().scan(0, |at, n| {
        *at += n;
        Some(*at)
    });
    let cuts = match short {
        false => [vec![5, 2 * s / 3], vec![s / 2 + 1]],
        true => [short_cuts.take_while(|&c| c < s).collect(), vec![s / 2 + 1]],
    };
    let mut out = vec![0u32; s * B];
    for (j, cuts) in cuts.iter().enumerate() {
        let mut start = 0;
        for t in 0..s {
            if cuts.contains(&t) {
                start = t;
            }
            out[t * B + j] = start as u32;
        }
    }
    out
}

/// Causal self-attention dims of `s` tokens per sequence, no offsets.
fn dims(s: usize) -> AttentionDims {
    AttentionDims {
        sq: s,
        skv: s,
        batch: B,
        heads: A,
        groups: G,
        head_dim: D,
        q_offset: 0,
        kv_offset: 0,
    }
}

/// This rank's share of `[s, b, heads, d]` rows (Megatron's load-balanced chunks, per
/// document with `docs`).
fn share(cp: &ContextParallel, x: &[f32], s: usize, docs: Option<DocumentStarts>) -> Vec<f32> {
    let split = cp.split(s, B, docs).unwrap();
    split.share(cp.rank(), x, x.len() / (s * B)).unwrap()
}

struct Full {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    dout: Vec<f32>,
    out: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

fn one_rank(case: Case, docs: &[u32], slopes: &[f32]) -> Full {
    let s = case.seq;
    let (q, k, v) = (
        values(s * B * A * D, 1, 2.0),
        values(s * B * G * D, 2, 2.0),
        values(s * B * G * D, 3, 1.0),
    );
    let dout = values(q.len(), 4, 1.0);
    let dims = dims(s);
    let mask = mask(case, docs, slopes);
    let (mut out, mut lse) = (vec![0f32; q.len()], vec![0f32; s * B * A]);
    core_attention_forward_train(&q, &k, &v, &mut out, &mut lse, dims, mask, case.precision);
    let (mut dq, mut dk, mut dv) = (
        vec![0f32; q.len()],
        vec![0f32; k.len()],
        vec![0f32; v.len()],
    );
    core_attention_backward(
        &q,
        &k,
        &v,
        &out,
        &dout,
        &lse,
        &mut dq,
        &mut dk,
        &mut dv,
        dims,
        mask,
        case.precision,
    );
    Full {
        q,
        k,
        v,
        dout,
        out,
        dq,
        dk,
        dv,
    }
}

fn mask<'a>(case: Case, docs: &'a [u32], slopes: &'a [f32]) -> AttentionMask<'a> {
    AttentionMask {
        sliding_window: case.window,
        documents: case
            .documents
            .then(|| DocumentStarts::new(docs, B).unwrap()),
        alibi_slopes: case.alibi.then_some(slopes),
    }
}

fn assert_near(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

fn check(case: Case, cp_size: usize, comm_type: CpCommType, label: &str) {
    let s = case.seq;
    let docs = starts(s, case.short_documents);
    let slopes = alibi_slopes(A);
    let want = one_rank(case, &docs, &slopes);
    let tol = match case.precision {
        AttentionPrecision::F32 => 1e-5,
        AttentionPrecision::Bf16 | AttentionPrecision::Bf16Tiles => 2e-2,
    };
    run_local(cp_size, |comm| {
        let cp = ContextParallel::new(Arc::new(comm), comm_type);
        let sl = s / cp_size;
        let mask = mask(case, &docs, &slopes);
        let share = |x: &[f32]| share(&cp, x, s, mask.documents);
        let [q, k, v, dout] = [&want.q, &want.k, &want.v, &want.dout].map(|x| share(x));
        let dims = dims(sl);
        let (mut out, mut lse) = (vec![0f32; q.len()], vec![0f32; sl * B * A]);
        cp.attention_forward(&q, &k, &v, &mut out, &mut lse, dims, mask, case.precision)?;
        let (mut dq, mut dk, mut dv) = (
            vec![0f32; q.len()],
            vec![0f32; k.len()],
            vec![0f32; v.len()],
        );
        let grads = [&mut dq[..], &mut dk[..], &mut dv[..]];
        cp.attention_backward(
            [&q, &k, &v],
            &out,
            &dout,
            &lse,
            grads,
            dims,
            mask,
            case.precision,
        )?;
        let r = cp.rank();
        let at = |what: &str| format!("{label} cp{cp_size} {} rank {r} {what}", comm_type.name());
        assert_near(&at("out"), &out, &share(&want.out), tol);
        assert_near(&at("dq"), &dq, &share(&want.dq), tol);
        assert_near(&at("dk"), &dk, &share(&want.dk), tol);
        assert_near(&at("dv"), &dv, &share(&want.dv), tol);
        Ok::<_, ferrotron_nn::NnError>(())
    })
    .unwrap_or_else(|e| panic!("{label}: {e}"));
}

const TYPES: [CpCommType; 3] = [CpCommType::P2p, CpCommType::AllGather, CpCommType::A2a];

fn causal(seq: usize) -> Case {
    Case {
        seq,
        documents: false,
        short_documents: false,
        window: None,
        alibi: false,
        precision: AttentionPrecision::F32,
    }
}

#[test]
fn causal_attention_equals_one_rank() {
    // cp 2: chunks of 80 tokens (two key blocks each); cp 4 (a2a needs heads / 4: A = 4 but
    // G = 2, so a2a runs at cp 2 only).
    for t in TYPES {
        check(causal(320), 2, t, "causal");
    }
    for t in [CpCommType::P2p, CpCommType::AllGather] {
        check(causal(96), 4, t, "causal");
    }
}

#[test]
fn masks_equal_one_rank() {
    let cases = [
        (
            "documents",
            Case {
                documents: true,
                ..causal(96)
            },
        ),
        (
            "window",
            Case {
                window: Some(30),
                ..causal(96)
            },
        ),
        (
            "short documents",
            Case {
                documents: true,
                short_documents: true,
                ..causal(96)
            },
        ),
        (
            "alibi + documents",
            Case {
                alibi: true,
                documents: true,
                ..causal(96)
            },
        ),
    ];
    for (label, case) in cases {
        for t in TYPES {
            check(case, 2, t, label);
        }
        check(case, 4, CpCommType::P2p, label);
        check(case, 4, CpCommType::AllGather, label);
    }
}

#[test]
fn bf16_products_equal_one_rank() {
    let case = Case {
        precision: AttentionPrecision::Bf16Tiles,
        documents: true,
        ..causal(128)
    };
    for t in TYPES {
        check(case, 2, t, "bf16");
    }
}

#[test]
fn a2a_needs_heads_divisible_by_cp() {
    let err = run_local(4, |comm| {
        let cp = ContextParallel::new(Arc::new(comm), CpCommType::A2a);
        let (sl, case) = (8, causal(32));
        let dims = dims(sl);
        let (q, kv) = (vec![0f32; sl * B * A * D], vec![0f32; sl * B * G * D]);
        let (mut out, mut lse) = (vec![0f32; q.len()], vec![0f32; sl * B * A]);
        let mask = mask(case, &[], &[]);
        cp.attention_forward(&q, &kv, &kv, &mut out, &mut lse, dims, mask, case.precision)
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("cp_comm_type") && err.contains("query groups"),
        "{err}"
    );
}

#[test]
fn merge_of_partials_is_one_softmax() {
    // Two halves of one row's keys: the merged output and log-sum-exp equal the whole row's.
    let (scores, vals) = (values(10, 7, 6.0), values(10 * 3, 8, 1.0));
    let softmax = |idx: std::ops::Range<usize>| {
        let m = idx
            .clone()
            .map(|i| scores[i])
            .fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = idx.clone().map(|i| ((scores[i] - m) as f64).exp()).sum();
        let mut o = vec![0f32; 3];
        for i in idx {
            let w = (((scores[i] - m) as f64).exp() / sum) as f32;
            (0..3).for_each(|c| o[c] += w * vals[i * 3 + c]);
        }
        (o, m + (sum.ln() as f32))
    };
    let (whole, lse) = softmax(0..10);
    let (mut o, l0) = softmax(0..4);
    let (o1, l1) = softmax(4..10);
    let mut l = [l0];
    merge_partial(&mut o, &mut l, &o1, &[l1]);
    assert!((l[0] - lse).abs() < 1e-5, "{} vs {lse}", l[0]);
    for (a, b) in o.iter().zip(&whole) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }
    // A block that reached nothing leaves the accumulator.
    let before = o.clone();
    merge_partial(&mut o, &mut l, &[9.0; 3], &[f32::NEG_INFINITY]);
    assert_eq!(o, before);
}
