//! Test binaries with tests on the real SmolLM2 weights (`harness = false`, run by
//! libtest-mimic): such a test runs when its environment variable is set, and is reported as
//! ignored, with the variable it needs, when that is unset. A variable naming a missing path
//! fails the test. scripts/test.sh sets both variables (and, under `CI=true`, fails without
//! them). This one file is the `weights` module of the tests/common of ferrotron-data,
//! ferrotron-checkpoint and ferrotron (the other two include it with `#[path]`).

use libtest_mimic::{Arguments, Trial};
use std::path::PathBuf;

/// SmolLM2-135M-Instruct.Q4_1.gguf (`bash scripts/fetch-smollm2.sh` prints its path).
pub const GGUF: &str = "FERROTRON_SMOLLM2_GGUF";
/// The GGUF converted to an HF directory (`ferrotron convert gguf-to-hf`).
pub const HF: &str = "FERROTRON_SMOLLM2_HF";
/// A Python interpreter with the pinned `openai` client (tools/requirements-client.txt), for
/// the serving tests that drive `ferrotron serve` with it.
#[allow(dead_code)] // only ferrotron's serve tests use it
pub const OPENAI_PYTHON: &str = "FERROTRON_OPENAI_PYTHON";

/// The path in `var`, or `None` when it is unset or empty.
pub fn var(var: &str) -> Option<PathBuf> {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// The path in `var`; panics (fails the test) when it is unset or does not exist.
pub fn path(var_name: &str) -> PathBuf {
    let p = var(var_name).unwrap_or_else(|| panic!("{var_name} is not set"));
    assert!(p.exists(), "{var_name}={} does not exist", p.display());
    p
}

/// A test that needs no weights.
pub fn test(name: &str, f: fn()) -> Trial {
    Trial::test(name, move || {
        f();
        Ok(())
    })
}

/// A test that needs one of `vars`: ignored, with the reason, when none is set.
pub fn needs(vars: &[&str], name: &str, f: fn()) -> Trial {
    let trial = test(name, f);
    if vars.iter().any(|v| var(v).is_some()) {
        trial
    } else {
        trial
            .with_ignored_flag(true)
            .with_kind(format!("needs {}", vars.join(" or ")))
    }
}

/// Runs the trials with libtest's command line and exits with its status.
pub fn run(trials: impl IntoIterator<Item = Trial>) -> ! {
    let trials: Vec<Trial> = trials.into_iter().collect();
    if trials.iter().any(Trial::has_ignored_flag) {
        eprintln!(
            "the tests marked [needs VAR] are ignored: VAR is unset. scripts/test.sh sets {GGUF} \
             (`bash scripts/fetch-smollm2.sh` prints the path) and {HF} (that GGUF after \
             `ferrotron convert gguf-to-hf`) and {OPENAI_PYTHON} (a Python with the pinned openai \
             client)"
        );
    }
    libtest_mimic::run(&Arguments::from_args(), trials).exit()
}

/// Trials named like their functions: `trials![f, g]` needs nothing, `trials![needs [GGUF]: f, g]`
/// needs the GGUF (see [`needs`]). (`allow`s: binaries sharing `common` may not use it.)
#[allow(unused_macros)]
macro_rules! trials {
    (needs $vars:tt: $($f:ident),+ $(,)?) => {
        vec![$($crate::common::weights::needs(&$vars, stringify!($f), $f)),+]
    };
    ($($f:ident),+ $(,)?) => {
        vec![$($crate::common::weights::test(stringify!($f), $f)),+]
    };
}
#[allow(unused_imports)]
pub(crate) use trials;
