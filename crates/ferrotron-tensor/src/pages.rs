//! Memory that a buffer keeps its place for but does not hold: [`release`] zeroes a slice and
//! returns its whole pages to the operating system, [`resident_bytes`] counts the bytes of a
//! slice that occupy memory.
//!
//! ZeRO-2/3 keep a full-size gradient buffer and parameter storage whose address ranges the
//! model's views point into, but hold only a shard of each in memory: PyTorch FSDP frees an
//! unsharded parameter's storage (`storage.resize_(0)`) and re-allocates it before the next
//! all-gather, keeping the tensor; the same here is `madvise(MADV_DONTNEED)` on the pages of a
//! private anonymous mapping, after which they read as zeros and take memory again only when
//! written. Every large Rust allocation (glibc `malloc`, mimalloc) is such a mapping. The
//! partial pages at a slice's ends may hold neighbouring data, so they are zeroed by writes
//! and stay resident. Off Linux, [`release`] only zeroes.

use std::mem::size_of_val;

/// The page size of this process (4096 where it cannot be asked).
pub fn page_size() -> usize {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: sysconf has no preconditions.
        let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if size > 0 {
            return size as usize;
        }
    }
    4096
}

/// The whole pages inside `bytes`: (offset of the first, length), both in bytes.
fn inner_pages(addr: usize, len: usize) -> (usize, usize) {
    let page = page_size();
    let first = addr.next_multiple_of(page);
    let end = (addr + len) / page * page;
    if end <= first {
        (0, 0)
    } else {
        (first - addr, end - first)
    }
}

/// Sets every element of `values` to zero (all bytes 0) and returns the memory of the whole
/// pages inside it to the operating system: until they are written again they read as zeros
/// and take no memory. The elements at the ends that share a page with other data are
/// zeroed by writes.
pub fn release<T: bytemuck::Pod>(values: &mut [T]) {
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(values);
    let (skip, len) = inner_pages(bytes.as_ptr() as usize, bytes.len());
    if len > 0 && advise_dontneed(&mut bytes[skip..skip + len]) {
        bytes[..skip].fill(0);
        bytes[skip + len..].fill(0);
    } else {
        bytes.fill(0);
    }
}

/// `madvise(MADV_DONTNEED)` on `pages` (whole pages): whether it was done.
fn advise_dontneed(pages: &mut [u8]) -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `pages` is whole pages of memory this process owns exclusively (the
        // exclusive borrow); on a private anonymous mapping MADV_DONTNEED makes them read as
        // zeros from now on, which is a write of zeros through that borrow. A file-backed
        // mapping would read the file's bytes instead: allocations never are one.
        unsafe { libc::madvise(pages.as_mut_ptr().cast(), pages.len(), libc::MADV_DONTNEED) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = pages;
        false
    }
}

/// Bytes of `values` held in memory (`mincore`): the resident pages that lie inside the
/// slice, counted in full, plus the partial pages at its ends counted by the bytes of the
/// slice they hold when resident. A released page that was read since maps the kernel's
/// shared zero page, which takes no memory but counts here. Off Linux, the slice's size.
pub fn resident_bytes<T>(values: &[T]) -> usize {
    let len = size_of_val(values);
    if len == 0 {
        return 0;
    }
    #[cfg(target_os = "linux")]
    {
        let page = page_size();
        let addr = values.as_ptr() as usize;
        let first = addr / page * page;
        let pages = (addr + len).div_ceil(page) - first / page;
        let mut resident = vec![0u8; pages];
        // SAFETY: the range covers whole pages of one allocation this process holds; mincore
        // writes one byte per page into `resident`, which has that many.
        let ok = unsafe { libc::mincore(first as *mut _, pages * page, resident.as_mut_ptr()) };
        if ok == 0 {
            return resident
                .iter()
                .enumerate()
                .filter(|(_, r)| *r & 1 == 1)
                .map(|(i, _)| {
                    let start = (first + i * page).max(addr);
                    let end = (first + (i + 1) * page).min(addr + len);
                    end - start
                })
                .sum();
        }
    }
    len
}

/// The largest resident set this process has had so far (`VmHWM` of `/proc/self/status`),
/// in bytes; `None` where it cannot be read.
pub fn peak_resident_set_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_zeroes_and_gives_back_the_whole_pages() {
        let n = 64 * page_size() / 4;
        let mut v: Vec<f32> = (0..n).map(|i| i as f32 + 1.0).collect();
        assert_eq!(resident_bytes(&v), n * 4);
        let (lo, hi) = (1000, n - 3000);
        release(&mut v[lo..hi]);
        // Measured before anything reads the released pages (a read maps the kernel's
        // shared zero page, which `mincore` reports as resident).
        let resident = resident_bytes(&v);
        assert!(v[lo..hi].iter().all(|&x| x == 0.0));
        assert_eq!(v[lo - 1], lo as f32);
        assert_eq!(v[hi], hi as f32 + 1.0);
        if cfg!(target_os = "linux") {
            // Everything but the released range's whole pages stays; at most one page
            // at each end of it stays too.
            let released = (hi - lo) * 4;
            assert!(resident <= n * 4 - released + 2 * page_size(), "{resident}");
            assert!(resident >= n * 4 - released, "{resident}");
            // Written again, the pages come back.
            v[lo..hi].fill(2.0);
            assert_eq!(resident_bytes(&v), n * 4);
        }
    }

    #[test]
    fn the_peak_resident_set_covers_what_is_resident_now() {
        let v = vec![1u8; 64 * page_size()];
        match peak_resident_set_bytes() {
            Some(peak) => assert!(peak >= resident_bytes(&v) as u64),
            None if cfg!(target_os = "linux") => panic!("VmHWM unreadable on Linux"),
            None => {}
        }
    }

    #[test]
    fn resident_bytes_of_a_partial_page_counts_the_slice_only() {
        let v = vec![1u8; 3 * page_size()];
        assert_eq!(resident_bytes(&v[10..20]), 10);
        assert_eq!(resident_bytes::<u8>(&[]), 0);
        assert_eq!(inner_pages(page_size() + 1, page_size()), (0, 0));
    }
}
