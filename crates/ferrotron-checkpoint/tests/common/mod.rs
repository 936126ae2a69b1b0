//! Test helpers: a GGUF writer and a tiny synthetic LLaMA (with a byte-level BPE vocab) whose
//! expected HF tensors are known exactly; the harness of the tests on the real SmolLM2 weights
//! (`weights`).
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use ferrotron_checkpoint::gguf::{GgmlType, GgufArray, GgufValue};
use ferrotron_checkpoint::{CheckpointError, GgufToHfOptions, gguf_to_hf};

mod tiny;
#[allow(unused_imports)]
pub use tiny::*;
/// One file for every crate's tests on the real weights (kept in ferrotron-data, the lowest).
#[path = "../../../ferrotron-data/tests/common/weights.rs"]
pub mod weights;

/// One tensor-table entry; `offset: None` places the data after the previous tensor (aligned).
pub struct RawTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub type_id: u32,
    pub data: Vec<u8>,
    pub offset: Option<u64>,
    /// Written to the tensor table instead of the real offset (the data stays where it is).
    pub table_offset: Option<u64>,
}

/// Builds GGUF bytes (little-endian, as llama.cpp's `gguf_write_to_buf`).
pub struct GgufBuilder {
    pub version: u32,
    pub alignment: u64,
    pub kvs: Vec<(String, GgufValue)>,
    pub tensors: Vec<RawTensor>,
}

fn value_type_id(v: &GgufValue) -> u32 {
    match v {
        GgufValue::U8(_) => 0,
        GgufValue::I8(_) => 1,
        GgufValue::U16(_) => 2,
        GgufValue::I16(_) => 3,
        GgufValue::U32(_) => 4,
        GgufValue::I32(_) => 5,
        GgufValue::F32(_) => 6,
        GgufValue::Bool(_) => 7,
        GgufValue::String(_) => 8,
        GgufValue::Array(_) => 9,
        GgufValue::U64(_) => 10,
        GgufValue::I64(_) => 11,
        GgufValue::F64(_) => 12,
    }
}

fn array_type_id(a: &GgufArray) -> u32 {
    match a {
        GgufArray::U8(_) => 0,
        GgufArray::I8(_) => 1,
        GgufArray::U16(_) => 2,
        GgufArray::I16(_) => 3,
        GgufArray::U32(_) => 4,
        GgufArray::I32(_) => 5,
        GgufArray::F32(_) => 6,
        GgufArray::Bool(_) => 7,
        GgufArray::String(_) => 8,
        GgufArray::Array(_) => 9,
        GgufArray::U64(_) => 10,
        GgufArray::I64(_) => 11,
        GgufArray::F64(_) => 12,
    }
}

pub fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => out.extend(x.to_le_bytes()),
        GgufValue::I8(x) => out.extend(x.to_le_bytes()),
        GgufValue::U16(x) => out.extend(x.to_le_bytes()),
        GgufValue::I16(x) => out.extend(x.to_le_bytes()),
        GgufValue::U32(x) => out.extend(x.to_le_bytes()),
        GgufValue::I32(x) => out.extend(x.to_le_bytes()),
        GgufValue::F32(x) => out.extend(x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(*x as u8),
        GgufValue::String(s) => put_str(out, s),
        GgufValue::Array(a) => put_array(out, a),
        GgufValue::U64(x) => out.extend(x.to_le_bytes()),
        GgufValue::I64(x) => out.extend(x.to_le_bytes()),
        GgufValue::F64(x) => out.extend(x.to_le_bytes()),
    }
}

fn put_array(out: &mut Vec<u8>, a: &GgufArray) {
    out.extend(array_type_id(a).to_le_bytes());
    out.extend((a.len() as u64).to_le_bytes());
    match a {
        GgufArray::U8(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        GgufArray::I8(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        GgufArray::U16(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        GgufArray::I16(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        GgufArray::U32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        GgufArray::I32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        GgufArray::F32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        GgufArray::Bool(v) => v.iter().for_each(|x| out.push(*x as u8)),
        GgufArray::String(v) => v.iter().for_each(|s| put_str(out, s)),
        GgufArray::Array(v) => v.iter().for_each(|x| put_array(out, x)),
        GgufArray::U64(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        GgufArray::I64(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        GgufArray::F64(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
    }
}

impl Default for GgufBuilder {
    fn default() -> Self {
        GgufBuilder {
            version: 3,
            alignment: 32,
            kvs: Vec::new(),
            tensors: Vec::new(),
        }
    }
}

impl GgufBuilder {
    pub fn kv(&mut self, key: &str, v: GgufValue) -> &mut Self {
        self.kvs.retain(|(k, _)| k != key);
        self.kvs.push((key.to_string(), v));
        self
    }

    pub fn remove_kv(&mut self, key: &str) -> &mut Self {
        self.kvs.retain(|(k, _)| k != key);
        self
    }

    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> &mut Self {
        self.tensors.push(RawTensor {
            name: name.to_string(),
            dims: dims.to_vec(),
            type_id: type_id(ty),
            data,
            offset: None,
            table_offset: None,
        });
        self
    }

    pub fn tensor_mut(&mut self, name: &str) -> &mut RawTensor {
        self.tensors
            .iter_mut()
            .find(|t| t.name == name)
            .expect("tensor in builder")
    }

    /// The file bytes.
    pub fn build(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            put_str(&mut out, k);
            out.extend(value_type_id(v).to_le_bytes());
            put_value(&mut out, v);
        }
        let align = self.alignment;
        let mut offsets = Vec::new();
        let mut next = 0u64;
        for t in &self.tensors {
            let off = t.offset.unwrap_or(next);
            offsets.push(off);
            next = (off + t.data.len() as u64).next_multiple_of(align);
        }
        for (t, off) in self.tensors.iter().zip(&offsets) {
            put_str(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            t.dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
            out.extend(t.type_id.to_le_bytes());
            out.extend(t.table_offset.unwrap_or(*off).to_le_bytes());
        }
        let data_start = (out.len() as u64).next_multiple_of(align);
        out.resize(data_start as usize, 0);
        for (t, off) in self.tensors.iter().zip(&offsets) {
            let at = (data_start + off) as usize;
            if out.len() < at + t.data.len() {
                out.resize(at + t.data.len(), 0);
            }
            out[at..at + t.data.len()].copy_from_slice(&t.data);
        }
        out
    }
}

pub fn type_id(ty: GgmlType) -> u32 {
    (0..64)
        .find(|&i| GgmlType::from_id(i) == Some(ty))
        .expect("known type")
}

/// Writes `bytes` to `dir/name`.
pub fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Entries of `parent` other than the input file `in.gguf`.
pub fn leftovers(parent: &Path) -> Vec<String> {
    std::fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "in.gguf")
        .collect()
}

/// Runs the conversion of `bytes`, expects an error containing every string in `needles`, and
/// checks nothing was left in the directory but the input.
pub fn expect_conversion_error(bytes: &[u8], needles: &[&str]) -> CheckpointError {
    let dir = tempfile::tempdir().unwrap();
    let input = write(dir.path(), "in.gguf", bytes);
    let err = gguf_to_hf(&input, &dir.path().join("hf"), &GgufToHfOptions::default()).unwrap_err();
    let msg = err.to_string();
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} does not contain {n:?}");
    }
    assert!(
        leftovers(dir.path()).is_empty(),
        "output left behind after: {msg}"
    );
    err
}
