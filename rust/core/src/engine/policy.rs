//! Which state checkpoints a cache keeps and where it writes them (SPEC 13.8). Under `lru`
//! every checkpoint SPEC 13.5 writes stays cached until the pool evicts it (13.7): a
//! checkpoint at `t` serves every later prompt that shares at least `t` tokens with it,
//! wherever that prompt diverges after `t`, so none is dropped on a guess of where prompts
//! will diverge; `reuse` releases one at its request's finish only on what prompts were seen
//! to resume from (below).
//!
//! `reuse` adds, from what the cache sees:
//! - **The sharing grain `S`.** Each prompt admitted with state groups whose full-attention
//!   match stops before the prompt's cap (it left a cached path: a divergence point `d`) is
//!   evidence of where prompts share: `S` is the largest `G * 2^k` (`G` the state grain,
//!   `k <= MAX_LEVEL`) that divides at least 90 % of the divergence points seen, once at least
//!   `MIN_OBSERVATIONS` were seen (before that, and when no level has 90 %, `S = G`).
//! - **The body's end at `S`, written while prompts resume there.** A prompt's body ends at
//!   the last multiple of `S` before its last token (SPEC 13.5b with `S` in place of `G`; `G`
//!   when no multiple of `S` lies ahead). It serves only prompts that diverge before the
//!   request's finish checkpoint, so each hit is attributed to the role of the checkpoint it
//!   resumed at (body end, finish checkpoint, other), and body ends are written until
//!   `MIN_OBSERVATIONS` were written, then while hits per body end written are at least hits
//!   per finish checkpoint left (SPEC 13.8b).
//! - **Finish checkpoints and chunk ends kept while they pay.** At a request's finish, its
//!   finish checkpoint and each of its chunk-end checkpoints (a prompt checkpoint other than
//!   its body end and branch point) still cached are kept until `MIN_OBSERVATIONS` of that
//!   role were kept, then while hits per checkpoint of that role kept are at least hits per
//!   body end written; otherwise released (uncached, the slot back to the pool) (SPEC 13.8b).
//! - **Whole hybrid prefixes** (`prefixes.rs`, kept by the coordinator): a full-attention
//!   page on the path of no cached checkpoint loses its key at its request's finish, or when
//!   the last checkpoint whose path held it leaves the cache.
//!
//! Everything here is O(1) per call (a hash lookup at most); nothing scans the pool.

use std::collections::HashMap;

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

/// Where prompts diverge, and where they resume, as the `reuse` policy saw it so far.
#[derive(Clone, Debug, Default)]
pub struct ReuseEvidence {
    /// Divergence points seen.
    seen: u64,
    /// Of them, the multiples of `G * 2^k`, for `k = 0..=MAX_LEVEL`.
    multiples: [u64; MAX_LEVEL + 1],
    /// The state pages whose checkpoint is a prompt's body end (SPEC 13.5b), a chunk end
    /// (13.5a) or a request's finish checkpoint (13.5d), by role.
    roles: HashMap<u32, Role>,
    /// Body ends written, and prompts that resumed at one.
    body_written: u64,
    body_hits: u64,
    /// Finish checkpoints left, and prompts that resumed at one.
    finish_written: u64,
    finish_hits: u64,
    /// Chunk-end checkpoints kept at their request's finish, and prompts that resumed at one.
    chunk_kept: u64,
    chunk_hits: u64,
}

/// What a checkpoint was written as, for the body-end rule (SPEC 13.8b).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A prompt's body end (SPEC 13.5b).
    Body,
    /// A finished request's last checkpoint (13.5d).
    Finish,
    /// A prompt checkpoint other than its body end and branch point: a chunk end (13.5a).
    Chunk,
    /// Any other checkpoint (a branch point, a decode checkpoint in flight).
    Other,
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

    /// A checkpoint was written on state page `page` as `role`.
    pub fn wrote(&mut self, page: u32, role: Role) {
        match role {
            Role::Body => self.body_written = self.body_written.saturating_add(1),
            Role::Finish => self.finish_written = self.finish_written.saturating_add(1),
            Role::Chunk => {}
            Role::Other => {
                self.roles.remove(&page);
                return;
            }
        }
        self.roles.insert(page, role);
    }

    /// An admitted prompt resumed at the checkpoint on state page `page`.
    pub fn resumed(&mut self, page: u32) {
        match self.roles.get(&page) {
            Some(Role::Body) => self.body_hits = self.body_hits.saturating_add(1),
            Some(Role::Finish) => self.finish_hits = self.finish_hits.saturating_add(1),
            Some(Role::Chunk) => self.chunk_hits = self.chunk_hits.saturating_add(1),
            _ => {}
        }
    }

    /// Whether the checkpoint on state page `page` was written as a chunk end (SPEC 13.8b).
    pub fn is_chunk_end(&self, page: u32) -> bool {
        self.roles.get(&page) == Some(&Role::Chunk)
    }

    /// At a request's finish, whether one of its chunk-end checkpoints still cached is kept
    /// (counted as kept) or released (SPEC 13.8b): kept until `MIN_OBSERVATIONS` were kept,
    /// then while a chunk end kept is resumed from at least as often as a body end written.
    pub fn keep_chunk_end(&mut self) -> bool {
        let keep = pays(self.chunk_kept, self.chunk_hits, self.body_written, self.body_hits);
        if keep {
            self.chunk_kept = self.chunk_kept.saturating_add(1);
        }
        keep
    }

    /// Whether prompts' body ends are checkpointed (SPEC 13.8b): until `MIN_OBSERVATIONS`
    /// were written, and then while a body end written is resumed from at least as often as a
    /// finish checkpoint (the request's other checkpoint past its prompt's last sharing-grain
    /// boundary, which holds the same state memory and serves the prompts that share more).
    pub fn writes_body_end(&self) -> bool {
        pays(self.body_written, self.body_hits, self.finish_written, self.finish_hits)
    }

    /// Body ends written and resumed from; finish checkpoints left and resumed from.
    pub fn resume_counts(&self) -> [u64; 4] {
        [self.body_written, self.body_hits, self.finish_written, self.finish_hits]
    }

    /// At a request's finish, whether its finish checkpoint, still cached, is kept (counted as
    /// left) or released (SPEC 13.8b): kept until `MIN_OBSERVATIONS` were left, then while one
    /// left is resumed from at least as often as a body end written.
    pub fn keep_finish(&self) -> bool {
        pays(self.finish_written, self.finish_hits, self.body_written, self.body_hits)
    }

    /// Chunk ends kept at finish and resumed from.
    pub fn chunk_counts(&self) -> [u64; 2] {
        [self.chunk_kept, self.chunk_hits]
    }
}

/// The rule every role of SPEC 13.8b follows: a role is kept (written) until
/// `MIN_OBSERVATIONS` of it were counted, then while prompts resume at it per checkpoint
/// (`hits / count`) at least as often as at the role it is compared with (`ref_hits /
/// ref_count`); cross-multiplied in `u128`, so nothing overflows or divides by zero.
fn pays(count: u64, hits: u64, ref_count: u64, ref_hits: u64) -> bool {
    count < MIN_OBSERVATIONS || u128::from(hits) * u128::from(ref_count) >= u128::from(ref_hits) * u128::from(count)
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
    fn body_ends_are_written_while_resumed_from_as_often_as_finish_checkpoints() {
        let mut e = ReuseEvidence::default();
        // Until MIN_OBSERVATIONS body ends were written, they are, whatever was resumed.
        for page in 0..15 {
            e.wrote(page, Role::Body);
            e.wrote(100 + page, Role::Finish);
            e.resumed(100 + page);
        }
        assert!(e.writes_body_end(), "fewer than 16 body ends written");
        e.wrote(15, Role::Body);
        // 16 body ends never resumed from, 15 finish checkpoints each resumed from once.
        assert!(!e.writes_body_end());
        // 15 prompts resume at body ends: 15 / 16 < 15 / 15, still not written.
        for page in 0..15 {
            e.resumed(page);
        }
        assert!(!e.writes_body_end());
        e.resumed(15);
        assert!(e.writes_body_end(), "16 / 16 >= 15 / 15");
        // A page that takes another checkpoint has no role; a hit there counts for neither.
        e.wrote(3, Role::Other);
        e.resumed(3);
        e.resumed(999);
        assert_eq!(e.resume_counts(), [16, 16, 15, 15]);
    }

    #[test]
    fn finish_checkpoints_and_chunk_ends_are_kept_while_resumed_from_as_often_as_body_ends() {
        let mut e = ReuseEvidence::default();
        // Two body ends written, one resumed from: 1 / 2 per body end.
        e.wrote(0, Role::Body);
        e.wrote(1, Role::Body);
        e.resumed(0);
        // Until MIN_OBSERVATIONS of a role were kept, they are, whatever was resumed.
        for page in 0..16 {
            assert!(e.keep_finish(), "fewer than 16 finish checkpoints left");
            e.wrote(100 + page, Role::Finish);
            e.wrote(200 + page, Role::Chunk);
            assert!(e.is_chunk_end(200 + page));
            assert!(e.keep_chunk_end(), "fewer than 16 chunk ends kept");
        }
        // 16 of each kept, none resumed from: 0 / 16 < 1 / 2, both released now.
        assert!(!e.keep_finish());
        assert!(!e.keep_chunk_end());
        // 8 prompts resume at each: 8 / 16 >= 1 / 2, both kept again.
        for page in 0..8 {
            e.resumed(100 + page);
            e.resumed(200 + page);
        }
        assert!(e.keep_finish());
        assert!(e.keep_chunk_end());
        assert_eq!(e.chunk_counts(), [17, 8]);
        // A chunk end's page that takes another checkpoint is no chunk end any more.
        e.wrote(200, Role::Other);
        assert!(!e.is_chunk_end(200));
    }
}
