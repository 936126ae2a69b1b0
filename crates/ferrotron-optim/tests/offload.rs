//! Optimizer offload with chunks: every placement trains bit-identically to the state kept in
//! RAM — static fractions 0, 0.5 and 1 (chunks of 7 elements: tensors split across chunks,
//! pieces of several tensors in one), the auto policy moving chunks between steps as its
//! budget changes, a distributed optimizer's shard, fp32 and bf16 (with master weights) —
//! and its checkpoint state (exported from the file) resumes exactly; bytes moved per step
//! are counted; a bad offload directory, or one too small, is named before any step.

use ferrotron_optim::offload::{ChunkLayout, OffloadConfig, OffloadPolicy, Tier, chunks_in_budget};
use ferrotron_optim::*;

fn build(precision: Precision) -> (ParamAndGradBuffer, Vec<ParamId>) {
    let mut b = ParamAndGradBufferBuilder::new(BufferConfig::new(precision.param_dtype(), 1));
    let ids = vec![
        b.register_auto("emb.weight", &[16, 8]).unwrap(),
        b.register_auto("norm.weight", &[8]).unwrap(),
        b.register_auto("layer.weight", &[12, 5]).unwrap(),
        b.register_auto("out.weight", &[8, 16]).unwrap(),
    ];
    let mut buf = b.build().unwrap();
    for &id in &ids {
        let v: Vec<f32> = (0..buf.info(id).numel)
            .map(|i| ((i * 7 + id.0 * 3) % 23) as f32 / 23.0 - 0.5)
            .collect();
        buf.set_param_from_f32(id, &v).unwrap();
    }
    (buf, ids)
}

fn set_grads(buf: &mut ParamAndGradBuffer, ids: &[ParamId], step: usize) {
    buf.zero_grad();
    for &id in ids {
        for (i, g) in buf.grad_mut(id).iter_mut().enumerate() {
            *g = (((i * 5 + 3 * step + id.0) % 13) as f32 - 6.0) * 0.01;
        }
    }
}

fn offloaded(policy: OffloadPolicy, dir: &std::path::Path) -> OffloadConfig {
    OffloadConfig {
        policy,
        path: Some(dir.to_path_buf()),
        chunk_size: Some(7),
    }
}

/// Params and the three state arrays after `steps` steps; `between(step, adam)` runs before
/// each step.
fn run(
    precision: Precision,
    offload: OffloadConfig,
    owned: Option<Vec<std::ops::Range<usize>>>,
    steps: usize,
    mut between: impl FnMut(usize, &mut AdamW),
) -> (Vec<f32>, [Vec<f32>; 3]) {
    let (mut buf, ids) = build(precision);
    let mut cfg = OptimizerConfig::new(precision);
    cfg.offload = offload;
    #[allow(clippy::single_range_in_vec_init)] // one owned range: the whole buffer
    let owned = owned.unwrap_or(vec![0..buf.numel()]);
    let mut opt = Optimizer::new_sharded(cfg, &buf, owned).unwrap();
    for step in 0..steps {
        between(step, opt.adam_mut());
        set_grads(&mut buf, &ids, step);
        assert!(opt.step(&mut buf, 1e-2, 0.1).unwrap().update_successful);
    }
    let a = opt.adam();
    let state = [
        a.exp_avg().unwrap(),
        a.exp_avg_sq().unwrap(),
        a.master_weights().unwrap().unwrap_or_default(),
    ];
    (buf.param_storage().to_f32_range(0..buf.numel()), state)
}

#[test]
fn every_placement_trains_bit_identically() {
    let dir = tempfile::tempdir().unwrap();
    for precision in [Precision::Fp32, Precision::Bf16] {
        let want = run(precision, OffloadConfig::default(), None, 5, |_, _| {});
        for fraction in [0.0, 0.5, 1.0] {
            let offload = offloaded(OffloadPolicy::Static { fraction }, dir.path());
            let got = run(precision, offload, None, 5, |_, adam| {
                let n = adam.chunks().layout().chunks().len();
                let slow = (0..n)
                    .filter(|&k| adam.chunks().tier(k) == Tier::Slow)
                    .count();
                assert_eq!(slow, (fraction * n as f64).ceil() as usize);
            });
            assert!(got == want, "{precision:?} static {fraction}");
        }
        // The auto policy's placement moving every step: all fast, half, all slow, ...
        let auto = offloaded(OffloadPolicy::Auto { budget_bytes: 0 }, dir.path());
        let got = run(precision, auto, None, 5, |step, adam| {
            let n = adam.chunks().layout().chunks().len();
            adam.place_chunks([0, n / 2, n, 1, n - 1][step]).unwrap();
        });
        assert!(got == want, "{precision:?} auto");
    }
}

#[test]
fn a_distributed_optimizer_shard_offloads_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (buf, _) = build(Precision::Bf16);
    let n = buf.numel();
    let owned = vec![3..n / 3, n / 2..n - 5];
    let want = run(
        Precision::Bf16,
        OffloadConfig::default(),
        Some(owned.clone()),
        4,
        |_, _| {},
    );
    let offload = offloaded(OffloadPolicy::Static { fraction: 0.6 }, dir.path());
    let got = run(Precision::Bf16, offload, Some(owned), 4, |_, _| {});
    assert!(got == want);
}

#[test]
fn offloaded_state_resumes_and_counts_its_moves() {
    let dir = tempfile::tempdir().unwrap();
    let precision = Precision::Bf16;
    let want = run(precision, OffloadConfig::default(), None, 6, |_, _| {});
    let (mut buf, ids) = build(precision);
    let mut cfg = OptimizerConfig::new(precision);
    cfg.offload = offloaded(OffloadPolicy::Static { fraction: 1.0 }, dir.path());
    let mut opt = Optimizer::new(cfg.clone(), &buf).unwrap();
    opt.adam_mut().take_moved_bytes();
    for step in 0..3 {
        set_grads(&mut buf, &ids, step);
        opt.step(&mut buf, 1e-2, 0.1).unwrap();
        // Every chunk read and written once per step: 2 x the state's bytes.
        let state = opt.adam().offloaded_bytes();
        assert_eq!(opt.adam_mut().take_moved_bytes(), 2 * state, "step {step}");
        assert_eq!(opt.adam().state_bytes(), 0);
    }
    let saved = opt.export_state().unwrap();
    let mut resumed = Optimizer::new(cfg, &buf).unwrap();
    resumed.import_state(saved).unwrap();
    for step in 3..6 {
        set_grads(&mut buf, &ids, step);
        resumed.step(&mut buf, 1e-2, 0.1).unwrap();
    }
    let a = resumed.adam();
    let got = (
        buf.param_storage().to_f32_range(0..buf.numel()),
        [
            a.exp_avg().unwrap(),
            a.exp_avg_sq().unwrap(),
            a.master_weights().unwrap().unwrap(),
        ],
    );
    assert!(got == want);
}

#[test]
fn the_auto_policy_keeps_the_last_chunks_that_fit() {
    let chunks = [100, 100, 100, 50];
    assert_eq!(chunks_in_budget(&chunks, 1000, 700), 1); // 300 left: 50 + 100 + 100
    assert_eq!(chunks_in_budget(&chunks, 1000, 0), 0);
    assert_eq!(chunks_in_budget(&chunks, 1000, 990), 4);
    assert_eq!(chunks_in_budget(&chunks, 100, 500), 4);
    let layout = ChunkLayout::pack(&[3, 4, 2], 5);
    assert_eq!(layout.chunks().len(), 3);
}

#[test]
fn bad_offload_directories_are_named() {
    let (buf, _) = build(Precision::Fp32);
    let file = tempfile::NamedTempFile::new().unwrap();
    let mut cfg = OptimizerConfig::new(Precision::Fp32);
    cfg.offload = offloaded(OffloadPolicy::Static { fraction: 1.0 }, file.path());
    let err = Optimizer::new(cfg.clone(), &buf).unwrap_err().to_string();
    assert!(
        err.contains("offload_path") && err.contains("is not a directory"),
        "{err}"
    );
    // Chunks of 2^40 elements: more than any disk holds.
    let dir = tempfile::tempdir().unwrap();
    cfg.offload = offloaded(OffloadPolicy::Static { fraction: 1.0 }, dir.path());
    cfg.offload.chunk_size = Some(1 << 40);
    let err = Optimizer::new(cfg.clone(), &buf).unwrap_err().to_string();
    assert!(
        err.contains("GiB free, the offloaded optimizer state needs"),
        "{err}"
    );
    cfg.offload.path = None;
    let err = Optimizer::new(cfg.clone(), &buf).unwrap_err().to_string();
    assert!(err.contains("offload_path is required"), "{err}");
    cfg.offload.policy = OffloadPolicy::Static { fraction: 1.5 };
    let err = Optimizer::new(cfg, &buf).unwrap_err().to_string();
    assert!(
        err.contains("optimizer_offload_fraction must be in [0, 1]"),
        "{err}"
    );
}
