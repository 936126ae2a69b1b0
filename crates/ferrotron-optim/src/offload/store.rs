//! [`ChunkStore`]: the optimizer state's arrays ("planes": Adam's moments, the master
//! weights) over a [`ChunkLayout`], each chunk in the fast tier (RAM) or the slow tier (a
//! file in the offload directory), and the pipelined walk over them that an optimizer step
//! makes: the next slow chunk is read ahead on a reader thread and each updated one written
//! behind on a writer thread while the current one computes (ZeRO-Infinity's
//! `pipeline_read` / `pipeline_write`; a pool of [`BUFFERS`] chunk buffers bounds the
//! memory in flight).

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, sync_channel};

use super::layout::ChunkLayout;
use crate::error::{OptimError, Result};

/// Chunk buffers in flight between the reader, the step and the writer (DeepSpeed's
/// `buffer_count` for the optimizer swapper).
pub const BUFFERS: usize = 4;

/// Where a chunk lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// RAM.
    Fast,
    /// A slot of the offload file.
    Slow,
}

/// The slow tier: an unnamed file in the offload directory (removed by the system when
/// closed), one slot of `chunk_size · planes` f32 per chunk.
#[derive(Debug)]
struct SlowTier {
    file: File,
    dir: PathBuf,
    slot_bytes: u64,
}

impl SlowTier {
    fn read(&self, chunk: usize, out: &mut [f32]) -> Result<()> {
        let at = chunk as u64 * self.slot_bytes;
        self.file
            .read_exact_at(bytemuck::cast_slice_mut(out), at)
            .map_err(|e| self.err("reading", e))
    }

    fn write(&self, chunk: usize, data: &[f32]) -> Result<()> {
        let at = chunk as u64 * self.slot_bytes;
        self.file
            .write_all_at(bytemuck::cast_slice(data), at)
            .map_err(|e| self.err("writing", e))
    }

    fn err(&self, what: &str, e: std::io::Error) -> OptimError {
        OptimError::Offload(format!(
            "{what} the optimizer state in {}: {e}",
            self.dir.display()
        ))
    }
}

/// The planes of one chunk's part `sub` handed to a step: `planes[i]` is plane `i` over
/// `sub` (local indices).
pub type ChunkPlanes<'a> = Vec<&'a mut [f32]>;

/// `planes` f32 arrays over `0..n` in chunks, each chunk in a [`Tier`].
#[derive(Debug)]
pub struct ChunkStore {
    planes: usize,
    layout: ChunkLayout,
    /// A fast chunk's data (`planes` arrays of its length, one after another); `None` for
    /// a slow one.
    fast: Vec<Option<Vec<f32>>>,
    slow: Option<SlowTier>,
    /// Bytes read from and written to the slow tier since the last [`take_moved_bytes`].
    moved: u64,
}

impl ChunkStore {
    /// The chunks of `layout` with `planes` zeroed arrays each, the first `n_slow` in the
    /// slow tier (zeros there without passing through RAM) and the rest in RAM; with `dir`,
    /// a slow tier in that directory (an unnamed file: nothing is left behind).
    ///
    /// # Errors
    /// [`OptimError::Offload`] naming `dir` when it cannot hold the file or its free space is
    /// below what every chunk offloaded would take, or `n_slow > 0` without `dir`.
    pub fn new(
        planes: usize,
        layout: ChunkLayout,
        dir: Option<&Path>,
        n_slow: usize,
    ) -> Result<ChunkStore> {
        let fast = (layout.chunks().iter().enumerate())
            .map(|(k, c)| (k >= n_slow).then(|| vec![0f32; planes * c.len()]))
            .collect();
        let slot_bytes = (layout.chunk_size() * planes * 4) as u64;
        let slow = match dir {
            Some(dir) => {
                let need = slot_bytes * layout.chunks().len() as u64;
                let file = open_slow_tier(dir, need)?;
                // Unwritten slots read as zeros: the slow chunks' initial state.
                file.set_len(need).map_err(|e| {
                    OptimError::Offload(format!("offload_path {}: {e}", dir.display()))
                })?;
                Some(SlowTier {
                    file,
                    dir: dir.to_path_buf(),
                    slot_bytes,
                })
            }
            None if n_slow > 0 => {
                return Err(OptimError::Offload(
                    "no offload directory for the slow tier".into(),
                ));
            }
            None => None,
        };
        Ok(ChunkStore {
            planes,
            layout,
            fast,
            slow,
            moved: 0,
        })
    }

    /// The layout.
    pub fn layout(&self) -> &ChunkLayout {
        &self.layout
    }

    /// Arrays per chunk.
    pub fn planes(&self) -> usize {
        self.planes
    }

    /// Where chunk `k` lives.
    pub fn tier(&self, k: usize) -> Tier {
        if self.fast[k].is_some() {
            Tier::Fast
        } else {
            Tier::Slow
        }
    }

    /// Bytes of state in RAM.
    pub fn fast_bytes(&self) -> u64 {
        self.fast.iter().flatten().map(|c| 4 * c.len() as u64).sum()
    }

    /// Bytes of state in each chunk, in order (whichever tier it is in).
    pub fn chunk_bytes(&self) -> impl Iterator<Item = u64> + '_ {
        let planes = self.planes as u64;
        self.layout
            .chunks()
            .iter()
            .map(move |c| 4 * planes * c.len() as u64)
    }

    /// Chunks in the slow tier.
    pub fn slow_chunks(&self) -> usize {
        self.fast.iter().filter(|c| c.is_none()).count()
    }

    /// Bytes of state in the slow tier.
    pub fn slow_bytes(&self) -> u64 {
        (self.chunk_bytes().zip(&self.fast))
            .filter(|(_, c)| c.is_none())
            .map(|(b, _)| b)
            .sum()
    }

    /// Bytes moved between the tiers since the last call, and resets the count.
    pub fn take_moved_bytes(&mut self) -> u64 {
        std::mem::take(&mut self.moved)
    }

    /// Places the first `n_slow` chunks in the slow tier and the rest in RAM, moving what
    /// must move (Megatron's `HybridDeviceOptimizer` offloads the first parameters too).
    ///
    /// # Errors
    /// [`OptimError::Offload`] when `n_slow > 0` without a slow tier, or on an I/O error.
    pub fn place(&mut self, n_slow: usize) -> Result<()> {
        let n_slow = n_slow.min(self.fast.len());
        if n_slow > 0 && self.slow.is_none() {
            return Err(OptimError::Offload(
                "no offload directory for the slow tier".into(),
            ));
        }
        for k in 0..self.fast.len() {
            let want_slow = k < n_slow;
            match (&self.fast[k], want_slow, &self.slow) {
                (Some(data), true, Some(slow)) => {
                    slow.write(k, data)?;
                    self.moved += 4 * data.len() as u64;
                    self.fast[k] = None;
                }
                (None, false, Some(slow)) => {
                    let mut data = vec![0f32; self.planes * self.layout.chunks()[k].len()];
                    slow.read(k, &mut data)?;
                    self.moved += 4 * data.len() as u64;
                    self.fast[k] = Some(data);
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Runs `f(sub, planes)` over every chunk part overlapping `range` (local indices), in
    /// order: `sub` the part's local range, `planes` its arrays. Slow chunks are read ahead
    /// and written back behind the computation (see the module docs); fast ones are used in
    /// place.
    ///
    /// # Errors
    /// `f`'s error, or [`OptimError::Offload`] on an I/O error (the chunks already written
    /// hold their update, the others not: the caller fails the step).
    pub fn for_each(
        &mut self,
        range: Range<usize>,
        mut f: impl FnMut(Range<usize>, ChunkPlanes<'_>) -> Result<()>,
    ) -> Result<()> {
        let ks = self.layout.overlapping(&range);
        let slow_ks: Vec<usize> = ks.clone().filter(|&k| self.fast[k].is_none()).collect();
        let (planes, chunks) = (self.planes, self.layout.chunks());
        let part = |k: usize| {
            let c = &chunks[k];
            (c.start.max(range.start)..c.end.min(range.end), c.clone())
        };
        let Some(slow) = &self.slow else {
            for k in ks {
                let (sub, c) = part(k);
                let data = self.fast[k].as_mut().expect("no slow tier: all fast");
                f(sub.clone(), split_planes(data, planes, &c, &sub))?;
            }
            return Ok(());
        };
        let fast = &mut self.fast;
        let mut moved = 0u64;
        let result = std::thread::scope(|scope| -> Result<()> {
            let (free_tx, free_rx) = sync_channel::<Vec<f32>>(BUFFERS);
            for _ in 0..BUFFERS.min(slow_ks.len()) {
                let _ = free_tx.send(Vec::new());
            }
            let (read_tx, read_rx) = sync_channel::<Result<Vec<f32>>>(BUFFERS);
            let reader_ks = slow_ks.clone();
            scope.spawn(move || {
                for k in reader_ks {
                    let Ok(mut buf) = free_rx.recv() else { return };
                    buf.resize(planes * chunks[k].len(), 0.0);
                    let read = slow.read(k, &mut buf).map(|()| buf);
                    if read_tx.send(read).is_err() {
                        return;
                    }
                }
            });
            let (write_tx, write_rx) = channel::<(usize, Vec<f32>)>();
            let writer = scope.spawn(move || -> Result<()> {
                for (k, buf) in write_rx {
                    slow.write(k, &buf)?;
                    let _ = free_tx.send(buf);
                }
                Ok(())
            });
            let walk = || -> Result<()> {
                for k in ks {
                    let (sub, c) = part(k);
                    if let Some(data) = fast[k].as_mut() {
                        f(sub.clone(), split_planes(data, planes, &c, &sub))?;
                        continue;
                    }
                    let mut buf = read_rx.recv().map_err(|_| reader_gone())??;
                    f(sub.clone(), split_planes(&mut buf, planes, &c, &sub))?;
                    moved += 8 * buf.len() as u64;
                    write_tx.send((k, buf)).map_err(|_| reader_gone())?;
                }
                Ok(())
            };
            let walked = walk();
            drop((read_rx, write_tx));
            let written = writer.join().map_err(|_| reader_gone())?;
            walked.and(written)
        });
        self.moved += moved;
        result
    }

    /// Plane `plane` over the whole index space (reads the slow chunks).
    ///
    /// # Errors
    /// [`OptimError::Offload`] on an I/O error.
    pub fn read_plane(&self, plane: usize) -> Result<Vec<f32>> {
        let n = self.layout.chunks().last().map_or(0, |c| c.end);
        let mut out = Vec::with_capacity(n);
        let mut buf = Vec::new();
        for (k, c) in self.layout.chunks().iter().enumerate() {
            let data = match (&self.fast[k], &self.slow) {
                (Some(d), _) => d,
                (None, Some(slow)) => {
                    buf.resize(self.planes * c.len(), 0.0);
                    slow.read(k, &mut buf)?;
                    &buf
                }
                (None, None) => unreachable!("slow chunks need a slow tier"),
            };
            out.extend_from_slice(&data[plane * c.len()..(plane + 1) * c.len()]);
        }
        Ok(out)
    }

    /// Overwrites plane `plane` with `values` (the whole index space).
    ///
    /// # Errors
    /// [`OptimError::Length`] for the wrong length, [`OptimError::Offload`] on an I/O error.
    pub fn write_plane(&mut self, plane: usize, values: &[f32]) -> Result<()> {
        let n = self.layout.chunks().last().map_or(0, |c| c.end);
        if values.len() != n {
            return Err(OptimError::Length {
                what: "optimizer state array".into(),
                expected: n,
                actual: values.len(),
            });
        }
        self.for_each(0..n, |sub, mut planes| {
            planes[plane].copy_from_slice(&values[sub]);
            Ok(())
        })
    }
}

/// `data` (a chunk `c`'s planes) as the planes over its part `sub`.
fn split_planes<'a>(
    data: &'a mut [f32],
    planes: usize,
    c: &Range<usize>,
    sub: &Range<usize>,
) -> ChunkPlanes<'a> {
    let (len, a, b) = (c.len(), sub.start - c.start, sub.end - c.start);
    data.chunks_mut(len)
        .take(planes)
        .map(|p| &mut p[a..b])
        .collect()
}

fn reader_gone() -> OptimError {
    OptimError::Offload("the offload I/O thread stopped".into())
}

/// An unnamed file in `dir` for the slow tier, after checking `dir` has `need` bytes free.
fn open_slow_tier(dir: &Path, need: u64) -> Result<File> {
    let err = |what: String| OptimError::Offload(format!("offload_path {}: {what}", dir.display()));
    if !dir.is_dir() {
        return Err(err("is not a directory".into()));
    }
    let file = tempfile::tempfile_in(dir).map_err(|e| err(format!("not writable ({e})")))?;
    let free = free_bytes(dir).map_err(|e| err(format!("free space unknown ({e})")))?;
    if free < need {
        return Err(err(format!(
            "{:.2} GiB free, the offloaded optimizer state needs up to {:.2} GiB",
            free as f64 / (1u64 << 30) as f64,
            need as f64 / (1u64 << 30) as f64
        )));
    }
    Ok(file)
}

/// Bytes available to this user on the file system holding `dir` (`statvfs`).
fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is NUL-terminated and `st` is a valid out pointer.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}
