//! GgufFile: metadata of every value type, alignment, tensor access, and corrupt files.

mod common;

use common::{GgufBuilder, TinyOpts, expect_conversion_error, put_str, tiny_llama, write};
use ferrotron_checkpoint::CheckpointError;
use ferrotron_checkpoint::gguf::{GgmlType, GgufArray, GgufFile, GgufValue};

fn open_bytes(bytes: &[u8]) -> (tempfile::TempDir, Result<GgufFile, CheckpointError>) {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "t.gguf", bytes);
    let r = GgufFile::open(&p);
    (dir, r)
}

/// Opening `bytes` fails with a message containing all of `needles`, and so does converting it
/// (leaving no output).
fn expect_open_error(bytes: &[u8], needles: &[&str]) {
    let (_d, r) = open_bytes(bytes);
    let msg = r.map(|_| ()).unwrap_err().to_string();
    assert!(msg.starts_with("t.gguf: "), "{msg}");
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} does not contain {n:?}");
    }
    expect_conversion_error(bytes, needles);
}

fn all_types() -> Vec<(&'static str, GgufValue)> {
    use GgufValue as V;
    vec![
        ("u8", V::U8(200)),
        ("i8", V::I8(-5)),
        ("u16", V::U16(60000)),
        ("i16", V::I16(-30000)),
        ("u32", V::U32(4_000_000_000)),
        ("i32", V::I32(-2_000_000_000)),
        ("f32", V::F32(1.5)),
        ("bool", V::Bool(true)),
        ("str", V::String("héllo".into())),
        ("u64", V::U64(u64::MAX)),
        ("i64", V::I64(i64::MIN)),
        ("f64", V::F64(-2.25)),
        ("a.u8", V::Array(GgufArray::U8(vec![1, 2, 3]))),
        ("a.i8", V::Array(GgufArray::I8(vec![-1]))),
        ("a.u16", V::Array(GgufArray::U16(vec![7, 8]))),
        ("a.i16", V::Array(GgufArray::I16(vec![-7]))),
        ("a.u32", V::Array(GgufArray::U32(vec![9]))),
        ("a.i32", V::Array(GgufArray::I32(vec![-9, 3]))),
        ("a.f32", V::Array(GgufArray::F32(vec![0.5, -0.5]))),
        ("a.bool", V::Array(GgufArray::Bool(vec![true, false]))),
        (
            "a.str",
            V::Array(GgufArray::String(vec![
                "a".into(),
                "".into(),
                "日本".into(),
            ])),
        ),
        ("a.u64", V::Array(GgufArray::U64(vec![1 << 40]))),
        ("a.i64", V::Array(GgufArray::I64(vec![-(1 << 40)]))),
        ("a.f64", V::Array(GgufArray::F64(vec![1e300]))),
        ("a.empty", V::Array(GgufArray::U32(vec![]))),
        (
            "a.nested",
            V::Array(GgufArray::Array(vec![
                GgufArray::I32(vec![1, 2]),
                GgufArray::String(vec!["x".into()]),
            ])),
        ),
    ]
}

#[test]
fn metadata_of_every_type_round_trips() {
    let mut b = GgufBuilder::default();
    for (k, v) in all_types() {
        b.kv(k, v);
    }
    b.tensor(
        "t",
        &[3],
        GgmlType::F32,
        [1f32, 2., 3.]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
    );
    for version in [2, 3] {
        b.version = version;
        let (_d, f) = open_bytes(&b.build());
        let f = f.unwrap();
        assert_eq!(f.version(), version);
        let want = all_types();
        assert_eq!(f.metadata().len(), want.len());
        for ((k, v), (wk, wv)) in f.metadata().iter().zip(&want) {
            assert_eq!(k, wk);
            assert_eq!(v, wv, "{k}");
        }
        assert_eq!(f.opt_u64("u32").unwrap(), Some(4_000_000_000));
        assert_eq!(f.opt_u64("u64").unwrap(), Some(u64::MAX));
        assert_eq!(f.opt_f64("f32").unwrap(), Some(1.5));
        assert_eq!(f.opt_str("str").unwrap(), Some("héllo"));
        assert_eq!(f.opt_bool("bool").unwrap(), Some(true));
        assert_eq!(f.opt_u64("absent").unwrap(), None);
        let e = f.opt_u64("i8").unwrap_err().to_string();
        assert!(
            e.contains("metadata i8: expected a non-negative integer"),
            "{e}"
        );
        let e = f.require_u64("absent").unwrap_err().to_string();
        assert!(e.contains("metadata absent: missing"), "{e}");
        assert_eq!(f.tensor_f32("t").unwrap(), vec![1., 2., 3.]);
        assert_eq!(f.tensors()[0].shape(), vec![3]);
        let e = f.tensor_f32("nope").unwrap_err().to_string();
        assert!(e.contains("tensor nope: no such tensor"), "{e}");
    }
}

#[test]
fn alignment_default_and_custom() {
    let mut b = GgufBuilder::default();
    b.kv("k", GgufValue::U8(1));
    b.tensor("a", &[1], GgmlType::F32, 7f32.to_le_bytes().to_vec());
    b.tensor(
        "b",
        &[2],
        GgmlType::F32,
        [8f32, 9.].iter().flat_map(|x| x.to_le_bytes()).collect(),
    );
    let (_d, f) = open_bytes(&b.build());
    let f = f.unwrap();
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.data_offset() % 32, 0);
    assert_eq!(f.tensor_info("b").unwrap().offset, 32);
    assert_eq!(f.tensor_f32("b").unwrap(), vec![8., 9.]);

    b.alignment = 256;
    b.kv("general.alignment", GgufValue::U32(256));
    let (_d, f) = open_bytes(&b.build());
    let f = f.unwrap();
    assert_eq!(f.alignment(), 256);
    assert_eq!(f.data_offset() % 256, 0);
    assert_eq!(f.tensor_info("b").unwrap().offset, 256);
    assert_eq!(f.tensor_f32("a").unwrap(), vec![7.]);
    assert_eq!(f.tensor_f32("b").unwrap(), vec![8., 9.]);
}

#[test]
fn tiny_llama_tensor_infos() {
    let (b, _) = tiny_llama(&TinyOpts::default());
    let (_d, f) = open_bytes(&b.build());
    let f = f.unwrap();
    let t = f.tensor_info("blk.0.attn_q.weight").unwrap();
    assert_eq!(t.dims, vec![32, 32]);
    assert_eq!(t.ggml_type, GgmlType::Q4_1);
    assert_eq!(t.n_elements, 1024);
    assert_eq!(t.n_bytes, 32 * 20);
    assert_eq!(f.tensor_data("blk.0.attn_q.weight").unwrap().len(), 640);
    let e = f.tensor_info("token_embd.weight").unwrap();
    assert_eq!(e.shape(), vec![270, 32]);
}

#[test]
fn bad_magic_and_versions() {
    let (b, _) = tiny_llama(&TinyOpts::default());
    let good = b.build();
    let mut bad = good.clone();
    bad[..4].copy_from_slice(b"GGML");
    expect_open_error(&bad, &["bad magic", "GGML", "expected \"GGUF\""]);
    let mut v1 = good.clone();
    v1[4..8].copy_from_slice(&1u32.to_le_bytes());
    expect_open_error(&v1, &["unsupported GGUF version 1: expected 2 or 3"]);
    let mut be = good;
    be[4..8].copy_from_slice(&3u32.to_be_bytes());
    expect_open_error(&be, &["big-endian"]);
}

#[test]
fn truncated_files() {
    let (b, _) = tiny_llama(&TinyOpts::default());
    let good = b.build();
    expect_open_error(&[], &["truncated header", "0 bytes"]);
    expect_open_error(&good[..10], &["truncated header"]);
    // Cut inside the metadata (in the tokens array), and inside the tensor table.
    expect_open_error(
        &good[..3000],
        &["truncated: metadata tokenizer.ggml.tokens["],
    );
    let f = GgufFile::open(write(tempfile::tempdir().unwrap().path(), "x.gguf", &good)).unwrap();
    let table_mid = f.data_offset() as usize - 40;
    expect_open_error(&good[..table_mid], &["truncated: tensor"]);
    // A header that claims more entries than the bytes left could hold.
    expect_open_error(
        &good[..200],
        &["header claims 23 metadata entries and 20 tensors"],
    );
    // Cut inside the data section: the last tensor's data lies past the end.
    let cut = &good[..good.len() - 10];
    expect_open_error(
        cut,
        &["tensor output_norm.weight: data [", "lies past end of file"],
    );
}

#[test]
fn tensor_table_errors() {
    let build = |edit: &dyn Fn(&mut GgufBuilder)| {
        let (mut b, _) = tiny_llama(&TinyOpts::default());
        edit(&mut b);
        b.build()
    };
    let b = build(&|b| b.tensor_mut("blk.1.ffn_up.weight").table_offset = Some(1 << 40));
    expect_open_error(
        &b,
        &[
            "tensor blk.1.ffn_up.weight: data [",
            "lies past end of file (",
        ],
    );
    let b = build(&|b| b.tensor_mut("blk.1.ffn_up.weight").table_offset = Some(u64::MAX - 31));
    expect_open_error(&b, &["tensor blk.1.ffn_up.weight", "overflows"]);
    let b = build(&|b| b.tensor_mut("blk.0.ffn_up.weight").table_offset = Some(4));
    expect_open_error(
        &b,
        &["tensor blk.0.ffn_up.weight: offset 4 is not a multiple of the alignment 32"],
    );
    let b = build(&|b| b.tensor_mut("blk.0.attn_v.weight").type_id = 99);
    expect_open_error(&b, &["tensor blk.0.attn_v.weight: unknown ggml type id 99"]);
    let b = build(&|b| b.tensor_mut("blk.0.attn_q.weight").dims = vec![31, 32]);
    expect_open_error(
        &b,
        &["blk.0.attn_q.weight: ne[0] = 31 is not a multiple of the block size 32 of type Q4_1"],
    );
    let b = build(&|b| b.tensor_mut("blk.0.attn_q.weight").dims = vec![32, 1 << 40, 1 << 40]);
    expect_open_error(
        &b,
        &["tensor blk.0.attn_q.weight: size of dims", "overflows"],
    );
    let b = build(&|b| b.tensor_mut("blk.0.attn_q.weight").dims = vec![32, 32, 1, 1, 1]);
    expect_open_error(
        &b,
        &["tensor blk.0.attn_q.weight: has 5 dims, expected 1 to 4"],
    );
    // A size that is consistent with the dims but larger than the file.
    let b = build(&|b| b.tensor_mut("output_norm.weight").dims = vec![1 << 30]);
    expect_open_error(&b, &["tensor output_norm.weight", "lies past end of file"]);
    let b = build(&|b| b.tensor_mut("blk.0.attn_k.weight").name = "blk.0.attn_q.weight".into());
    expect_open_error(&b, &["tensor blk.0.attn_q.weight: appears twice"]);
}

#[test]
fn metadata_errors() {
    let mut b = GgufBuilder::default();
    b.kv("general.alignment", GgufValue::U32(3));
    expect_open_error(
        &b.build(),
        &["metadata general.alignment: expected a non-zero power of two"],
    );
    b.kv("general.alignment", GgufValue::U32(0));
    expect_open_error(&b.build(), &["metadata general.alignment"]);

    let mut b = GgufBuilder::default();
    b.kv("x", GgufValue::U8(1));
    let mut bytes = b.build();
    // The same key/value again (a key of 8 + 1 bytes, a tag of 4, a value of 1).
    let kv = bytes[24..38].to_vec();
    bytes.truncate(38);
    bytes.extend(kv);
    bytes[16..24].copy_from_slice(&2u64.to_le_bytes());
    expect_open_error(&bytes, &["metadata key x appears twice"]);

    // Invalid UTF-8 in a key.
    let mut b = GgufBuilder::default();
    b.kv("ab", GgufValue::U8(1));
    let mut bytes = b.build();
    bytes[32] = 0xFF;
    expect_open_error(&bytes, &["metadata key #0", "not valid UTF-8"]);

    // Unknown value type tag.
    let mut bytes = b.build();
    bytes[34..38].copy_from_slice(&13u32.to_le_bytes());
    expect_open_error(&bytes, &["metadata ab: unknown value type 13"]);
}

/// A header with `n_tensors` / `n_kv` and one key `k` holding `body` after its type tag.
fn raw_file(n_tensors: u64, n_kv: u64, tag: u32, body: &[u8]) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(n_tensors.to_le_bytes());
    out.extend(n_kv.to_le_bytes());
    put_str(&mut out, "k");
    out.extend(tag.to_le_bytes());
    out.extend(body);
    out
}

#[test]
fn huge_counts_are_rejected_before_allocating() {
    expect_open_error(
        &raw_file(u64::MAX, 1, 0, &[1]),
        &["header claims", "cannot fit"],
    );
    expect_open_error(
        &raw_file(0, u64::MAX / 2, 0, &[1]),
        &["header claims", "cannot fit"],
    );
    expect_open_error(&raw_file(1 << 40, 1, 0, &[1]), &["cannot fit"]);
    let mut arr = 4u32.to_le_bytes().to_vec(); // u32 elements
    arr.extend(u64::MAX.to_le_bytes());
    expect_open_error(
        &raw_file(0, 1, 9, &arr),
        &["metadata k: array claims 18446744073709551615 elements"],
    );
    let mut arr = 8u32.to_le_bytes().to_vec(); // strings
    arr.extend((1u64 << 50).to_le_bytes());
    expect_open_error(&raw_file(0, 1, 9, &arr), &["array claims"]);
    let mut s = u64::MAX.to_le_bytes().to_vec(); // a string of 2^64-1 bytes
    s.extend(b"abc");
    expect_open_error(
        &raw_file(0, 1, 8, &s),
        &[
            "truncated: metadata k at offset",
            "needs 18446744073709551615 bytes",
        ],
    );
    // Arrays nested deeper than 8.
    let mut nest = Vec::new();
    for _ in 0..10 {
        nest.extend(9u32.to_le_bytes());
        nest.extend(1u64.to_le_bytes());
    }
    expect_open_error(&raw_file(0, 1, 9, &nest), &["nested deeper than 8"]);
}

#[test]
fn error_names_file_and_expected_sizes() {
    let (mut b, _) = tiny_llama(&TinyOpts::default());
    b.tensor_mut("blk.1.ffn_down.weight").table_offset = Some(1 << 20);
    let bytes = b.build();
    let (_d, r) = open_bytes(&bytes);
    let msg = r.unwrap_err().to_string();
    assert!(
        msg.starts_with("t.gguf: tensor blk.1.ffn_down.weight: data ["),
        "{msg}"
    );
    assert!(
        msg.ends_with(&format!("lies past end of file ({} bytes)", bytes.len())),
        "{msg}"
    );
}
