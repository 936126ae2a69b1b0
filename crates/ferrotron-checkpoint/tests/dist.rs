//! The distributed checkpoint format: shards written by several "ranks" read back as whole
//! tensors and as arbitrary boxes (resharding), validation errors, tracker and pruning.

use ferrotron_checkpoint::dist::{
    CheckpointReader, CheckpointWriter, ParallelLayout, ShardedTensor, StoredDtype, iteration_dir,
    list_checkpoints, prune_checkpoints, read_tracker, write_tracker,
};
use serde_json::json;

/// A [6, 4] tensor with values 0..24.
fn matrix() -> Vec<f32> {
    (0..24).map(|i| i as f32).collect()
}

fn rows(data: &[f32], r0: usize, r1: usize, cols: usize) -> Vec<f32> {
    data[r0 * cols..r1 * cols].to_vec()
}

fn cols(data: &[f32], c0: usize, c1: usize, ncols: usize) -> Vec<f32> {
    data.chunks(ncols)
        .flat_map(|r| r[c0..c1].to_vec())
        .collect()
}

fn shard<'a>(key: &str, off: [usize; 2], shape: [usize; 2], data: &'a [f32]) -> ShardedTensor<'a> {
    ShardedTensor {
        key: key.into(),
        global_shape: vec![6, 4],
        global_offset: off.to_vec(),
        local_shape: shape.to_vec(),
        replica_id: 0,
        data,
    }
}

#[test]
fn shards_from_two_ranks_read_back_whole_and_as_any_box() {
    let dir = tempfile::tempdir().unwrap();
    let out = iteration_dir(dir.path(), 7);
    let m = matrix();
    // "Rank 0" holds rows 0..4 of `a` and columns 0..1 of `b`; "rank 1" the rest, plus a
    // replica of the bias that must not be written twice.
    let (a0, a1) = (rows(&m, 0, 4, 4), rows(&m, 4, 6, 4));
    let (b0, b1) = (cols(&m, 0, 1, 4), cols(&m, 1, 4, 4));
    let bias = [1.5f32, -2.0, 3.25];
    let mut w = CheckpointWriter::create(&out, false).unwrap();
    w.write_file(
        "model_rank00000.safetensors",
        StoredDtype::F32,
        &[
            shard("a", [0, 0], [4, 4], &a0),
            shard("b", [0, 0], [6, 1], &b0),
            ShardedTensor::full("bias", &[3], &bias),
        ],
    )
    .unwrap();
    let mut replica = ShardedTensor::full("bias", &[3], &bias);
    replica.replica_id = 1;
    w.write_file(
        "model_rank00001.safetensors",
        StoredDtype::F32,
        &[
            shard("a", [4, 0], [2, 4], &a1),
            shard("b", [0, 1], [6, 3], &b1),
            replica,
        ],
    )
    .unwrap();
    w.commit(7, ParallelLayout::SINGLE, json!({"note": "test"}))
        .unwrap();

    let r = CheckpointReader::open(&out).unwrap();
    assert_eq!(r.metadata().iteration, 7);
    assert_eq!(r.metadata().content["note"], "test");
    assert_eq!(r.metadata().tensors["bias"].shards.len(), 1);
    assert_eq!(r.read("a").unwrap(), m);
    assert_eq!(r.read("b").unwrap(), m);
    assert_eq!(r.read("bias").unwrap(), bias);
    // A box straddling both shards of each tensor (another layout's shard).
    let want: Vec<f32> = rows(&m, 3, 5, 4)
        .chunks(4)
        .flat_map(|r| r[0..3].to_vec())
        .collect();
    assert_eq!(r.read_box("a", &[3, 0], &[2, 3]).unwrap(), want);
    assert_eq!(r.read_box("b", &[3, 0], &[2, 3]).unwrap(), want);
    let err = r.read_box("a", &[5, 0], &[2, 4]).unwrap_err().to_string();
    assert!(err.contains("not inside"), "{err}");
    let err = r.read("nope").unwrap_err().to_string();
    assert!(err.contains("no tensor nope"), "{err}");

    r.check_tensors(
        "",
        &[
            ("a".into(), vec![6, 4]),
            ("b".into(), vec![6, 4]),
            ("bias".into(), vec![3]),
        ],
    )
    .unwrap();
    let err = r
        .check_tensors("", &[("a".into(), vec![4, 6]), ("c".into(), vec![1])])
        .unwrap_err()
        .to_string();
    for part in [
        "missing tensor c",
        "tensor a has shape [6, 4]",
        "unexpected tensor b",
        "unexpected tensor bias",
    ] {
        assert!(err.contains(part), "{err} lacks {part}");
    }
}

#[test]
fn bf16_shards_round_to_bf16() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ckpt");
    let x = [1.0f32, 1.0 + 1.0 / 512.0, -3.0e-3];
    let mut w = CheckpointWriter::create(&out, false).unwrap();
    w.write_file(
        "m.safetensors",
        StoredDtype::BF16,
        &[ShardedTensor::full("x", &[3], &x)],
    )
    .unwrap();
    w.commit(1, ParallelLayout::SINGLE, json!(null)).unwrap();
    let got = CheckpointReader::open(&out).unwrap().read("x").unwrap();
    let want: Vec<f32> = x
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    assert_eq!(got, want);
}

#[test]
fn incomplete_or_overlapping_shards_are_refused_and_leave_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("iter_0000001");
    let m = matrix();
    let a0 = rows(&m, 0, 4, 4);
    let mut w = CheckpointWriter::create(&out, false).unwrap();
    w.write_file(
        "f.safetensors",
        StoredDtype::F32,
        &[shard("a", [0, 0], [4, 4], &a0)],
    )
    .unwrap();
    let err = w
        .commit(1, ParallelLayout::SINGLE, json!(null))
        .unwrap_err()
        .to_string();
    assert!(err.contains("cover 16 of 24"), "{err}");
    assert!(!out.exists());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "staging dir left"
    );

    let mut w = CheckpointWriter::create(&out, false).unwrap();
    let a1 = rows(&m, 2, 6, 4);
    w.write_file(
        "f.safetensors",
        StoredDtype::F32,
        &[
            shard("a", [0, 0], [4, 4], &a0),
            shard("a", [2, 0], [4, 4], &a1),
        ],
    )
    .unwrap();
    let err = w
        .commit(1, ParallelLayout::SINGLE, json!(null))
        .unwrap_err()
        .to_string();
    assert!(err.contains("overlap"), "{err}");

    let mut w = CheckpointWriter::create(&out, false).unwrap();
    let err = w
        .write_file(
            "f.safetensors",
            StoredDtype::F32,
            &[shard("a", [0, 0], [4, 4], &m)],
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("24 values for local shape [4, 4]"), "{err}");
}

#[test]
fn damaged_or_foreign_checkpoints_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("c");
    let mut w = CheckpointWriter::create(&out, false).unwrap();
    w.write_file(
        "f.safetensors",
        StoredDtype::F32,
        &[ShardedTensor::full("x", &[2], &[1.0, 2.0])],
    )
    .unwrap();
    w.commit(3, ParallelLayout::SINGLE, json!(null)).unwrap();
    let meta = out.join("metadata.json");
    let text = std::fs::read_to_string(&meta).unwrap();
    std::fs::write(
        &meta,
        text.replace("\"format_version\": 1", "\"format_version\": 99"),
    )
    .unwrap();
    let err = CheckpointReader::open(&out).err().unwrap().to_string();
    assert!(err.contains("format_version 99"), "{err}");
    std::fs::write(&meta, &text).unwrap();
    std::fs::remove_file(out.join("f.safetensors")).unwrap();
    let err = CheckpointReader::open(&out).err().unwrap().to_string();
    assert!(err.contains("f.safetensors"), "{err}");
    std::fs::remove_file(&meta).unwrap();
    let err = CheckpointReader::open(&out).err().unwrap().to_string();
    assert!(err.contains("metadata.json"), "{err}");
}

#[test]
fn tracker_and_pruning_keep_the_newest() {
    let dir = tempfile::tempdir().unwrap();
    let save = dir.path();
    assert_eq!(read_tracker(save).unwrap(), None);
    for it in [10u64, 20, 30, 40] {
        let mut w = CheckpointWriter::create(&iteration_dir(save, it), false).unwrap();
        w.write_file(
            "f.safetensors",
            StoredDtype::F32,
            &[ShardedTensor::full("x", &[1], &[it as f32])],
        )
        .unwrap();
        w.commit(it, ParallelLayout::SINGLE, json!(null)).unwrap();
        write_tracker(save, it).unwrap();
    }
    // An incomplete directory (no metadata.json) is not a checkpoint.
    std::fs::create_dir(iteration_dir(save, 50)).unwrap();
    assert_eq!(read_tracker(save).unwrap(), Some(40));
    assert_eq!(list_checkpoints(save).unwrap(), vec![10, 20, 30, 40]);
    assert_eq!(prune_checkpoints(save, 2).unwrap(), vec![10, 20]);
    assert_eq!(list_checkpoints(save).unwrap(), vec![30, 40]);
    assert_eq!(prune_checkpoints(save, 0).unwrap(), Vec::<u64>::new());
    std::fs::write(save.join("latest_checkpointed_iteration.txt"), "release\n").unwrap();
    let err = read_tracker(save).unwrap_err().to_string();
    assert!(err.contains("`release`"), "{err}");
}
