//! The MPI backend for real: the test relaunches its own binary under
//! `mpirun --oversubscribe -np 4`, and every process checks the collectives and the process
//! groups against the same expectations as the in-process backend.
#![cfg(feature = "mpi")]

use std::process::Command;
use std::sync::Arc;

use ferrotron_comm::*;

const WORKER: &str = "FERROTRON_MPI_TEST_WORKER";

#[test]
fn collectives_across_four_processes() {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new("mpirun")
        .args(["--oversubscribe", "--allow-run-as-root", "-np", "4"])
        .arg(exe)
        .args(["mpi_worker", "--exact", "--nocapture", "--test-threads=1"])
        .env(WORKER, "1")
        .output()
        .expect("mpirun (Debian: openmpi-bin) must be installed for the mpi feature");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "mpirun failed:\n{text}");
    assert_eq!(text.matches("mpi worker ok").count(), 4, "{text}");
}

/// Runs only inside `mpirun` (one process per rank).
#[test]
fn mpi_worker() {
    if std::env::var_os(WORKER).is_none() {
        return;
    }
    let world = MpiComm::world().unwrap();
    let (r, n) = (world.rank(), world.size());
    assert_eq!(n, 4);
    let mut s: Vec<f32> = (0..7).map(|i| (r + i) as f32).collect();
    world.all_reduce(&mut s, ReduceOp::Sum).unwrap();
    assert_eq!(s, (0..7).map(|i| (6 + 4 * i) as f32).collect::<Vec<_>>());
    let mut a = [r as f64];
    world.all_reduce(&mut a, ReduceOp::Avg).unwrap();
    assert_eq!(a[0], 1.5);
    let mut b = [half::bf16::from_f32(r as f32 + 0.5); 3];
    world.all_reduce(&mut b, ReduceOp::Max).unwrap();
    assert_eq!(b[0].to_f32(), 3.5);
    let mut g: Vec<f32> = (0..8).map(|i| (i * 10 + r) as f32).collect();
    world
        .reduce_scatter_in_place(&mut g, ReduceOp::Sum)
        .unwrap();
    let sum = |i: usize| (0..4).map(|k| (i * 10 + k) as f32).sum::<f32>();
    assert_eq!(g[2 * r..2 * r + 2], [sum(2 * r), sum(2 * r + 1)]);
    let mut gathered = vec![0.0f32; 8];
    world.all_gather(&[r as f32; 2], &mut gathered).unwrap();
    assert_eq!(gathered, vec![0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]);
    let mut root = [r as f32; 2];
    world.broadcast(&mut root, 2).unwrap();
    assert_eq!(root, [2.0, 2.0]);
    let send: Vec<u8> = (0..4).map(|to| (r * 10 + to) as u8).collect();
    let mut recv = vec![0u8; 4];
    world.all_to_all(&send, &mut recv).unwrap();
    assert_eq!(
        recv,
        (0..4).map(|from| (from * 10 + r) as u8).collect::<Vec<_>>()
    );
    // Per-rank sizes: rank s sends s + d + 1 values to rank d.
    let input: Vec<f32> = (0..n)
        .flat_map(|d| (0..r + d + 1).map(move |i| (100 * r + 10 * d + i) as f32))
        .collect();
    let (send_counts, recv_counts): (Vec<usize>, Vec<usize>) =
        (0..n).map(|k| (r + k + 1, k + r + 1)).unzip();
    let mut output = vec![0f32; recv_counts.iter().sum()];
    world
        .all_to_all_v(&input, &send_counts, &mut output, &recv_counts)
        .unwrap();
    let want: Vec<f32> = (0..n)
        .flat_map(|s| (0..s + r + 1).map(move |i| (100 * s + 10 * r + i) as f32))
        .collect();
    assert_eq!(output, want);
    world.send(&[r as f32; 3], (r + 1) % n).unwrap();
    let mut got = [0.0f32; 3];
    world.recv(&mut got, (r + n - 1) % n).unwrap();
    assert_eq!(got, [((r + n - 1) % n) as f32; 3]);
    // Head-on 4 MB messages (past any eager limit): both sides send first, then receive.
    let big = vec![r as f32; 1 << 20];
    let peer = r ^ 1;
    world.send(&big, peer).unwrap();
    let mut back = vec![0.0f32; 1 << 20];
    world.recv(&mut back, peer).unwrap();
    assert!(back.iter().all(|&v| v == peer as f32));
    // tp 2 x dp 2: data-parallel groups {0, 2} and {1, 3}
    let config = ParallelConfig {
        tensor_model_parallel_size: 2,
        ..ParallelConfig::default()
    };
    let state = ParallelState::new(n, r, config).unwrap();
    let groups = ProcessGroups::new(state, Arc::new(world)).unwrap();
    let mut v = [r as f32];
    groups.data.all_reduce(&mut v, ReduceOp::Sum).unwrap();
    assert_eq!(v[0], if r % 2 == 0 { 2.0 } else { 4.0 });
    let async_tp = AsyncComm::new(groups.tensor.clone()).unwrap();
    let h = async_tp.all_reduce(vec![1.0f32; 16], ReduceOp::Sum);
    assert_eq!(h.wait().unwrap(), vec![2.0; 16]);
    groups.world.barrier().unwrap();
    println!("mpi worker ok");
}
