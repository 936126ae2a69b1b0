//! Every collective of the in-process backend, its errors, and failure propagation.

use std::sync::Arc;

use ferrotron_comm::*;
use half::bf16;

fn ranks<T: Send>(n: usize, f: impl Fn(LocalComm) -> Result<T> + Sync) -> Vec<T> {
    run_local(n, f).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn all_reduce_every_op_and_type() {
    for n in 1..=4 {
        let out = ranks(n, |c| {
            let r = c.rank() as f32;
            // 7 elements: parts of unequal length
            let mut s: Vec<f32> = (0..7).map(|i| r + i as f32).collect();
            c.all_reduce(&mut s, ReduceOp::Sum)?;
            let mut a = vec![r; 3];
            c.all_reduce(&mut a, ReduceOp::Avg)?;
            let mut mx = vec![r, -r];
            c.all_reduce(&mut mx, ReduceOp::Max)?;
            let mut mn = vec![r as f64, -(r as f64)];
            c.all_reduce(&mut mn, ReduceOp::Min)?;
            let mut b = vec![bf16::from_f32(r + 0.5); 5];
            c.all_reduce(&mut b, ReduceOp::Sum)?;
            Ok((s, a, mx, mn, b))
        });
        let rs: f32 = (0..n).map(|r| r as f32).sum();
        let top = (n - 1) as f32;
        for (s, a, mx, mn, b) in out {
            let want: Vec<f32> = (0..7).map(|i| rs + (n * i) as f32).collect();
            assert_eq!(s, want);
            assert_eq!(a, vec![rs / n as f32; 3]);
            assert_eq!(mx, vec![top, 0.0]);
            assert_eq!(mn, vec![0.0, -(top as f64)]);
            assert_eq!(b, vec![bf16::from_f32(rs + 0.5 * n as f32); 5]);
        }
    }
}

#[test]
fn nan_wins_max() {
    let out = ranks(3, |c| {
        let mut v = vec![if c.rank() == 1 { f32::NAN } else { 1.0 }];
        c.all_reduce(&mut v, ReduceOp::Max)?;
        Ok(v[0])
    });
    assert!(out.iter().all(|v| v.is_nan()));
}

#[test]
fn reduce_scatter_all_gather_broadcast_all_to_all() {
    let n = 4;
    let out = ranks(n, |c| {
        let r = c.rank();
        // reduce-scatter in place: chunk r holds the sum of chunk r over ranks
        let mut g: Vec<f32> = (0..8).map(|i| (i * 10 + r) as f32).collect();
        c.reduce_scatter_in_place(&mut g, ReduceOp::Sum)?;
        let mine = g[2 * r..2 * r + 2].to_vec();
        let mut out = vec![0.0f32; 2];
        let input: Vec<f32> = (0..8).map(|i| (i * 10 + r) as f32).collect();
        c.reduce_scatter(&input, &mut out, ReduceOp::Sum)?;
        assert_eq!(out, mine);
        // all-gather: everyone ends with every rank's part
        let mut gathered = vec![0.0f32; 3 * n];
        c.all_gather(&[r as f32; 3], &mut gathered)?;
        let mut root_buf = vec![r as f64; 2];
        c.broadcast(&mut root_buf, 2)?;
        let send: Vec<u8> = (0..n).map(|to| (r * 10 + to) as u8).collect();
        let mut recv = vec![0u8; n];
        c.all_to_all(&send, &mut recv)?;
        c.barrier()?;
        Ok((mine, gathered, root_buf, recv))
    });
    for (r, (mine, gathered, root_buf, recv)) in out.into_iter().enumerate() {
        let sum = |i: usize| (0..n).map(|k| (i * 10 + k) as f32).sum::<f32>();
        assert_eq!(mine, vec![sum(2 * r), sum(2 * r + 1)]);
        let want: Vec<f32> = (0..n).flat_map(|k| [k as f32; 3]).collect();
        assert_eq!(gathered, want);
        assert_eq!(root_buf, vec![2.0; 2]);
        let want: Vec<u8> = (0..n).map(|from| (from * 10 + r) as u8).collect();
        assert_eq!(recv, want);
    }
}

#[test]
fn send_recv_ring_in_order() {
    let out = ranks(3, |c| {
        let (r, n) = (c.rank(), c.size());
        for k in 0..3 {
            c.send(&[(r * 100 + k) as f32; 4], (r + 1) % n)?;
        }
        let mut got = Vec::new();
        for _ in 0..3 {
            let mut b = [0.0f32; 4];
            c.recv(&mut b, (r + n - 1) % n)?;
            got.push(b[0]);
        }
        Ok(got)
    });
    assert_eq!(out[0], vec![200.0, 201.0, 202.0]);
    assert_eq!(out[1], vec![0.0, 1.0, 2.0]);
}

#[test]
fn split_makes_independent_groups() {
    let out = ranks(4, |c| {
        let r = c.rank();
        let even = c.split(Some(r % 2), r)?.unwrap();
        let none = c.split(if r == 3 { Some(0) } else { None }, 0)?;
        let mut v = [r as f32];
        even.all_reduce(&mut v, ReduceOp::Sum)?;
        Ok((even.rank(), even.size(), v[0], none.map(|g| g.size())))
    });
    assert_eq!(out[0], (0, 2, 2.0, None));
    assert_eq!(out[1], (0, 2, 4.0, None));
    assert_eq!(out[2], (1, 2, 2.0, None));
    assert_eq!(out[3], (1, 2, 4.0, Some(1)));
}

#[test]
fn process_groups_follow_the_grid() {
    let out = ranks(8, |c| {
        let config = ParallelConfig {
            tensor_model_parallel_size: 2,
            pipeline_model_parallel_size: 2,
            ..ParallelConfig::default()
        };
        let state = ParallelState::new(8, c.world_rank(), config)?;
        let g = ProcessGroups::new(state, Arc::new(c))?;
        let who = |comm: &Arc<dyn Communicator>| -> Result<Vec<f32>> {
            let mut all = vec![0.0; comm.size()];
            comm.all_gather(&[g.state.rank() as f32], &mut all)?;
            Ok(all)
        };
        Ok((
            who(&g.tensor)?,
            who(&g.data)?,
            who(&g.pipeline)?,
            g.embedding.is_some(),
        ))
    });
    // rank 5: tp rank 1, dp rank 0, pp stage 1 (tp-cp-dp-pp: 5 = 1 + 2·(0 + 2·1))
    assert_eq!(out[5].0, vec![4.0, 5.0]);
    assert_eq!(out[5].1, vec![5.0, 7.0]);
    assert_eq!(out[5].2, vec![1.0, 5.0]);
    assert!(
        out.iter().all(|o| o.3),
        "pp = 2: every stage is first or last"
    );
}

#[test]
fn mismatched_calls_fail_on_every_rank() {
    let err = run_local(2, |c| {
        let mut v = vec![0.0f32; 2 + c.rank()];
        c.all_reduce(&mut v, ReduceOp::Sum)
    })
    .unwrap_err();
    assert!(err.to_string().contains("different lengths"), "{err}");
    let err = run_local(2, |c| {
        let mut v = vec![0.0f32; 2];
        let op = if c.rank() == 0 {
            ReduceOp::Sum
        } else {
            ReduceOp::Max
        };
        c.all_reduce(&mut v, op)
    })
    .unwrap_err();
    assert!(err.to_string().contains("ranks disagree"), "{err}");
    let err = run_local(2, |c| c.send(&[1.0f32], 5)).unwrap_err();
    assert!(
        err.to_string().contains("rank 5 is not in a group of 2"),
        "{err}"
    );
}

/// A failing rank stops the others waiting in a collective or a receive; the job reports
/// the failing rank's own error.
#[test]
fn a_failing_rank_stops_the_job() {
    #[derive(Debug)]
    struct Boom;
    impl std::fmt::Display for Boom {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "data file missing")
        }
    }
    let err = run_local(3, |c| -> std::result::Result<(), String> {
        match c.rank() {
            1 => Err(Boom.to_string()),
            0 => {
                let mut b = [0.0f32];
                c.recv(&mut b, 1).map_err(|e| e.to_string())
            }
            _ => c.barrier().map_err(|e| e.to_string()),
        }
    })
    .unwrap_err();
    assert_eq!(err.rank, 1);
    assert_eq!(err.to_string(), "rank 1: data file missing");

    let err = run_local(2, |c| -> Result<()> {
        if c.rank() == 0 {
            panic!("index out of range in rank 0");
        }
        let mut v = [1.0f32];
        c.all_reduce(&mut v, ReduceOp::Sum)
    })
    .unwrap_err();
    assert_eq!(err.rank, 0);
    assert!(matches!(err.cause, FailureCause::Panic(ref m) if m.contains("index out of range")));
}

#[test]
fn async_calls_complete_in_order() {
    let out = ranks(2, |c| {
        let a = AsyncComm::new(Arc::new(c))?;
        let r = a.comm().rank() as f32;
        let h1 = a.all_reduce(vec![r; 1000], ReduceOp::Sum);
        let h2 = a.reduce_scatter_in_place(vec![r + 1.0; 4], ReduceOp::Sum);
        let h3 = a.all_gather_in_place(vec![r; 2]);
        Ok((h1.wait()?[999], h2.wait()?, h3.wait()?))
    });
    assert_eq!(out[0].0, 1.0);
    assert_eq!(out[0].1[..2], [3.0, 3.0]);
    assert_eq!(out[1].1[2..], [3.0, 3.0]);
    assert_eq!(out[1].2, vec![0.0, 1.0]);
}

/// A rank that fails while the others wait in a rendezvous of a different group must not
/// let a late arriver complete it: every survivor stops with the failure, none hangs.
#[test]
fn abort_during_a_partial_rendezvous_releases_everyone() {
    for _ in 0..20 {
        let err = run_local(3, |c| -> Result<()> {
            let pair = c.split(Some(usize::from(c.rank() == 2)), c.rank())?;
            match c.rank() {
                // rank 0 waits in the pair's barrier; rank 1 arrives late; rank 2 fails
                0 => pair.unwrap().barrier(),
                1 => {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                    pair.unwrap().barrier()
                }
                _ => Err(CommError::Mpi("rank 2 failed".into())),
            }
        })
        .unwrap_err();
        assert_eq!(err.rank, 2, "{err}");
    }
}

/// `all_to_all_v`: rank `s` sends `s + d + 1` elements to rank `d` (unequal parts, one empty
/// when asked), each element naming its source, destination and index; a count that does not
/// match what the peer sends, or counts that do not add up to a buffer, fail on every rank.
#[test]
fn all_to_all_with_per_rank_sizes() {
    let count = |s: usize, d: usize| if (s, d) == (1, 0) { 0 } else { s + d + 1 };
    let value = |s: usize, d: usize, i: usize| (100 * s + 10 * d + i) as f32;
    for n in 1..=4 {
        let out = ranks(n, |c| {
            let me = c.rank();
            let send_counts: Vec<usize> = (0..n).map(|d| count(me, d)).collect();
            let recv_counts: Vec<usize> = (0..n).map(|s| count(s, me)).collect();
            let input: Vec<f32> = (0..n)
                .flat_map(|d| (0..count(me, d)).map(move |i| value(me, d, i)))
                .collect();
            let mut output = vec![-1f32; recv_counts.iter().sum()];
            c.all_to_all_v(&input, &send_counts, &mut output, &recv_counts)?;
            Ok(output)
        });
        for (me, got) in out.into_iter().enumerate() {
            let want: Vec<f32> = (0..n)
                .flat_map(|s| (0..count(s, me)).map(move |i| value(s, me, i)))
                .collect();
            assert_eq!(got, want, "rank {me} of {n}");
        }
    }
    // Rank 0 expects one element too many from rank 1: every rank fails, rank 0 names it.
    let err = run_local(2, |c| {
        let recv = if c.rank() == 0 { [1, 3] } else { [1, 1] };
        let mut out = vec![0f32; recv.iter().sum()];
        c.all_to_all_v(&[0f32; 2], &[1, 1], &mut out, &recv)
    })
    .unwrap_err();
    // Whichever rank's failure is reported first: the one that saw the mismatch names it,
    // the other names that rank.
    let e = err.to_string();
    assert!(
        e.contains("rank 0 expects 3 elements from rank 1, which sends 1")
            || e.contains("rank 0's counts are wrong"),
        "{e}"
    );
    let err = run_local(3, |c| {
        let send = if c.rank() == 2 {
            vec![1, 1]
        } else {
            vec![1, 1, 1]
        };
        let mut out = vec![0f32; 3];
        c.all_to_all_v(&[0f32; 3], &send, &mut out, &[1, 1, 1])
    })
    .unwrap_err();
    assert!(
        err.to_string().contains("send_counts [1, 1]")
            || err.to_string().contains("rank 2's counts are wrong"),
        "{err}"
    );
}
