//! A tiny deterministic PRNG (SplitMix64). The core needs randomness only to spread election
//! timeouts; taking it from `Config::seed` keeps every run reproducible.

#[derive(Debug, Clone)]
pub struct Prng {
    state: u64,
}

impl Prng {
    pub fn new(seed: u64) -> Self {
        Prng { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A value in `[low, high)`. `high` must exceed `low`.
    pub fn range(&mut self, low: u64, high: u64) -> u64 {
        assert!(high > low, "empty range [{low}, {high})");
        low + self.next_u64() % (high - low)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence_and_values_stay_in_range() {
        let mut a = Prng::new(7);
        let mut b = Prng::new(7);
        for _ in 0..1000 {
            let x = a.range(10, 20);
            assert_eq!(x, b.range(10, 20));
            assert!((10..20).contains(&x));
        }
        assert_ne!(Prng::new(1).next_u64(), Prng::new(2).next_u64());
    }
}
