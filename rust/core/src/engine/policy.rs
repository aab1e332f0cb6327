//! Which state checkpoints a cache keeps and where it writes them (SPEC 13.8). Under both
//! policies every checkpoint SPEC 13.5 writes stays cached until the pool evicts it (13.7):
//! a checkpoint at `t` serves every later prompt that shares at least `t` tokens with it,
//! wherever that prompt diverges after `t`, so none is dropped on a guess of where prompts
//! will diverge; eviction, which sees memory pressure, is the one place checkpoints leave.
//!
//! `reuse` adds, from what the cache sees:
//! - **The sharing grain `S`.** Each prompt admitted with state groups whose full-attention
//!   match stops before the prompt's cap (it left a cached path: a divergence point `d`) is
//!   evidence of where prompts share: `S` is the largest `G * 2^k` (`G` the state grain,
//!   `k <= MAX_LEVEL`) that divides at least 90 % of the divergence points seen, once at least
//!   `MIN_OBSERVATIONS` were seen (before that, and when no level has 90 %, `S = G`).
//! - **The body's end at `S`.** A prompt's body ends at the last multiple of `S` before its
//!   last token (SPEC 13.5b with `S` in place of `G`; `G` when no multiple of `S` lies ahead).
//! - **Whole hybrid prefixes** (`prefixes.rs`, kept by the coordinator): a full-attention
//!   page on the path of no cached checkpoint loses its key at its request's finish, or when
//!   the last checkpoint whose path held it leaves the cache.
//!
//! Everything here is O(1) per call; nothing scans the pool.

/// Divergence points needed before the sharing grain moves from `G`.
pub const MIN_OBSERVATIONS: u64 = 16;
/// The largest sharing grain is `G * 2^MAX_LEVEL`.
pub const MAX_LEVEL: usize = 6;

/// Which checkpoints are kept (the `eviction_policy` option).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EvictionPolicy {
    /// Every checkpoint SPEC 13.5 writes is kept until the pool evicts it, oldest first.
    #[default]
    Lru,
    /// Checkpoints are written where prompts are seen to diverge (module doc).
    Reuse,
}

impl EvictionPolicy {
    /// The policy named `name` (`"lru"` or `"reuse"`).
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "lru" => Some(Self::Lru),
            "reuse" => Some(Self::Reuse),
            _ => None,
        }
    }

    /// The policy's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Lru => "lru",
            Self::Reuse => "reuse",
        }
    }
}

/// Where prompts diverge, as the `reuse` policy saw it so far.
#[derive(Clone, Debug, Default)]
pub struct ReuseEvidence {
    /// Divergence points seen.
    seen: u64,
    /// Of them, the multiples of `G * 2^k`, for `k = 0..=MAX_LEVEL`.
    multiples: [u64; MAX_LEVEL + 1],
}

impl ReuseEvidence {
    /// Record divergence point `d` (tokens, > 0) of a state grain `grain`.
    pub fn observe(&mut self, d: u64, grain: u64) {
        self.seen = self.seen.saturating_add(1);
        let mut unit = grain;
        for count in &mut self.multiples {
            if d % unit != 0 {
                break;
            }
            *count = count.saturating_add(1);
            match unit.checked_mul(2) {
                Some(next) => unit = next,
                None => break,
            }
        }
    }

    /// The sharing grain `S` for a state grain `grain` (module doc).
    pub fn sharing_grain(&self, grain: u64) -> u64 {
        if self.seen < MIN_OBSERVATIONS {
            return grain;
        }
        let mut best = grain;
        let mut unit = grain;
        for &count in &self.multiples {
            // count / seen >= 9 / 10, in integers (both < 2^64, the products fit u128).
            if u128::from(count) * 10 < u128::from(self.seen) * 9 {
                break;
            }
            best = unit;
            match unit.checked_mul(2) {
                Some(next) => unit = next,
                None => break,
            }
        }
        best
    }

    /// Divergence points seen.
    pub fn observations(&self) -> u64 {
        self.seen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for p in [EvictionPolicy::Lru, EvictionPolicy::Reuse] {
            assert_eq!(EvictionPolicy::from_name(p.name()), Some(p));
        }
        assert_eq!(EvictionPolicy::from_name("LRU"), None);
    }

    #[test]
    fn the_sharing_grain_is_the_coarsest_that_divides_nine_in_ten() {
        let mut e = ReuseEvidence::default();
        for _ in 0..15 {
            e.observe(512, 64);
        }
        assert_eq!(e.sharing_grain(64), 64, "fewer than 16 observations");
        e.observe(1536, 64);
        // 16 points, every one a multiple of 512, none of 1024.
        assert_eq!(e.sharing_grain(64), 512);
        // Two points at 64 of 18: 16 / 18 < 0.9 at 128, so S falls back to 64.
        e.observe(64, 64);
        e.observe(192, 64);
        assert_eq!(e.sharing_grain(64), 64);
    }
}
