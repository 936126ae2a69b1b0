//! [`SingleRankComm`]: the group of one rank, so single-rank code runs the same path.

use std::sync::Arc;

use crate::communicator::{Communicator, ElemType, ReduceOp};
use crate::error::{CommError, Result};

/// The communicator of a one-rank group: collectives return their input, point-to-point
/// calls are errors (there is no peer).
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleRankComm;

impl Communicator for SingleRankComm {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_bytes(&self, _: &mut [u8], _: ElemType, _: ReduceOp) -> Result<()> {
        Ok(())
    }
    fn reduce_scatter_bytes(&self, _: &mut [u8], _: ElemType, _: ReduceOp) -> Result<()> {
        Ok(())
    }
    fn all_gather_bytes(&self, _: &mut [u8]) -> Result<()> {
        Ok(())
    }
    fn broadcast_bytes(&self, _: &mut [u8], _: usize) -> Result<()> {
        Ok(())
    }
    fn all_to_all_bytes(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        output.copy_from_slice(input);
        Ok(())
    }
    fn send_bytes(&self, _: &[u8], dest: usize) -> Result<()> {
        Err(CommError::Rank {
            op: "send",
            rank: dest,
            size: 1,
        })
    }
    fn recv_bytes(&self, _: &mut [u8], src: usize) -> Result<()> {
        Err(CommError::Rank {
            op: "recv",
            rank: src,
            size: 1,
        })
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn split(&self, color: Option<usize>, _: usize) -> Result<Option<Arc<dyn Communicator>>> {
        Ok(color.map(|_| Arc::new(SingleRankComm) as Arc<dyn Communicator>))
    }
}
