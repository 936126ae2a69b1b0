//! The allocator policy for long-running compute (training steps, serving-engine steps).
//! The `ferrotron` binary and the benchmarks install mimalloc as the global allocator; by
//! default it hands freed blocks back to the OS after a short delay (1 s in the linked
//! mimalloc 3), and a training step frees and re-allocates several GB of activations and
//! temporaries (multi-MB each), which the kernel then faults in and zeroes again: `perf` showed
//! 42% of an f32 micro-batch-4 SmolLM2 step in `clear_page_erms` (BENCHMARKS.md), and ~10% of
//! a batched decode step of the serving engine. Once the model (and optimizer, or KV cache)
//! is built, [`retain_freed_memory`] tells mimalloc to keep freed memory for reuse instead;
//! the peak RSS stays that of a step (the passes allocate on their calling thread, so one
//! heap serves every step), the page faults go away.

use std::ffi::c_int;

/// `mi_option_purge_delay` in mimalloc's `mi_option_e` (`mimalloc.h`, v2 and v3): how long a
/// freed block waits before it is returned to the OS, in ms; -1 never.
const MI_OPTION_PURGE_DELAY: c_int = 15;

/// Stops mimalloc from returning freed memory to the OS for the rest of the process, so the
/// next training steps reuse it. Returns whether the option was changed: `false` when it
/// already was -1 (e.g. `MIMALLOC_PURGE_DELAY=-1`), or when the option does not hold a
/// delay (a negative value other than -1: not the option order this was written against),
/// in which case nothing changes. Without mimalloc as the global allocator it has no effect
/// on the process's allocations.
pub fn retain_freed_memory() -> bool {
    // SAFETY: plain option getters/setters of the linked mimalloc; any thread, any time.
    unsafe {
        if libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) < 0 {
            return false;
        }
        libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1);
    }
    true
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_purge_delay_option_is_where_mimalloc_h_says() {
        // SAFETY: option getters/setters, see `retain_freed_memory`.
        let before = unsafe { libmimalloc_sys::mi_option_get(super::MI_OPTION_PURGE_DELAY) };
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            // mimalloc 2's default is 10 ms, mimalloc 3's 1000 ms
            assert!([10, 1000].contains(&before), "{before}");
            assert!(super::retain_freed_memory());
            let after = unsafe { libmimalloc_sys::mi_option_get(super::MI_OPTION_PURGE_DELAY) };
            assert_eq!(after, -1);
            assert!(!super::retain_freed_memory(), "already set");
        }
    }
}
