//! ParamAndGradBuffer layout: Megatron's padding, bucket boundaries, order, slice access.

use ferrotron_optim::*;
use ferrotron_tensor::DType;
use half::bf16;

fn four_params(config: BufferConfig) -> ParamAndGradBuffer {
    let mut b = ParamAndGradBufferBuilder::new(config);
    b.register_auto("a.weight", &[10, 17]).unwrap(); // 170
    b.register_auto("b.bias", &[5]).unwrap(); // 5
    b.register_auto("c.weight", &[100, 3]).unwrap(); // 300
    b.register_auto("d.norm", &[7]).unwrap(); // 7
    b.build().unwrap()
}

fn offsets(buf: &ParamAndGradBuffer) -> Vec<(usize, usize)> {
    buf.params()
        .iter()
        .map(|p| (p.offset, p.bucket_id.expect("not frozen")))
        .collect()
}

#[test]
fn megatron_padding_and_buckets_reverse_order() {
    let mut cfg = BufferConfig::new(DType::BF16, 2);
    cfg.bucket_size = Some(300);
    let buf = four_params(cfg);
    // Reverse order d, c, b, a. Param starts padded to 64; a bucket closes once it holds
    // >= 300 elements; bucket ends padded to lcm(dp=2, 128) = 128.
    // d 0..7 | c 64..364 -> bucket 0 closes at 364, padded to 384
    // b 384..389 | a 448..618 -> bucket 1 closes at 618 (234 elements), padded to 640.
    assert_eq!(offsets(&buf), vec![(448, 1), (384, 1), (64, 0), (0, 0)]);
    let b = buf.buckets();
    assert_eq!(b.len(), 2);
    assert_eq!((b[0].start, b[0].end, b[0].numel_unpadded), (0, 384, 364));
    assert_eq!((b[1].start, b[1].end, b[1].numel_unpadded), (384, 640, 234));
    assert_eq!(b[0].params, vec![ParamId(3), ParamId(2)]);
    assert_eq!(b[1].params, vec![ParamId(1), ParamId(0)]);
    assert_eq!(buf.numel(), 640);
    assert_eq!(buf.numel_params(), 482);
    for bucket in b {
        assert_eq!((bucket.end - bucket.start) % 2, 0);
        assert_eq!(bucket.end % 128, 0);
    }
    assert!(
        buf.params()
            .iter()
            .all(|p| p.offset % PARAM_START_ALIGN == 0)
    );
    // dp shards of each bucket: equal halves.
    assert_eq!(b[1].shard_range(0, 2), 384..512);
    assert_eq!(b[1].shard_range(1, 2), 512..640);
    let owned = OwnedRanges::distributed_shard(&buf, 1, 2).unwrap();
    assert_eq!(owned.ranges(), &[192..384, 512..640]);
    assert_eq!(owned.local_len(), 320);
    assert_eq!(owned.local_range(&(520..530)).unwrap(), 200..210);
    assert!(owned.local_range(&(380..400)).is_err());
    assert!(OwnedRanges::distributed_shard(&buf, 0, 3).is_err()); // 384 % 3 == 0, 256 % 3 != 0
}

#[test]
fn registration_order_without_padding_is_packed() {
    let cfg = BufferConfig {
        param_dtype: DType::F32,
        data_parallel_size: 1,
        bucket_size: None,
        reverse_order: false,
        pad_for_sharding: false,
    };
    let buf = four_params(cfg);
    assert_eq!(offsets(&buf), vec![(0, 0), (170, 0), (175, 0), (475, 0)]);
    assert_eq!(buf.numel(), 482);
    assert_eq!(buf.buckets().len(), 1);
    assert_eq!(buf.buckets()[0].numel_unpadded, 482);
}

#[test]
fn shared_embedding_gets_its_own_bucket() {
    let mut b = ParamAndGradBufferBuilder::new(BufferConfig::new(DType::F32, 1));
    let flags = ParamFlags {
        is_embedding: true,
        shared_embedding: true,
        ..ParamFlags::default()
    };
    b.register("embedding.word_embeddings.weight", &[8, 4], flags)
        .unwrap();
    b.register_auto("final_norm.weight", &[4]).unwrap();
    b.register_auto("layer.weight", &[4, 4]).unwrap();
    let buf = b.build().unwrap();
    // Reverse: layer 0..16, norm 64..68; the embedding closes bucket 0 at 128 and sits alone
    // in bucket 1 (128..160, padded to 256).
    assert_eq!(offsets(&buf), vec![(128, 1), (64, 0), (0, 0)]);
    assert_eq!(buf.buckets()[1].params, vec![ParamId(0)]);
    assert_eq!(buf.buckets()[1].range(), 128..256);
    assert_eq!(buf.buckets()[0].numel_unpadded, 128);
}

#[test]
fn fsdp_units_never_share_a_bucket() {
    let mut b = ParamAndGradBufferBuilder::new(BufferConfig::new(DType::F32, 2));
    let unit = |fsdp_unit| ParamFlags {
        fsdp_unit,
        ..ParamFlags::default()
    };
    b.register("embedding", &[8, 4], unit(0)).unwrap();
    b.register("layer0.a", &[4, 4], unit(1)).unwrap();
    b.register("layer0.b", &[4], unit(1)).unwrap();
    b.register("final_norm", &[4], unit(2)).unwrap();
    let buf = b.build().unwrap();
    // Reverse order: the head's unit, then layer 0's two parameters together, then the
    // embedding; each bucket padded to lcm(2, 128).
    let members: Vec<Vec<ParamId>> = buf.buckets().iter().map(|b| b.params.clone()).collect();
    assert_eq!(
        members,
        vec![
            vec![ParamId(3)],
            vec![ParamId(2), ParamId(1)],
            vec![ParamId(0)]
        ]
    );
    assert!(buf.buckets().iter().all(|b| b.range().len() % 128 == 0));
}

#[test]
fn default_bucket_size_is_megatrons() {
    assert_eq!(default_bucket_size(1), 40_000_000);
    assert_eq!(default_bucket_size(64), 64_000_000);
    assert_eq!(
        BufferConfig::new(DType::F32, 8).bucket_size,
        Some(40_000_000)
    );
}

#[test]
fn slices_do_not_overlap_and_views_write_the_right_grads() {
    let mut cfg = BufferConfig::new(DType::BF16, 4);
    cfg.bucket_size = Some(100);
    let mut buf = four_params(cfg);
    let mut ranges: Vec<_> = buf.params().iter().map(|p| p.range()).collect();
    ranges.sort_by_key(|r| r.start);
    assert!(ranges.windows(2).all(|w| w[0].end <= w[1].start));
    for (i, p) in buf.params().iter().enumerate() {
        let r = p.range();
        let bucket = &buf.buckets()[p.bucket_id.unwrap()];
        assert!(bucket.start <= r.start && r.end <= bucket.end, "param {i}");
    }
    let ids: Vec<ParamId> = (0..4).map(ParamId).collect();
    for &id in &ids {
        let v: Vec<f32> = (0..buf.info(id).numel)
            .map(|j| (id.0 * 16 + j % 16 + 1) as f32)
            .collect();
        buf.set_param_from_f32(id, &v).unwrap();
    }
    {
        let views = buf.views::<bf16>().unwrap();
        let BufferViews { params, mut grads } = views;
        for (id, g) in grads.iter_mut().enumerate() {
            assert_eq!(g.len(), params[id].len());
            g.iter_mut()
                .zip(params[id].iter())
                .for_each(|(g, p)| *g = p.to_f32() + 0.5);
        }
    }
    for &id in &ids {
        let p = buf.param_to_f32(id);
        let g = buf.grad(id);
        assert!(p.iter().zip(g).all(|(p, g)| *g == p + 0.5));
        assert_eq!(p[0], (id.0 * 16 + 1) as f32); // exact in bf16
    }
    // Padding stays zero; every non-padding grad was written.
    let written: usize = buf.grads().iter().filter(|&&g| g != 0.0).count();
    assert_eq!(written, buf.numel_params());
    // Bucket accessors cover the buckets; zero_grad clears everything.
    let total: usize = (0..buf.buckets().len())
        .map(|b| buf.bucket_grads(b).len())
        .sum();
    assert_eq!(total, buf.numel());
    assert_eq!(
        buf.bucket_params::<bf16>(0).unwrap().len(),
        buf.buckets()[0].range().len()
    );
    buf.bucket_grads_mut(0).fill(1.0);
    buf.zero_grad();
    assert!(buf.grads().iter().all(|&g| g == 0.0));
    // Slices per id through the other accessors.
    let slices = buf.param_slices_mut::<bf16>().unwrap();
    assert_eq!(slices[2].len(), 300);
    assert_eq!(buf.grad_slices_mut()[1].len(), 5);
}

#[test]
fn errors_are_clear() {
    let mut b = ParamAndGradBufferBuilder::new(BufferConfig::new(DType::F32, 1));
    b.register_auto("x.weight", &[2, 2]).unwrap();
    let dup = b.register_auto("x.weight", &[3]).unwrap_err().to_string();
    assert!(dup.contains("`x.weight` is registered twice"), "{dup}");
    let empty = b.register_auto("y", &[0, 3]).unwrap_err().to_string();
    assert!(empty.contains("no elements"), "{empty}");
    let buf = b.build().unwrap();
    let wrong = buf.param::<bf16>(ParamId(0)).unwrap_err().to_string();
    assert!(
        wrong.contains("holds f32") && wrong.contains("bf16"),
        "{wrong}"
    );
    assert!(buf.id("nope").unwrap_err().to_string().contains("`nope`"));
    let mut cfg = BufferConfig::new(DType::F32, 1);
    cfg.data_parallel_size = 0;
    let err = ParamAndGradBufferBuilder::new(cfg)
        .build()
        .unwrap_err()
        .to_string();
    assert!(err.contains("data_parallel_size"), "{err}");
    let mut buf = buf;
    let len = buf
        .set_param_from_f32(ParamId(0), &[1.0])
        .unwrap_err()
        .to_string();
    assert!(len.contains("expected 4, got 1"), "{len}");
}

#[test]
fn flags_follow_megatrons_no_decay_rule() {
    assert!(ParamFlags::from_name_and_shape("l.input_layernorm.weight", &[8]).is_norm_or_bias);
    assert!(ParamFlags::from_name_and_shape("l.linear_qkv.bias", &[8]).is_norm_or_bias);
    assert!(!ParamFlags::from_name_and_shape("l.linear_qkv.weight", &[8, 8]).is_norm_or_bias);
}

/// The param storage can be lent out (to a model's table) and put back; gradients stay usable
/// meanwhile, and a storage of the wrong size or dtype is refused.
#[test]
fn param_storage_is_lent_and_put_back() {
    let mut buf = four_params(BufferConfig::new(DType::BF16, 1));
    let a = buf.id("a.weight").unwrap();
    buf.set_param_from_f32(a, &[0.5; 170]).unwrap();
    let storage = buf.take_params().unwrap();
    assert!(!buf.holds_params());
    assert!(buf.take_params().is_err());
    buf.grad_mut(a)[0] = 3.0;
    let wrong_len = ParamStorage::zeros(DType::BF16, buf.numel() - 1);
    assert!(buf.put_params(wrong_len).is_err());
    let wrong_dtype = ParamStorage::zeros(DType::F32, buf.numel());
    assert!(buf.put_params(wrong_dtype).is_err());
    buf.put_params(storage).unwrap();
    assert!(buf.holds_params());
    assert_eq!(buf.param_to_f32(a), vec![0.5; 170]);
    assert_eq!(buf.grad(a)[0], 3.0);
    let again = ParamStorage::zeros(DType::BF16, buf.numel());
    assert!(buf.put_params(again).is_err());
}

/// A frozen parameter (a LoRA model's base) keeps its place in the registration order but
/// takes no elements, no bucket and no place in buffer order; the others lay out as if it
/// were absent.
#[test]
fn frozen_parameters_take_no_room() {
    let cfg = BufferConfig::new(DType::BF16, 2);
    let mut b = ParamAndGradBufferBuilder::new(cfg.clone());
    b.register_auto("a.weight", &[10, 17]).unwrap();
    let frozen = ParamFlags {
        frozen: true,
        ..ParamFlags::default()
    };
    b.register("base.weight", &[100, 3], frozen).unwrap();
    b.register_auto("c.weight", &[4, 4]).unwrap();
    let mut buf = b.build().unwrap();
    let mut without = ParamAndGradBufferBuilder::new(cfg);
    without.register_auto("a.weight", &[10, 17]).unwrap();
    without.register_auto("c.weight", &[4, 4]).unwrap();
    let without = without.build().unwrap();
    assert_eq!(buf.numel(), without.numel());
    assert_eq!(buf.info(ParamId(1)).numel, 0);
    assert_eq!(buf.info(ParamId(1)).bucket_id, None);
    assert_eq!(buf.buffer_order(), &[ParamId(2), ParamId(0)]);
    assert!(
        buf.buckets()
            .iter()
            .all(|bk| !bk.params.contains(&ParamId(1)))
    );
    let grads = buf.grad_slices_mut();
    assert_eq!(
        grads.iter().map(|g| g.len()).collect::<Vec<_>>(),
        [170, 0, 16]
    );
}
