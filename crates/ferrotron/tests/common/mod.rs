//! Shared by the CLI integration tests: running the `ferrotron` binary and the SmolLM2 HF
//! directory converted from `FERROTRON_SMOLLM2_GGUF`.

#![allow(dead_code)] // each test binary uses a different part

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// Runs the `ferrotron` binary built for these tests.
pub fn ferrotron(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(args)
        .output()
        .unwrap()
}

/// The SmolLM2 HF directory, converted with `ferrotron convert gguf-to-hf` once per test
/// binary into a fixed place under target/ (replaced with --force each run), or `None` with a
/// printed notice when `FERROTRON_SMOLLM2_GGUF` is unset (scripts/test.sh always sets it).
pub fn model_dir() -> Option<&'static Path> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| {
        let Some(gguf) = std::env::var_os("FERROTRON_SMOLLM2_GGUF") else {
            eprintln!("FERROTRON_SMOLLM2_GGUF not set: skipping the SmolLM2 tests of this binary");
            return None;
        };
        // One directory per test binary: cargo may build them into the same target dir.
        let bin = std::env::current_exe().unwrap();
        let name = bin.file_stem().unwrap().to_string_lossy().into_owned();
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("smollm2-hf-{name}"));
        let o = ferrotron(&[
            "convert",
            "gguf-to-hf",
            "--input",
            Path::new(&gguf).to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--force",
        ]);
        assert!(
            o.status.success(),
            "convert failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        Some(out)
    })
    .as_deref()
}
