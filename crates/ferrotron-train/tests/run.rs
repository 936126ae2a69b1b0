//! `ferrotron_train::run` as a library user drives it, without the CLI: a `RunConfig` over
//! the tiny LLaMA fixture and a generated corpus, trained on one rank and on two in-process
//! data-parallel ranks (the same losses), with the notes a run reports and the HF export of
//! the trained model.

use ferrotron_comm::{ParallelConfig, ParallelState, ProcessGroups, SingleRankComm, run_local};
use ferrotron_data::indexed::{IndexedDatasetBuilder, TokenDtype};
use ferrotron_train::config::RunConfig;
use ferrotron_train::run::{Run, RunError, RunNote};
use ferrotron_train::trainer::{TrainLog, TrainSummary};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// 200 documents of pseudo-random tokens in 3..112 (the fixture's vocabulary), each closed
/// by the fixture's end-of-document id 2; returns the prefix.
fn corpus(dir: &Path) -> PathBuf {
    let prefix = dir.join("corpus_text_document");
    let mut b = IndexedDatasetBuilder::create(&prefix, TokenDtype::U16).unwrap();
    let mut x = 12345u64;
    for _ in 0..200 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let len = 20 + (x >> 33) as usize % 40;
        let doc: Vec<u32> = (0..len)
            .map(|i| 3 + ((x >> 20) as usize + i * (i + 7)) as u32 % 109)
            .chain([2])
            .collect();
        b.add_item(&doc).unwrap();
        b.end_document();
    }
    b.finalize().unwrap();
    prefix
}

fn config(dir: &Path, out: &str, sets: &[&str]) -> RunConfig {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-llama");
    let text = format!(
        "[model]\nload = {:?}\nseq_length = 16\n\
         [data]\ndata_path = {:?}\nsplit = \"90,10,0\"\ndata_cache_path = {:?}\n\
         eod_mask_loss = true\n\
         [training]\nmicro_batch_size = 1\nglobal_batch_size = 4\ntrain_iters = 4\n\
         log_interval = 1\neval_interval = 2\neval_iters = 1\n\
         [optimizer]\nlr = 3e-3\nmin_lr = 3e-4\nlr_warmup_iters = 1\n\
         [checkpoint]\nexport_hf = {:?}\n\
         [logging]\noutput_dir = {:?}\ntensorboard = false\n",
        model,
        corpus(dir),
        dir.join("cache"),
        dir.join(format!("{out}-hf")),
        dir.join(out),
    );
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    RunConfig::from_toml_str(&text, &sets).unwrap()
}

/// What one rank's run gave: its summary, its (is a training line, loss) reports, the
/// TFLOP/s · ms of each training line (teraflops per iteration and rank) and its notes.
type RankRun = (TrainSummary, Vec<(bool, f64)>, Vec<f64>, Vec<RunNote>);

/// One rank's whole run.
fn run_rank(rc: &RunConfig, groups: &ProcessGroups) -> Result<RankRun, RunError> {
    let mut notes = Vec::new();
    let mut sink = |n: &RunNote| notes.push(n.clone());
    let mut run = Run::setup(rc, groups, &mut sink)?;
    let mut losses = Vec::new();
    let mut work = Vec::new();
    let summary = run.train(&mut |log: &TrainLog| match log {
        TrainLog::Train(l) => {
            losses.push((true, l.lm_loss));
            work.push(l.tflops * l.elapsed_ms_per_iteration);
        }
        TrainLog::Valid(l) => losses.push((false, l.lm_loss)),
        TrainLog::Saved(_) => {}
    })?;
    run.finish(&summary, &mut sink)?;
    Ok((summary, losses, work, notes))
}

#[test]
fn a_library_run_trains_validates_and_exports() {
    let tmp = tempfile::tempdir().unwrap();
    let rc = config(tmp.path(), "one", &[]);
    let groups = ProcessGroups::new(ParallelState::single(), Arc::new(SingleRankComm)).unwrap();
    let (summary, want, one_work, notes) = run_rank(&rc, &groups).unwrap();
    assert_eq!(summary.iterations, 4);
    assert_eq!(want.iter().filter(|l| !l.0).count(), 2, "{want:?}");
    assert!(matches!(notes.last(), Some(RunNote::Exported { tensors, .. }) if *tensors > 0));
    assert!(notes.iter().any(|n| matches!(n, RunNote::Done { .. })));
    assert!(tmp.path().join("one-hf/model.safetensors").is_file());
    assert!(tmp.path().join("one/metrics.jsonl").is_file());

    // dp 2 in-process: the same losses; only world rank 0 hears how the run ended.
    let rc = config(tmp.path(), "dp2", &["parallel.data_parallel_size=2"]);
    let runs = run_local(2, |comm| {
        let state = ParallelState::new(2, comm.world_rank(), ParallelConfig::default())?;
        let groups = ProcessGroups::new(state, Arc::new(comm))?;
        run_rank(&rc, &groups)
    })
    .unwrap_or_else(|e| panic!("{e}"));
    for (rank, (_, got, work, notes)) in runs.iter().enumerate() {
        // `throughput per GPU` divides the job's FLOPs by the world size, as Megatron's.
        for (w2, w1) in work.iter().zip(&one_work) {
            assert!(
                (2.0 * w2 - w1).abs() <= 1e-9 * w1,
                "rank {rank}: {work:?} vs {one_work:?}"
            );
        }
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.0, w.0);
            assert!(
                (g.1 - w.1).abs() <= 1e-5 * w.1,
                "rank {rank}: {got:?} vs {want:?}"
            );
        }
        let done = notes.iter().any(|n| matches!(n, RunNote::Done { .. }));
        assert_eq!(done, rank == 0, "rank {rank}: {notes:?}");
    }
}

#[test]
fn a_layout_the_model_does_not_split_into_names_its_key() {
    let tmp = tempfile::tempdir().unwrap();
    // the fixture has 2 query groups
    let rc = config(
        tmp.path(),
        "tp4",
        &["parallel.tensor_model_parallel_size=4"],
    );
    let err = run_local(4, |comm| {
        let config = ParallelConfig {
            tensor_model_parallel_size: 4,
            ..ParallelConfig::default()
        };
        let state = ParallelState::new(4, comm.world_rank(), config)?;
        let groups = ProcessGroups::new(state, Arc::new(comm))?;
        run_rank(&rc, &groups).map(|_| ())
    })
    .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("[parallel] tensor_model_parallel_size:")
            && text.contains("num_query_groups"),
        "{text}"
    );
}

/// A LoRA run under tp 2: the losses fall, the adapters come out as a PEFT directory and
/// merged into the HF export, and the two agree: the PEFT adapter read onto the base and
/// merged is the exported model, weight for weight.
#[test]
fn a_lora_run_exports_its_adapters_and_the_merged_model() {
    use ferrotron_checkpoint::PeftAdapter;
    use ferrotron_model::families::load_hf_model;
    let tmp = tempfile::tempdir().unwrap();
    let peft = tmp.path().join("adapter");
    let peft_set = format!("checkpoint.export_peft={peft:?}");
    let sets = [
        "lora.enabled=true",
        "lora.rank=4",
        "lora.alpha=8",
        "optimizer.lr=3e-2",
        "parallel.tensor_model_parallel_size=2",
        peft_set.as_str(),
    ];
    let rc = config(tmp.path(), "lora", &sets);
    let runs = run_local(2, |comm| {
        let config = ParallelConfig {
            tensor_model_parallel_size: 2,
            ..ParallelConfig::default()
        };
        let state = ParallelState::new(2, comm.world_rank(), config)?;
        let groups = ProcessGroups::new(state, Arc::new(comm))?;
        run_rank(&rc, &groups)
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let (_, losses, _, notes) = &runs[0];
    let train: Vec<f64> = losses.iter().filter(|l| l.0).map(|l| l.1).collect();
    assert!(train.last() < train.first(), "{train:?}");
    assert!(
        notes
            .iter()
            .any(|n| matches!(n, RunNote::ExportedAdapter { .. }))
    );
    assert!(notes.iter().any(|n| matches!(n, RunNote::Exported { .. })));
    let base_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-llama");
    let (base, _) = load_hf_model(&base_dir, ferrotron_tensor::DType::F32).unwrap();
    let adapted = PeftAdapter::read(&peft)
        .unwrap()
        .apply_to(base.clone())
        .unwrap();
    let merged = adapted.merge_lora().unwrap();
    let (exported, _) =
        load_hf_model(&tmp.path().join("lora-hf"), ferrotron_tensor::DType::F32).unwrap();
    let mut changed = 0;
    for i in 0..merged.parameters().len() {
        let (m, e) = (
            merged.parameter_f32(i).unwrap(),
            exported.parameter_f32(i).unwrap(),
        );
        assert_eq!(m, e, "{}", merged.parameters()[i].name);
        changed += usize::from(m != base.parameter_f32(i).unwrap());
    }
    assert_eq!(
        changed,
        2 * 4,
        "every linear weight of both layers took its adapter"
    );
}

#[test]
fn lora_keys_are_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let text = "[model]\nnum_layers = 2\nhidden_size = 8\nnum_attention_heads = 2\n\
                vocab_size = 16\nseq_length = 8\n[data]\ndata_path = \"x\"\n\
                [training]\ntrain_iters = 1\n[optimizer]\nlr = 1e-3\n\
                [lora]\nenabled = true\nrank = 0\ntarget_modules = [\"q_proj\"]\n";
    let err = RunConfig::from_toml_str(text, &[]).unwrap_err().to_string();
    assert!(err.contains("lora.enabled needs model.load"), "{err}");
    assert!(err.contains("`q_proj` is not a linear layer"), "{err}");
    let peft = format!("checkpoint.export_peft={:?}", tmp.path());
    let err = RunConfig::from_toml_str(&text.replace("enabled = true", "enabled = false"), &[peft])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("checkpoint.export_peft needs a LoRA run"),
        "{err}"
    );
}
