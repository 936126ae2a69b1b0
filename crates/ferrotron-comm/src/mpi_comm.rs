//! [`MpiComm`]: one process per rank over the system MPI (rsmpi on OpenMPI), started by
//! `mpirun -np N ferrotron ...`.
//!
//! MPI is initialized with `MPI_THREAD_MULTIPLE` (the [`AsyncComm`](crate::AsyncComm)
//! progress thread calls MPI beside the training thread) and finalized when the last
//! communicator is dropped. In-place collectives copy the send side once (rsmpi has no
//! `MPI_IN_PLACE`); bf16 is reduced as f32 (MPI has no bf16 sum). A count above `i32::MAX`
//! elements is an error. A failing rank should call [`MpiComm::abort`], which ends every
//! process of the job (`MPI_Abort`) instead of leaving the others waiting.
//!
//! Point-to-point sends are immediate (`MPI_Isend` from a copy of the buffer), completed in
//! the background of later calls: two ranks sending to each other at once (a pipeline's
//! activation one way, a gradient the other) never wait on each other, whatever the
//! message size and the MPI library's eager limit.

use std::sync::Arc;

use half::bf16;
use std::sync::Mutex;

use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::request::{Request, StaticScope};
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;

use crate::communicator::{
    Communicator as Comm, ElemType, ReduceOp, check_rank, chunk_len, deliver,
};
use crate::error::{CommError, Result, mismatch};

/// One MPI communicator (the world or a split of it).
pub struct MpiComm {
    comm: SimpleCommunicator,
    /// Immediate sends still in flight, each with the copy of its buffer.
    sends: Mutex<Vec<PendingSend>>,
    _universe: Arc<Universe>,
}

/// An `MPI_Isend` and the leaked copy of its buffer (freed once the send completes).
struct PendingSend {
    request: Option<Request<'static, [u8], StaticScope>>,
    buf: *mut [u8],
}

// SAFETY: the buffer is owned by the PendingSend alone (leaked from a Box) and MPI is
// initialized with MPI_THREAD_MULTIPLE.
unsafe impl Send for PendingSend {}

impl PendingSend {
    /// Completes the send when it is done (or waits for it with `wait`); returns the still
    /// pending send otherwise.
    fn complete(mut self, wait: bool) -> Option<PendingSend> {
        let request = self.request.take()?;
        match (wait, request) {
            (true, r) => {
                r.wait();
            }
            (false, r) => {
                if let Err(r) = r.test() {
                    self.request = Some(r);
                    return Some(self);
                }
            }
        }
        // SAFETY: `buf` came from Box::leak in `send_bytes`; the send using it completed.
        drop(unsafe { Box::from_raw(self.buf) });
        None
    }
}

// SAFETY: MPI is initialized with MPI_THREAD_MULTIPLE (checked in `world`), so any thread may
// call MPI on any communicator; rsmpi's handle is a plain MPI_Comm.
unsafe impl Send for MpiComm {}
unsafe impl Sync for MpiComm {}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MpiComm(rank {} of {})",
            self.comm.rank(),
            self.comm.size()
        )
    }
}

impl MpiComm {
    /// Initializes MPI and returns `MPI_COMM_WORLD`.
    ///
    /// # Errors
    /// MPI was already initialized, or it does not provide `MPI_THREAD_MULTIPLE`.
    pub fn world() -> Result<MpiComm> {
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Multiple)
            .ok_or_else(|| CommError::Mpi("MPI was already initialized in this process".into()))?;
        if threading != mpi::Threading::Multiple {
            return Err(CommError::Mpi(format!(
                "the MPI library provides threading level {threading:?}, Ferrotron needs \
                 Multiple (OpenMPI built with thread support)"
            )));
        }
        Ok(MpiComm {
            comm: universe.world(),
            sends: Mutex::default(),
            _universe: Arc::new(universe),
        })
    }

    /// True when this process was started by an MPI launcher (`mpirun`/`srun` set these).
    pub fn launched_by_mpirun() -> bool {
        ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
            .iter()
            .any(|v| std::env::var_os(v).is_some())
    }

    /// Ends every process of the job with `code` (`MPI_Abort`).
    pub fn abort(&self, code: i32) -> ! {
        self.comm.abort(code)
    }

    /// Frees the immediate sends that have completed (all of them, waiting, with `wait`).
    fn progress_sends(&self, wait: bool) {
        let mut sends = self
            .sends
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let pending = std::mem::take(&mut *sends);
        *sends = pending
            .into_iter()
            .filter_map(|p| p.complete(wait))
            .collect();
    }
}

impl Drop for MpiComm {
    /// Waits for the sends still in flight (their buffers must outlive them).
    fn drop(&mut self) {
        self.progress_sends(true);
    }
}

fn count(op: &'static str, n: usize) -> Result<()> {
    if n > i32::MAX as usize {
        return Err(mismatch(
            op,
            format!("{n} elements exceed MPI's count limit"),
        ));
    }
    Ok(())
}

fn system_op(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => SystemOperation::sum(),
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::Min => SystemOperation::min(),
    }
}

/// Typed in-place all-reduce on bytes that hold whole `T`s.
fn all_reduce_typed<T>(c: &SimpleCommunicator, buf: &mut [u8], op: ReduceOp) -> Result<()>
where
    T: bytemuck::Pod + Equivalence + std::ops::DivAssign + From<u16>,
{
    let mut values: Vec<T> = bytemuck::pod_collect_to_vec(buf);
    count("all_reduce", values.len())?;
    let send = values.clone();
    c.all_reduce_into(&send[..], &mut values[..], system_op(op));
    if op == ReduceOp::Avg {
        let n = T::from(c.size() as u16);
        values.iter_mut().for_each(|v| *v /= n);
    }
    buf.copy_from_slice(bytemuck::cast_slice(&values));
    Ok(())
}

fn reduce_scatter_typed<T>(c: &SimpleCommunicator, buf: &mut [u8], op: ReduceOp) -> Result<()>
where
    T: bytemuck::Pod + Equivalence + std::ops::DivAssign + From<u16>,
{
    let send: Vec<T> = bytemuck::pod_collect_to_vec(buf);
    count("reduce_scatter", send.len())?;
    let (n, r) = (c.size() as usize, c.rank() as usize);
    let chunk = send.len() / n;
    let mut out = vec![T::zeroed(); chunk];
    c.reduce_scatter_block_into(&send[..], &mut out[..], system_op(op));
    if op == ReduceOp::Avg {
        let k = T::from(n as u16);
        out.iter_mut().for_each(|v| *v /= k);
    }
    let bytes = chunk * std::mem::size_of::<T>();
    buf[r * bytes..(r + 1) * bytes].copy_from_slice(bytemuck::cast_slice(&out));
    Ok(())
}

/// bf16 reduced as f32 (widened exactly, rounded once).
fn widened_bf16(buf: &mut [u8], f: impl FnOnce(&mut [u8]) -> Result<()>) -> Result<()> {
    let narrow: Vec<bf16> = bytemuck::pod_collect_to_vec(buf);
    let mut wide: Vec<f32> = narrow.iter().map(|v| v.to_f32()).collect();
    f(bytemuck::cast_slice_mut(&mut wide))?;
    let back: Vec<bf16> = wide.iter().map(|&v| bf16::from_f32(v)).collect();
    buf.copy_from_slice(bytemuck::cast_slice(&back));
    Ok(())
}

impl Comm for MpiComm {
    fn rank(&self) -> usize {
        self.comm.rank() as usize
    }

    fn size(&self) -> usize {
        self.comm.size() as usize
    }

    fn all_reduce_bytes(&self, buf: &mut [u8], ty: ElemType, op: ReduceOp) -> Result<()> {
        chunk_len("all_reduce", buf.len(), 1, ty)?;
        let c = &self.comm;
        match ty {
            ElemType::F32 => all_reduce_typed::<f32>(c, buf, op),
            ElemType::F64 => all_reduce_typed::<f64>(c, buf, op),
            ElemType::Bf16 => widened_bf16(buf, |w| all_reduce_typed::<f32>(c, w, op)),
            ElemType::U8 => Err(mismatch("all_reduce", "u8 buffers cannot be reduced")),
        }
    }

    fn reduce_scatter_bytes(&self, buf: &mut [u8], ty: ElemType, op: ReduceOp) -> Result<()> {
        chunk_len("reduce_scatter", buf.len(), self.size(), ty)?;
        let c = &self.comm;
        match ty {
            ElemType::F32 => reduce_scatter_typed::<f32>(c, buf, op),
            ElemType::F64 => reduce_scatter_typed::<f64>(c, buf, op),
            ElemType::Bf16 => widened_bf16(buf, |w| reduce_scatter_typed::<f32>(c, w, op)),
            ElemType::U8 => Err(mismatch("reduce_scatter", "u8 buffers cannot be reduced")),
        }
    }

    fn all_gather_bytes(&self, buf: &mut [u8]) -> Result<()> {
        let chunk = chunk_len("all_gather", buf.len(), self.size(), ElemType::U8)?;
        count("all_gather", buf.len())?;
        let r = self.rank();
        let send = buf[r * chunk..(r + 1) * chunk].to_vec();
        self.comm.all_gather_into(&send[..], buf);
        Ok(())
    }

    fn broadcast_bytes(&self, buf: &mut [u8], root: usize) -> Result<()> {
        check_rank("broadcast", root, self.size())?;
        count("broadcast", buf.len())?;
        self.comm.process_at_rank(root as i32).broadcast_into(buf);
        Ok(())
    }

    fn all_to_all_bytes(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        chunk_len("all_to_all", input.len(), self.size(), ElemType::U8)?;
        if output.len() != input.len() {
            return Err(mismatch(
                "all_to_all",
                format!("output of {} bytes, input of {}", output.len(), input.len()),
            ));
        }
        count("all_to_all", input.len())?;
        self.comm.all_to_all_into(input, output);
        Ok(())
    }

    fn send_bytes(&self, buf: &[u8], dest: usize) -> Result<()> {
        check_rank("send", dest, self.size())?;
        count("send", buf.len())?;
        self.progress_sends(false);
        let copy: &'static mut [u8] = Box::leak(buf.to_vec().into_boxed_slice());
        let ptr: *mut [u8] = copy;
        // SAFETY: the leaked copy lives until `PendingSend::complete` frees it after the send.
        let data: &'static [u8] = unsafe { &*ptr };
        let request = self
            .comm
            .process_at_rank(dest as i32)
            .immediate_send(StaticScope, data);
        self.sends
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(PendingSend {
                request: Some(request),
                buf: ptr,
            });
        Ok(())
    }

    fn recv_bytes(&self, buf: &mut [u8], src: usize) -> Result<()> {
        check_rank("recv", src, self.size())?;
        self.progress_sends(false);
        let (msg, _status) = self.comm.process_at_rank(src as i32).receive_vec::<u8>();
        deliver(&msg, buf, src)
    }

    fn barrier(&self) -> Result<()> {
        self.comm.barrier();
        Ok(())
    }

    fn split(&self, color: Option<usize>, key: usize) -> Result<Option<Arc<dyn Comm>>> {
        let color = match color {
            Some(c) => Color::with_value(
                i32::try_from(c).map_err(|_| CommError::Mpi(format!("color {c} too large")))?,
            ),
            None => Color::undefined(),
        };
        let key = i32::try_from(key).map_err(|_| CommError::Mpi(format!("key {key} too large")))?;
        Ok(self.comm.split_by_color_with_key(color, key).map(|comm| {
            Arc::new(MpiComm {
                comm,
                sends: Mutex::default(),
                _universe: self._universe.clone(),
            }) as Arc<dyn Comm>
        }))
    }
}
