//! Sampler tests: each HF logits processor against hand-computed values, greedy, seeding and
//! empirical sampling frequencies.

use ferrotron_infer::sampler::{
    Sampler, SamplingError, SamplingParams, apply_repetition_penalty, apply_temperature,
    apply_top_k, apply_top_p, argmax, log_softmax,
};

const NEG_INF: f32 = f32::NEG_INFINITY;

fn sampling(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
    SamplingParams::new(false, temperature, top_k, top_p, 1.0, seed).unwrap()
}

/// Frequencies of `draws` samples from `logits` (fresh copy each draw, no previous tokens).
fn frequencies(params: SamplingParams, logits: &[f32], draws: usize) -> Vec<f64> {
    let mut sampler = Sampler::new(params).unwrap();
    let mut counts = vec![0usize; logits.len()];
    for _ in 0..draws {
        let mut l = logits.to_vec();
        counts[sampler.sample(&mut l, &[]) as usize] += 1;
    }
    counts.iter().map(|&c| c as f64 / draws as f64).collect()
}

fn assert_close(got: &[f64], want: &[f64], tol: f64) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() < tol,
            "token {i}: frequency {g} vs expected {w} (all: {got:?})"
        );
    }
}

#[test]
fn repetition_penalty_matches_hf() {
    // Positive logits are divided, negative ones multiplied; duplicates are penalized once;
    // a zero logit stays zero; unseen tokens are untouched.
    let mut logits = [2.0, -2.0, 0.5, 1.0, 0.0];
    apply_repetition_penalty(&mut logits, &[0, 1, 1, 0, 4, 1], 2.0);
    assert_eq!(logits, [1.0, -4.0, 0.5, 1.0, 0.0]);
    // A penalty < 1 rewards repetition the same way.
    let mut logits = [3.0, -3.0];
    apply_repetition_penalty(&mut logits, &[0, 1], 0.5);
    assert_eq!(logits, [6.0, -1.5]);
}

#[test]
#[should_panic(expected = "outside the vocabulary")]
fn repetition_penalty_rejects_out_of_vocab_ids() {
    apply_repetition_penalty(&mut [0.0, 1.0], &[2], 1.3);
}

#[test]
fn temperature_divides() {
    let mut logits = [1.0, -2.0, 3.0];
    apply_temperature(&mut logits, 0.5);
    assert_eq!(logits, [2.0, -4.0, 6.0]);
}

#[test]
fn top_k_keeps_k_largest_and_ties() {
    let mut logits = [1.0, 3.0, 3.0, 2.0, 0.0];
    apply_top_k(&mut logits, 3);
    assert_eq!(logits, [NEG_INF, 3.0, 3.0, 2.0, NEG_INF]);
    // Ties at the k-th value are all kept (HF removes only `logits < kth`).
    let mut logits = [1.0, 3.0, 3.0, 2.0, 0.0];
    apply_top_k(&mut logits, 1);
    assert_eq!(logits, [NEG_INF, 3.0, 3.0, NEG_INF, NEG_INF]);
    // 0 is off, k >= vocab removes nothing.
    for k in [0, 5, 9] {
        let mut logits = [1.0, 3.0, 3.0, 2.0, 0.0];
        apply_top_k(&mut logits, k);
        assert_eq!(logits, [1.0, 3.0, 3.0, 2.0, 0.0], "k = {k}");
    }
}

#[test]
fn top_p_removes_cumulative_mass_at_most_one_minus_p() {
    // probs 0.1, 0.2, 0.3, 0.4 -> ascending cumsum 0.1, 0.3, 0.6, 1.0.
    let base = [0.1f32, 0.2, 0.3, 0.4].map(f32::ln);
    let kept = |top_p: f32| {
        let mut logits = base;
        apply_top_p(&mut logits, top_p);
        logits.iter().map(|x| x.is_finite()).collect::<Vec<_>>()
    };
    assert_eq!(kept(0.75), [false, true, true, true]); // 1 - p = 0.25
    assert_eq!(kept(0.5), [false, false, true, true]); // 1 - p = 0.5
    assert_eq!(kept(0.35), [false, false, false, true]); // 1 - p = 0.65
    assert_eq!(kept(0.95), [true, true, true, true]); // 1 - p = 0.05
    assert_eq!(kept(1.0), [true, true, true, true]); // off
    let mut logits = base;
    apply_top_p(&mut logits, 0.75);
    assert_eq!(&logits[1..], &base[1..], "survivors are untouched");
}

#[test]
fn top_p_boundary_uses_less_or_equal() {
    // Uniform over 4: cumsum 0.25, 0.5, 0.75, 1.0 exactly; 1 - 0.75 == 0.25 removes one token.
    let mut logits = [0.0f32; 4];
    apply_top_p(&mut logits, 0.75);
    assert_eq!(logits.iter().filter(|x| x.is_infinite()).count(), 1);
    let mut logits = [0.0f32; 4];
    apply_top_p(&mut logits, 0.8);
    assert!(logits.iter().all(|x| x.is_finite()));
}

#[test]
fn top_p_always_keeps_the_most_likely_token() {
    // 1 - 1e-8 rounds to 1.0f32, so every cumsum (last one 1.0) is <= it; min_tokens_to_keep
    // still keeps the top token.
    let mut logits = [1.0, 2.0, 3.0];
    apply_top_p(&mut logits, 1e-8);
    assert_eq!(logits, [NEG_INF, NEG_INF, 3.0]);
    // Already-removed tokens (after top-k) do not count.
    let mut logits = [NEG_INF, 0.0, NEG_INF, 0.0];
    apply_top_p(&mut logits, 0.5);
    assert_eq!(logits.iter().filter(|x| x.is_finite()).count(), 1);
}

/// Straightforward transcription of HF's TopPLogitsWarper (full ascending sort).
fn reference_top_p(logits: &mut [f32], top_p: f32) {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(a.cmp(&b)));
    let max = logits[*order.last().unwrap()];
    let sum: f64 = logits.iter().map(|&x| f64::from((x - max).exp())).sum();
    let threshold = (1.0 - top_p.to_string().parse::<f64>().unwrap()) as f32;
    let mut cumulative = 0f64;
    for &i in &order[..order.len() - 1] {
        cumulative += f64::from((f64::from((logits[i] - max).exp()) / sum) as f32);
        if cumulative as f32 <= threshold {
            logits[i] = NEG_INF;
        }
    }
}

#[test]
fn top_p_on_a_full_vocabulary_matches_the_full_sort() {
    // Peaked logits take the partition shortcut, flat ones fall back to sorting everything.
    for (scale, top_p) in [
        (12.0f32, 0.9f32),
        (12.0, 0.5),
        (1.0, 0.9),
        (0.1, 0.3),
        (30.0, 0.99),
    ] {
        let base: Vec<f32> = (0..5000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 8) as f32 / 16_777_216.0)
            .map(|u| scale * u * u * u)
            .collect();
        let (mut fast, mut slow) = (base.clone(), base.clone());
        apply_top_p(&mut fast, top_p);
        reference_top_p(&mut slow, top_p);
        let kept = fast.iter().filter(|x| x.is_finite()).count();
        assert_eq!(fast, slow, "scale {scale}, top_p {top_p}, kept {kept}");
    }
}

#[test]
fn argmax_takes_first_maximum() {
    assert_eq!(argmax(&[1.0, 5.0, 5.0, 2.0]), 1);
    assert_eq!(argmax(&[-3.0]), 0);
    assert_eq!(argmax(&[NEG_INF, NEG_INF]), 0);
}

#[test]
fn greedy_is_argmax_after_repetition_penalty() {
    let mut greedy = Sampler::new(SamplingParams::greedy()).unwrap();
    assert_eq!(greedy.sample(&mut [0.5, 2.0, 2.0, -1.0], &[1, 2]), 1);
    let params =
        SamplingParams::new(true, 0.0, 0, 1.0, 2.0, 0).expect("temperature unused when greedy");
    let mut penalized = Sampler::new(params).unwrap();
    // 5 / 2 = 2.5 < 4.
    assert_eq!(penalized.sample(&mut [5.0, 4.0], &[0]), 1);
    // -1 * 2 = -2 < -1.5.
    assert_eq!(penalized.sample(&mut [-1.0, -1.5], &[0]), 1);
}

#[test]
fn validation_names_the_bad_field() {
    let field = |r: Result<SamplingParams, SamplingError>| match r {
        Err(SamplingError::InvalidParam { field, .. }) => field,
        Ok(p) => panic!("accepted {p:?}"),
    };
    assert_eq!(
        field(SamplingParams::new(false, 0.0, 0, 1.0, 1.0, 0)),
        "temperature"
    );
    assert_eq!(
        field(SamplingParams::new(false, f32::NAN, 0, 1.0, 1.0, 0)),
        "temperature"
    );
    assert_eq!(
        field(SamplingParams::new(false, 1.0, 0, 0.0, 1.0, 0)),
        "top_p"
    );
    assert_eq!(
        field(SamplingParams::new(false, 1.0, 0, 1.5, 1.0, 0)),
        "top_p"
    );
    assert_eq!(
        field(SamplingParams::new(true, 1.0, 0, 1.0, 0.0, 0)),
        "repetition_penalty"
    );
    assert_eq!(
        field(SamplingParams::new(true, 1.0, 0, 1.0, f32::INFINITY, 0)),
        "repetition_penalty"
    );
    let bad = SamplingParams {
        temperature: -1.0,
        ..sampling(1.0, 0, 1.0, 0)
    };
    let message = Sampler::new(bad).unwrap_err().to_string();
    assert!(message.contains("`temperature` = -1"), "{message}");
    assert_eq!(SamplingParams::default(), SamplingParams::greedy());
}

#[test]
fn same_seed_same_sequence() {
    let logits: Vec<f32> = (0..1000).map(|i| ((i * 37 % 101) as f32) / 20.0).collect();
    let run = |seed| {
        let mut s = Sampler::new(sampling(0.9, 40, 0.95, seed)).unwrap();
        let mut previous = vec![3u32];
        for _ in 0..200 {
            let mut l = logits.clone();
            previous.push(s.sample(&mut l, &previous));
        }
        previous
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7), run(8));
}

#[test]
fn empirical_frequencies_match_distributions() {
    let probs = [0.1f64, 0.2, 0.3, 0.4];
    let logits = probs.map(|p| (p as f32).ln());
    let n = 20_000;
    assert_close(
        &frequencies(sampling(1.0, 0, 1.0, 1), &logits, n),
        &probs,
        0.015,
    );
    // top-k 2 and top-p 0.5 both keep {0.3, 0.4}, renormalized to 3/7, 4/7.
    let two = [0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0];
    assert_close(
        &frequencies(sampling(1.0, 2, 1.0, 2), &logits, n),
        &two,
        0.015,
    );
    assert_close(
        &frequencies(sampling(1.0, 0, 0.5, 3), &logits, n),
        &two,
        0.015,
    );
    // Temperature 0.5 squares the probabilities: (1, 4, 9, 16) / 30.
    let squared = [1.0 / 30.0, 4.0 / 30.0, 9.0 / 30.0, 16.0 / 30.0];
    assert_close(
        &frequencies(sampling(0.5, 0, 1.0, 4), &logits, n),
        &squared,
        0.015,
    );
    // Top-p runs on the top-k survivors: top-k 3 leaves (2, 3, 4) / 9, and the ascending
    // cumsum 2/9 <= 1 - 0.7 drops token 1 as well.
    assert_close(
        &frequencies(sampling(1.0, 3, 0.7, 5), &logits, n),
        &two,
        0.015,
    );
}

#[test]
fn large_vocab_sampling_stays_in_the_nucleus() {
    // 49152-token vocab: a few strong tokens, a long flat tail.
    let mut logits = vec![0.0f32; 49_152];
    for (i, id) in [17usize, 4000, 31000, 49151].iter().enumerate() {
        logits[*id] = 12.0 - i as f32;
    }
    let mut sampler = Sampler::new(sampling(0.8, 50, 0.9, 11)).unwrap();
    for _ in 0..50 {
        let mut l = logits.clone();
        let t = sampler.sample(&mut l, &[17, 17, 5]) as usize;
        assert!(
            [17, 4000, 31000, 49151].contains(&t),
            "sampled tail token {t}"
        );
        let mut l = logits.clone();
        let mut full = Sampler::new(sampling(1.0, 0, 0.5, 3)).unwrap();
        assert!([17, 4000, 31000].contains(&(full.sample(&mut l, &[]) as usize)));
    }
}

#[test]
fn log_softmax_is_stable() {
    let mut out = [0.0f32; 3];
    log_softmax(&[1.0, 2.0, 3.0], &mut out);
    let lse = 3.0 + (1.0 + (-1.0f64).exp() + (-2.0f64).exp()).ln(); // 3.4076059644443806
    for (o, x) in out.iter().zip([1.0, 2.0, 3.0]) {
        assert!((f64::from(*o) - (x - lse)).abs() < 1e-6, "{out:?}");
    }
    let mut out = [0.0f32; 3];
    log_softmax(&[1000.0, 1000.0, NEG_INF], &mut out);
    let ln2 = std::f32::consts::LN_2;
    assert_eq!(out, [-ln2, -ln2, NEG_INF]);
    let mut out = [0.0f32; 2];
    log_softmax(&[-1e30, 5.0], &mut out);
    assert_eq!(out[1], 0.0);
}

/// Speculative verification with a point-mass proposal leaves the distribution unchanged: the
/// verified token is distributed as a sampled one, whichever token is proposed.
#[test]
fn verify_keeps_the_sampling_distribution_for_any_proposal() {
    let logits = [2.0f32, 1.0, 0.5, -1.0, 0.0];
    let params = sampling(0.9, 0, 0.95, 11);
    let want = frequencies(params, &logits, 40_000);
    for draft in [0u32, 2, 3] {
        let mut sampler = Sampler::new(params).unwrap();
        let mut counts = vec![0usize; logits.len()];
        for _ in 0..40_000 {
            let mut l = logits.to_vec();
            counts[sampler.verify(&mut l, &[], draft) as usize] += 1;
        }
        let got: Vec<f64> = counts.iter().map(|&c| c as f64 / 40_000.0).collect();
        assert_close(&got, &want, 0.015);
    }
    // Greedy: the arg-max, whatever is proposed.
    let mut greedy = Sampler::new(SamplingParams::greedy()).unwrap();
    assert_eq!(greedy.verify(&mut logits.to_vec(), &[], 3), 0);
}
