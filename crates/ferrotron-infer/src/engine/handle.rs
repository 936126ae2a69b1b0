//! An [`Engine`] on its own thread (vLLM's engine-core process): callers on any thread submit
//! requests with a sink for their outputs and cancel them; the thread steps while anything is
//! in flight and sleeps on its queue otherwise.

use super::RequestOutput;
use super::{Engine, EngineError, EngineStats, OutputSink, Request, RequestId, RequestLimits};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

enum Command {
    Add(Request, OutputSink),
    Abort(RequestId),
    /// Finish what is in flight, then stop.
    Drain,
}

/// A running engine thread.
pub struct EngineHandle {
    tx: Mutex<Sender<Command>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    stats: Arc<EngineStats>,
    limits: RequestLimits,
    next_id: AtomicU64,
}

impl EngineHandle {
    /// Starts `engine` on a new thread named `ferrotron-engine`.
    ///
    /// # Errors
    /// The thread could not be spawned.
    pub fn spawn(engine: Engine) -> std::io::Result<EngineHandle> {
        let (tx, rx) = channel();
        let (stats, limits) = (engine.stats(), engine.limits());
        let thread = std::thread::Builder::new()
            .name("ferrotron-engine".into())
            .spawn(move || run(engine, rx))?;
        Ok(EngineHandle {
            tx: Mutex::new(tx),
            thread: Mutex::new(Some(thread)),
            stats,
            limits,
            next_id: AtomicU64::new(0),
        })
    }

    /// A fresh request id.
    pub fn next_request_id(&self) -> RequestId {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// What requests are checked against.
    pub fn limits(&self) -> RequestLimits {
        self.limits
    }

    /// The engine's counters and gauges.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Checks and queues `request`; its outputs go to `sink` from the engine thread.
    ///
    /// # Errors
    /// A request [`RequestLimits::check`] rejects, or an engine that has stopped.
    pub fn submit(&self, request: Request, sink: OutputSink) -> Result<(), EngineError> {
        self.limits.check(&request)?;
        self.send(Command::Add(request, sink))
    }

    /// Cancels request `id` if it is still in flight (its sink hears nothing more).
    pub fn abort(&self, id: RequestId) {
        let _ = self.send(Command::Abort(id));
    }

    /// Lets the requests in flight finish, then stops the thread and waits for it.
    pub fn shutdown(&self) {
        let _ = self.send(Command::Drain);
        if let Some(t) = self.thread.lock().expect("engine handle lock").take() {
            let _ = t.join();
        }
    }

    fn send(&self, cmd: Command) -> Result<(), EngineError> {
        let tx = self.tx.lock().expect("engine handle lock");
        tx.send(cmd)
            .map_err(|_| EngineError::Request("the engine has stopped".into()))
    }
}

/// The engine thread: applies commands, steps while there is work, sleeps when idle.
fn run(mut engine: Engine, rx: Receiver<Command>) {
    let mut draining = false;
    loop {
        if !engine.has_work() {
            if draining {
                return;
            }
            match rx.recv() {
                Ok(cmd) => apply(&mut engine, cmd, &mut draining),
                Err(_) => return,
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            apply(&mut engine, cmd, &mut draining);
        }
        // A failed or panicking step ends the requests in flight, not the engine thread
        // (whose callers would otherwise wait forever).
        let step = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.step()));
        let error = match step {
            Ok(Ok(_)) => continue,
            Ok(Err(e)) => e.to_string(),
            Err(panic) => panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic".into()),
        };
        eprintln!("ferrotron engine: step failed, aborting the requests in flight: {error}");
        engine.abort_all();
    }
}

fn apply(engine: &mut Engine, cmd: Command, draining: &mut bool) {
    match cmd {
        Command::Add(request, mut sink) => {
            if let Err(e) = engine.check(&request) {
                eprintln!("ferrotron engine: request {} refused: {e}", request.id);
                let _ = sink(RequestOutput::refused(&request));
            } else {
                engine.add_request(request, sink).expect("checked");
            }
        }
        Command::Abort(id) => {
            engine.abort(id);
        }
        Command::Drain => *draining = true,
    }
}
