//! Which state checkpoints a cache keeps (SPEC 13.8): `lru`, today's rules (every checkpoint
//! SPEC 13.5 writes stays until the pool evicts it, oldest first), or `reuse`, which keeps a
//! checkpoint only where reuse is likely and learns where that is from the prompts it sees.
//!
//! The `reuse` policy:
//! - **The sharing grain `S`.** Each prompt admitted with state groups whose full-attention
//!   match stops before the prompt's cap (it left a cached path: a divergence point `d`) is
//!   evidence of where prompts share: `S` is the largest `G * 2^k` (`G` the state grain,
//!   `k <= MAX_LEVEL`) that divides at least 90 % of the divergence points seen, once at least
//!   `MIN_OBSERVATIONS` were seen (before that, and when no level has 90 %, `S = G`).
//! - **The body's end at `S`.** A prompt's body ends at the last multiple of `S` before its
//!   last token (SPEC 13.5b with `S` in place of `G`; `G` when no multiple of `S` lies ahead).
//! - **Probationary prompt checkpoints.** When a request finishes, its prompt checkpoints are
//!   dropped if nobody holds them (a request that hit one holds it), except its branch point
//!   (13.5c) and its last one when that is a multiple of `S` (the body's end, or the last
//!   chunk's end): the next turn of a conversation resumes at the last, a branching prompt at
//!   the branch point, and an earlier chunk's end (13.5a) serves only a prompt that diverges
//!   exactly there while costing a whole state checkpoint.
//! - **Decode checkpoints on evidence.** When a request finishes, its latest decode checkpoint
//!   (13.5d) is kept if a kept decode checkpoint was ever hit, and otherwise only by the
//!   requests that have one whose count is a power of two (1st, 2nd, 4th, 8th, ...: probes
//!   that gather the evidence and back off while none is hit, so a workload whose outputs
//!   never come back pays for a logarithmic number of them); the others are dropped. A
//!   preempted request keeps everything (it comes back for it).
//! - **Whole hybrid prefixes** (`prefixes.rs`, kept by the coordinator): a full-attention
//!   page on the path of no cached checkpoint loses its key at its request's finish, or when
//!   the last checkpoint whose path held it leaves the cache.
//!
//! Everything here is O(1) per call; nothing scans the pool.

use hashbrown::HashMap;
use rustc_hash::FxBuildHasher;

use crate::engine::hash::GroupKey;

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
    /// Checkpoints are kept where reuse is likely (module doc).
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

/// What the `reuse` policy learned so far.
#[derive(Clone, Debug, Default)]
pub struct ReuseEvidence {
    /// Divergence points seen.
    seen: u64,
    /// Of them, the multiples of `G * 2^k`, for `k = 0..=MAX_LEVEL`.
    multiples: [u64; MAX_LEVEL + 1],
    /// Finished requests that had a decode checkpoint.
    decode_seen: u64,
    /// Hits on kept decode checkpoints.
    decode_hits: u64,
    /// Kept decode checkpoints by page (the key tells a page that was handed out since).
    decode_keys: HashMap<u32, GroupKey, FxBuildHasher>,
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

    /// A prefix hit restored the checkpoint `key` in `page`: evidence if it is a kept decode
    /// checkpoint.
    pub fn note_hit(&mut self, page: u32, key: &GroupKey) {
        if self.decode_keys.get(&page) == Some(key) {
            self.decode_hits = self.decode_hits.saturating_add(1);
        }
    }

    /// Whether a finishing request keeps its decode checkpoint (counts the request): always
    /// once a kept one was hit, before that only the probes (the `n`-th such request for `n` a
    /// power of two).
    pub fn keep_decode(&mut self) -> bool {
        self.decode_seen = self.decode_seen.saturating_add(1);
        self.decode_hits > 0 || self.decode_seen.is_power_of_two()
    }

    /// Remember that decode checkpoint `key` in `page` was kept.
    pub fn kept_decode(&mut self, page: u32, key: GroupKey) {
        self.decode_keys.insert(page, key);
    }

    /// Hits on kept decode checkpoints.
    pub fn decode_hits(&self) -> u64 {
        self.decode_hits
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

    #[test]
    fn decode_checkpoints_are_kept_on_probes_then_on_evidence() {
        let mut e = ReuseEvidence::default();
        let kept: Vec<usize> = (1..=100).filter(|_| e.keep_decode()).collect();
        assert_eq!(kept, [1, 2, 4, 8, 16, 32, 64], "the probes back off while none is hit");
        let key = GroupKey::new([7; 32], 0);
        e.kept_decode(5, key);
        e.note_hit(5, &GroupKey::new([8; 32], 0));
        assert_eq!(e.decode_hits(), 0, "another key in the page is no evidence");
        e.note_hit(5, &key);
        assert_eq!(e.decode_hits(), 1);
        assert!((0..5).all(|_| e.keep_decode()));
    }
}
