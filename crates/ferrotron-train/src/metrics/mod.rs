//! Sinks for the training loop's reports ([`TrainLog`](crate::trainer::TrainLog)): a
//! TensorBoard event file ([`TensorBoardWriter`]) and a loss-curve PNG ([`LossPlot`]).
//!
//! Both take one report at a time through `record(&mut self, &TrainLog) -> io::Result<()>`,
//! so the `on_log` callback of [`Trainer::train`](crate::trainer::Trainer::train) can feed
//! them directly; both leave a consistent file after every call (the event file is flushed,
//! the PNG is replaced atomically).
//!
//! | here | mirrors |
//! |---|---|
//! | [`TensorBoardWriter`] | `torch.utils.tensorboard.SummaryWriter.add_scalar` as Megatron-LM's `training_log` / `evaluate_and_print_results` call it |
//! | [`tfrecord`] | TensorFlow's `RecordWriter` framing (masked CRC32C) |
//! | [`Event`] | the `tensorflow.Event` / `Summary` protobuf fields of scalar summaries |
//! | [`LossPlot`] | the loss curve (no Megatron counterpart) |

mod event;
mod loss_plot;
mod tensorboard;
pub mod tfrecord;

pub use event::{Event, EventData, Scalar};
pub use loss_plot::{FONT, LossPlot, register_font, write_png};
pub use tensorboard::{
    FILE_VERSION, TensorBoardWriter, event_file_name, megatron_scalars, read_event_file,
};
