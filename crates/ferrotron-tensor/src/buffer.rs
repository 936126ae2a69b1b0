//! [`Buffer`]: an activation or gradient on a [`Device`] — the storage model code holds and
//! passes between layers, so a device backend replaces the storage, not the model. Kernels
//! stay free functions over slices and reach a buffer's elements only through
//! [`Buffer::host`] / [`Buffer::host_mut`], the explicit (and greppable) places where data
//! must be in host memory. On the CPU, the only device today, these are free.

use crate::Device;

/// `len` elements of `T` on a device, flat (activations are rows `s·b` of a fixed width; the
/// shapes live in the code's docs, as in Megatron's `[s, b, h]` flattened).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Buffer<T> {
    /// The elements, in host memory (`Device::Cpu`).
    host: Vec<T>,
}

impl<T: Copy + Default> Buffer<T> {
    /// `len` zeros on `device`.
    pub fn zeros(device: Device, len: usize) -> Buffer<T> {
        match device {
            Device::Cpu => Buffer {
                host: vec![T::default(); len],
            },
        }
    }
}

impl<T> Buffer<T> {
    /// A CPU buffer holding `values` (no copy).
    pub fn from_host(values: Vec<T>) -> Buffer<T> {
        Buffer { host: values }
    }

    /// Where the elements live.
    pub fn device(&self) -> Device {
        Device::Cpu
    }

    /// Element count.
    pub fn len(&self) -> usize {
        self.host.len()
    }

    /// No elements.
    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// Bytes held (`u128`, so no size overflows a memory ledger).
    pub fn bytes(&self) -> u128 {
        std::mem::size_of_val(self.host.as_slice()) as u128
    }

    /// The elements for a host kernel.
    pub fn host(&self) -> &[T] {
        &self.host
    }

    /// The elements for a host kernel, mutable.
    pub fn host_mut(&mut self) -> &mut [T] {
        &mut self.host
    }

    /// The elements moved to a host vector (no copy on the CPU).
    pub fn into_host(self) -> Vec<T> {
        self.host
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cpu_buffer_is_its_vector() {
        let mut b = Buffer::<f32>::zeros(Device::Cpu, 3);
        assert_eq!((b.len(), b.bytes(), b.device()), (3, 12, Device::Cpu));
        b.host_mut()[1] = 2.0;
        let ptr = b.host().as_ptr();
        let v = b.into_host();
        assert_eq!((v.as_ptr(), v.as_slice()), (ptr, &[0.0, 2.0, 0.0][..]));
        assert!(Buffer::from_host(Vec::<u16>::new()).is_empty());
    }
}
