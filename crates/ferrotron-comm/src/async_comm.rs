//! Non-blocking collectives: [`AsyncComm`] runs a group's collectives on its own progress
//! thread, in the order they were issued, and returns a [`CommHandle`] per call
//! (`torch.distributed`'s `async_op=True` and its `Work.wait()`), so a rank computes while its
//! communication runs.
//!
//! Buffers are moved into the call and handed back by [`CommHandle::wait`]: nothing can touch
//! a buffer while it is being communicated. Every rank must issue the same collectives in the
//! same order on its `AsyncComm`; do not mix them with blocking calls on the same group while
//! handles are pending.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use crate::communicator::{Collectives, Communicator, Element, ReduceOp};
use crate::error::{CommError, Result};

type Job = Box<dyn FnOnce(&dyn Communicator) + Send>;

/// A group with a progress thread for non-blocking collectives.
pub struct AsyncComm {
    comm: Arc<dyn Communicator>,
    jobs: Option<Sender<Job>>,
    worker: Option<JoinHandle<()>>,
}

/// The pending result of a non-blocking call.
#[must_use = "a collective's buffer comes back only through wait()"]
pub struct CommHandle<T> {
    result: Receiver<Result<T>>,
}

impl<T> CommHandle<T> {
    /// Blocks until the call finished; returns its buffer(s).
    ///
    /// # Errors
    /// The collective's error (e.g. another rank failed).
    pub fn wait(self) -> Result<T> {
        self.result.recv().unwrap_or_else(|_| {
            Err(CommError::Mpi(
                "the communication thread stopped before finishing the call".into(),
            ))
        })
    }
}

impl AsyncComm {
    /// Starts the progress thread for `comm`.
    ///
    /// # Errors
    /// The thread could not be spawned.
    pub fn new(comm: Arc<dyn Communicator>) -> Result<Self> {
        let (tx, rx) = channel::<Job>();
        let c = comm.clone();
        let worker = std::thread::Builder::new()
            .name(format!("comm-{}of{}", comm.rank(), comm.size()))
            .spawn(move || {
                for job in rx {
                    job(c.as_ref());
                }
            })
            .map_err(|e| CommError::Mpi(format!("spawning the communication thread: {e}")))?;
        Ok(AsyncComm {
            comm,
            jobs: Some(tx),
            worker: Some(worker),
        })
    }

    /// The group.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// Runs `f` on the progress thread after every call issued before it.
    pub fn submit<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn Communicator) -> Result<T> + Send + 'static,
    ) -> CommHandle<T> {
        let (tx, rx) = channel();
        let job: Job = Box::new(move |c| {
            let _ = tx.send(f(c));
        });
        if let Some(jobs) = &self.jobs {
            // A send error means the worker is gone; the handle then reports it.
            let _ = jobs.send(job);
        }
        CommHandle { result: rx }
    }

    /// Non-blocking [`Collectives::all_reduce`].
    pub fn all_reduce<T: Element + 'static>(
        &self,
        mut buf: Vec<T>,
        op: ReduceOp,
    ) -> CommHandle<Vec<T>> {
        self.submit(move |c| c.all_reduce(&mut buf, op).map(|()| buf))
    }

    /// Non-blocking [`Collectives::reduce_scatter_in_place`].
    pub fn reduce_scatter_in_place<T: Element + 'static>(
        &self,
        mut buf: Vec<T>,
        op: ReduceOp,
    ) -> CommHandle<Vec<T>> {
        self.submit(move |c| c.reduce_scatter_in_place(&mut buf, op).map(|()| buf))
    }

    /// Non-blocking [`Collectives::all_gather_in_place`].
    pub fn all_gather_in_place<T: Element + 'static>(&self, mut buf: Vec<T>) -> CommHandle<Vec<T>> {
        self.submit(move |c| c.all_gather_in_place(&mut buf).map(|()| buf))
    }
}

impl Drop for AsyncComm {
    /// Finishes the calls already issued, then stops the thread.
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}
