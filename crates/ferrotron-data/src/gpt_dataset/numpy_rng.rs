//! NumPy's legacy `numpy.random.RandomState`, only as far as Megatron uses it: seeding from a
//! 32-bit integer and `shuffle` of a 1-D array. Bit-exact with NumPy (checked against NumPy 2.4
//! in `tests/gpt_dataset_parity.rs`), so document and shuffle indices equal Megatron's.
//!
//! * The generator is MT19937 seeded with `init_genrand(seed)` (NumPy's `mt19937_seed`), with
//!   the standard tempering; 64-bit draws are `(next_u32() << 32) | next_u32()`.
//! * `RandomState.shuffle(x)` is a Fisher-Yates pass `for i in n-1..=1: j = random_interval(i);
//!   swap(x[i], x[j])` where `random_interval(max)` draws `next_u32() & mask` (or a 64-bit draw
//!   when `max > 0xffffffff`), `mask` the smallest all-ones value `>= max`, rejecting values
//!   above `max` (NumPy `legacy-distributions.c` / `distributions.c: random_interval`).

const N: usize = 624;
const M: usize = 397;
const MATRIX_A: u32 = 0x9908_b0df;
const UPPER_MASK: u32 = 0x8000_0000;
const LOWER_MASK: u32 = 0x7fff_ffff;

/// `numpy.random.RandomState(seed)` (MT19937) restricted to what Megatron's datasets call.
#[derive(Clone)]
pub struct RandomState {
    key: [u32; N],
    pos: usize,
}

impl RandomState {
    /// `RandomState(seed)` for an integer seed (NumPy accepts `0..=2**32-1`).
    pub fn new(seed: u32) -> RandomState {
        let mut key = [0u32; N];
        let mut s = seed;
        for (i, k) in key.iter_mut().enumerate() {
            *k = s;
            s = 1_812_433_253u32
                .wrapping_mul(s ^ (s >> 30))
                .wrapping_add(i as u32 + 1);
        }
        RandomState { key, pos: N }
    }

    fn generate(&mut self) {
        let k = &mut self.key;
        for i in 0..N {
            let y = (k[i] & UPPER_MASK) | (k[(i + 1) % N] & LOWER_MASK);
            let mag = if y & 1 == 1 { MATRIX_A } else { 0 };
            k[i] = k[(i + M) % N] ^ (y >> 1) ^ mag;
        }
        self.pos = 0;
    }

    /// The next tempered 32-bit output (`genrand_int32`).
    pub fn next_u32(&mut self) -> u32 {
        if self.pos == N {
            self.generate();
        }
        let mut y = self.key[self.pos];
        self.pos += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// Two 32-bit outputs, the first in the high half (NumPy's `mt19937_next64`).
    pub fn next_u64(&mut self) -> u64 {
        let hi = self.next_u32() as u64;
        (hi << 32) | self.next_u32() as u64
    }

    /// Uniform integer in `0..=max` by masked rejection (NumPy's `random_interval`).
    pub fn random_interval(&mut self, max: u64) -> u64 {
        if max == 0 {
            return 0;
        }
        let mut mask = max;
        mask |= mask >> 1;
        mask |= mask >> 2;
        mask |= mask >> 4;
        mask |= mask >> 8;
        mask |= mask >> 16;
        mask |= mask >> 32;
        loop {
            let value = if max <= 0xffff_ffff {
                self.next_u32() as u64 & mask
            } else {
                self.next_u64() & mask
            };
            if value <= max {
                return value;
            }
        }
    }

    /// `RandomState.shuffle(x)` for a 1-D array: the same permutation NumPy produces for any
    /// element type (NumPy swaps raw items, so the dtype does not change the draws).
    pub fn shuffle<T>(&mut self, x: &mut [T]) {
        for i in (1..x.len()).rev() {
            let j = self.random_interval(i as u64) as usize;
            x.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RandomState;

    #[test]
    fn matches_reference_mt19937_outputs() {
        // First outputs of init_genrand(5489), the reference MT19937 default seed.
        let mut r = RandomState::new(5489);
        let first: Vec<u32> = (0..3).map(|_| r.next_u32()).collect();
        assert_eq!(first, [3_499_211_612, 581_869_302, 3_890_346_734]);
        // The 10000th output of std::mt19937 (C++11 requires this value).
        let mut r = RandomState::new(5489);
        let v = (0..10_000).map(|_| r.next_u32()).last();
        assert_eq!(v, Some(4_123_659_995));
    }
}
