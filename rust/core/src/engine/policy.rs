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
//!   resumed at (body end, finish checkpoint or its ghost, chunk end, other; a checkpoint
//!   counts at its first resume only, [`ReuseEvidence::resumed`]), and body ends
//!   are written until `MIN_OBSERVATIONS` were written, then while hits per body end written
//!   are at least hits per finish checkpoint left and at least what an eviction costs
//!   (`H_B >= p_M * min(N_B, E)`, `p_M` and `E` below) (SPEC 13.8b).
//! - **Finish checkpoints kept while they serve more prompts than the evictions they cause.**
//!   A finish checkpoint not kept leaves a ghost (its boundary's base-page hash), and so does
//!   every checkpoint the pool evicts other than one of the finish role (decode checkpoints
//!   and the finish checkpoints they become) (an evicted ghost); an admitted prompt that
//!   reaches a ghost past its hit is a hit for finish checkpoints, or for the memory an
//!   eviction took. At its finish a request's finish checkpoint (in decode, its decode
//!   checkpoint) is kept until `MIN_OBSERVATIONS` were left, then while finish hits `H_F > 0`
//!   and `H_F >= p_M * C`: `p_M` the prompts that reached an evicted ghost per such eviction,
//!   `C` the evictions of other roles' checkpoints the finish role caused (each such eviction
//!   times the role's share of the cached checkpoints then; the role's own checkpoints evicted
//!   cost no other prompt).
//! - **Decode checkpoints dated at their request's decode start** (arena storage; done by
//!   `calls/token.rs` through the pool's `date`): each decode checkpoint after a request's
//!   first takes the first one's eviction stamp, a kept finish checkpoint is dated at the
//!   finish, so decoding requests' checkpoints do not stay the newest through the decode.
//! - **Chunk ends kept while they pay.** At a request's finish each of its chunk-end
//!   checkpoints (a prompt checkpoint other than its body end and branch point) still cached
//!   is kept until `MIN_OBSERVATIONS` were kept, then while hits per chunk end kept are at
//!   least hits per body end written; otherwise released (uncached, the slot back to the pool).
//! - **A checkpoint counts for its role at its first resume only**: a shared prefix's later
//!   resumes come whether or not more checkpoints of its role are written
//!   ([`ReuseEvidence::resumed`]).
//! - Every count the rules compare decays by `1 - 1/slots` per admitted prompt (`slots` the
//!   state pages the pool holds), so the rules follow what the cache sees now.
//! - **Whole hybrid prefixes** (`prefixes.rs`, kept by the coordinator): a full-attention
//!   page on the path of no cached checkpoint loses its key at its request's finish, or when
//!   the last checkpoint whose path held it leaves the cache.
//!
//! Everything here is O(1) per call (a hash lookup or insert at most), but
//! [`ReuseEvidence::ghost_resumed`], one lookup per state-grain boundary between a prompt's hit
//! and its cap; nothing scans the pool.

use std::collections::VecDeque;

use hashbrown::{HashMap, HashSet};
use rustc_hash::FxBuildHasher;

use crate::engine::hash::{ContentHash, GroupKey};

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
    roles: HashMap<u32, Role, FxBuildHasher>,
    /// The state pages of `roles` whose checkpoint a prompt has resumed at since it was
    /// written: only a checkpoint's first resume counts for its role (SPEC 13.8b).
    served: HashSet<u32, FxBuildHasher>,
    /// Body ends written, and prompts that resumed at one.
    body_written: u64,
    body_hits: u64,
    /// Finish checkpoints left, and prompts that resumed at one.
    finish_written: u64,
    finish_hits: u64,
    /// Chunk-end checkpoints kept at their request's finish, and prompts that resumed at one.
    chunk_kept: u64,
    chunk_hits: u64,
    /// Ghosts: finish checkpoints not kept, by the base-page hash of their boundary.
    ghosts: Ghosts,
    /// Cached checkpoints by key: the base-page hash of their boundary and whether it is of
    /// the finish role (a decode checkpoint, kept or not yet at its finish), so that one the
    /// pool evicts leaves a ghost in `evicted`.
    boundary: HashMap<GroupKey, (ContentHash, bool), FxBuildHasher>,
    /// Ghosts of evicted checkpoints (not of the finish role): a prompt that reaches one
    /// past its hit is a prompt a slot more of cache would have served.
    evicted: Ghosts,
    /// The counts the rules compare, decayed by [`Self::decay`] at each admitted prompt
    /// (indexed by `BODY_N` .. `CAUSED`); the counts above decide the warm-up.
    recent: [f64; 9],
    /// Cached checkpoints in the finish role (decode checkpoints and kept finish checkpoints).
    finish_cached: usize,
}

// Where each decayed count sits in `ReuseEvidence::recent`.
/// Body ends written.
const BODY_N: usize = 0;
/// Prompts resumed at a body end.
const BODY_HITS: usize = 1;
/// Finish checkpoints left (kept or ghosts).
const FINISH_N: usize = 2;
/// Prompts resumed at a finish checkpoint or its ghost.
const FINISH_HITS: usize = 3;
/// Chunk ends kept.
const CHUNK_N: usize = 4;
/// Prompts resumed at a chunk end.
const CHUNK_HITS: usize = 5;
/// Checkpoints evicted other than the finish role's (those leave evicted ghosts).
const EVICTED_N: usize = 6;
/// Prompts that reached an evicted ghost past their hit.
const EVICTED_HITS: usize = 7;
/// The evictions of checkpoints not of the finish role that the finish role caused: each such
/// eviction times the finish role's share of the cached checkpoints then (decode checkpoints
/// and kept finish checkpoints).
const CAUSED: usize = 8;

/// Keys remembered in arrival order, at most a capacity, the oldest forgotten first.
#[derive(Clone, Debug, Default)]
struct Ghosts {
    /// Each key with the sequence number of its latest insert.
    map: HashMap<ContentHash, u64, FxBuildHasher>,
    /// Inserts oldest first; an entry whose number no longer matches `map` is stale.
    order: VecDeque<(ContentHash, u64)>,
    seq: u64,
}

impl Ghosts {
    /// Remember `hash` as the newest; forget the oldest beyond `capacity`.
    fn insert(&mut self, hash: ContentHash, capacity: usize) {
        self.seq = self.seq.wrapping_add(1);
        self.map.insert(hash, self.seq);
        self.order.push_back((hash, self.seq));
        while self.map.len() > capacity {
            let Some((old, seq)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&old) == Some(&seq) {
                self.map.remove(&old);
            }
        }
        if self.order.len() > capacity.saturating_mul(2) {
            let map = &self.map;
            self.order.retain(|(h, seq)| map.get(h) == Some(seq));
        }
    }

    /// Forget `hash`; whether it was remembered.
    fn take(&mut self, hash: &ContentHash) -> bool {
        self.map.remove(hash).is_some()
    }
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
        self.served.remove(&page);
        match role {
            Role::Body => {
                self.body_written = self.body_written.saturating_add(1);
                self.recent[BODY_N] += 1.0;
            }
            Role::Finish => {
                self.finish_written = self.finish_written.saturating_add(1);
                self.recent[FINISH_N] += 1.0;
            }
            Role::Chunk => {}
            Role::Other => {
                self.roles.remove(&page);
                return;
            }
        }
        self.roles.insert(page, role);
    }

    /// An admitted prompt resumed at the checkpoint on state page `page`: counted for the
    /// checkpoint's role at its first resume only (SPEC 13.8b). A checkpoint resumed at
    /// again and again is a shared prefix: its later resumes come whether or not more
    /// checkpoints of its role are written (hits keep it cached, and a prompt that finds it
    /// gone rewrites it at its branch point, SPEC 13.5c), so they say nothing of what the
    /// next one written will serve.
    pub fn resumed(&mut self, page: u32) {
        let Some(&role) = self.roles.get(&page) else {
            return;
        };
        if !self.served.insert(page) {
            return;
        }
        match role {
            Role::Body => {
                self.body_hits = self.body_hits.saturating_add(1);
                self.recent[BODY_HITS] += 1.0;
            }
            Role::Finish => {
                self.finish_hits = self.finish_hits.saturating_add(1);
                self.recent[FINISH_HITS] += 1.0;
            }
            Role::Chunk => {
                self.chunk_hits = self.chunk_hits.saturating_add(1);
                self.recent[CHUNK_HITS] += 1.0;
            }
            Role::Other => {}
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
        let r = &self.recent;
        let keep = pays(self.chunk_kept, r[CHUNK_N], r[CHUNK_HITS], r[BODY_N], r[BODY_HITS]);
        if keep {
            self.chunk_kept = self.chunk_kept.saturating_add(1);
            self.recent[CHUNK_N] += 1.0;
        }
        keep
    }

    /// Whether prompts' body ends are checkpointed (SPEC 13.8b): until `MIN_OBSERVATIONS`
    /// were written, and then while a body end written is resumed from at least as often as a
    /// finish checkpoint (the request's other checkpoint past its prompt's last sharing-grain
    /// boundary, which holds the same state memory and serves the prompts that share more),
    /// and as often as an eviction costs: `H_B >= p_M * min(N_B, E)`, each body end written
    /// charged one eviction (it takes a state slot, and under pressure a checkpoint leaves
    /// for it), never more than the evictions `E` there were (cross-multiplied).
    pub fn writes_body_end(&self) -> bool {
        let r = &self.recent;
        pays(self.body_written, r[BODY_N], r[BODY_HITS], r[FINISH_N], r[FINISH_HITS])
            && (self.body_written < MIN_OBSERVATIONS
                || self.covers_evictions(r[BODY_HITS], r[BODY_N].min(r[EVICTED_N])))
    }

    /// Body ends written and resumed from; finish checkpoints left and resumed from.
    pub fn resume_counts(&self) -> [u64; 4] {
        [self.body_written, self.body_hits, self.finish_written, self.finish_hits]
    }

    /// At a request's finish, whether its finish checkpoint, still cached, is kept (counted as
    /// left) or released (SPEC 13.8b); in decode, whether a decode checkpoint is written. Kept
    /// until `MIN_OBSERVATIONS` were left, then while the prompts resumed at finish checkpoints
    /// or their ghosts, `H_F`, are more than none and at least `p_M * C`: `p_M` the
    /// prompts that reached an evicted ghost per checkpoint evicted (not of the finish role),
    /// `C` the evictions the finish role caused (decayed counts, cross-multiplied).
    pub fn keep_finish(&self) -> bool {
        let r = &self.recent;
        self.finish_written < MIN_OBSERVATIONS
            || (r[FINISH_HITS] > 0.0 && self.covers_evictions(r[FINISH_HITS], r[CAUSED]))
    }

    /// Whether `hits` prompts served are at least what `charged` evictions cost, `p_M` each
    /// (the prompts that reached an evicted checkpoint's ghost per eviction; decayed counts,
    /// cross-multiplied): the cost test of the finish and body-end rules (SPEC 13.8b).
    fn covers_evictions(&self, hits: f64, charged: f64) -> bool {
        let r = &self.recent;
        hits * r[EVICTED_N] >= r[EVICTED_HITS] * charged
    }

    /// An admitted prompt ages the evidence: every count the rules compare is multiplied by
    /// `1 - 1 / slots`, `slots` the state pages the pool holds (about one turnover of the
    /// checkpoints it can keep), so a role's rate follows what the cache sees now and turns
    /// back when the workload changes shape. Nothing with `slots == 0`.
    pub fn decay(&mut self, slots: usize) {
        if slots == 0 {
            return;
        }
        let factor = 1.0 - 1.0 / count_f64(slots);
        for x in &mut self.recent {
            *x *= factor;
        }
    }

    /// Chunk ends kept at finish and resumed from.
    pub fn chunk_counts(&self) -> [u64; 2] {
        [self.chunk_kept, self.chunk_hits]
    }

    /// A finished request's finish checkpoint was not kept (none written, or released): it is
    /// remembered as a ghost under `hash`, the base-page hash of its boundary, and counted as
    /// a finish checkpoint left, so the finish rate keeps learning while none is kept (SPEC
    /// 13.8b). At most `capacity` ghosts are remembered, the oldest forgotten first; none with
    /// `capacity == 0`.
    pub fn left_ghost(&mut self, hash: ContentHash, capacity: usize) {
        if capacity == 0 {
            return;
        }
        self.finish_written = self.finish_written.saturating_add(1);
        self.recent[FINISH_N] += 1.0;
        self.ghosts.insert(hash, capacity);
    }

    /// A checkpoint `key` whose boundary's base-page hash is `hash` was written (cached).
    pub fn note_boundary(&mut self, key: GroupKey, hash: ContentHash, finish: bool) {
        if let Some((_, was)) = self.boundary.insert(key, (hash, finish)) {
            if was {
                self.finish_cached = self.finish_cached.saturating_sub(1);
            }
        }
        if finish {
            self.finish_cached += 1;
        }
    }

    /// The checkpoint `key` left the cache other than by eviction (released, dropped).
    pub fn forget_boundary(&mut self, key: &GroupKey) {
        if let Some((_, true)) = self.boundary.remove(key) {
            self.finish_cached = self.finish_cached.saturating_sub(1);
        }
    }

    /// The pool evicted checkpoint `key`: one not of the finish role is counted, charged to the
    /// finish role by its share of the cached checkpoints, and remembered as an evicted ghost
    /// (at most `capacity`).
    pub fn evicted(&mut self, key: &GroupKey, capacity: usize) {
        let share = count_f64(self.finish_cached) / count_f64(self.boundary.len().max(1));
        if let Some((hash, finish)) = self.boundary.remove(key) {
            if finish {
                // The finish role's own checkpoint: what it costs the role is in its hits.
                self.finish_cached = self.finish_cached.saturating_sub(1);
                return;
            }
            self.recent[CAUSED] += share;
            self.recent[EVICTED_N] += 1.0;
            if capacity > 0 {
                self.evicted.insert(hash, capacity);
            }
        }
    }

    /// An admitted prompt whose base-page hashes are `hashes` resumed at `hit` tokens. Walking
    /// its boundaries `b` (multiples of `grain`, `hit < b <= cap`, base pages of `base` tokens)
    /// deepest first: the first evicted ghost met counts as a prompt a slot more would have
    /// served, and a finish ghost met counts as a prompt resumed at a finish checkpoint and
    /// ends the walk; each ghost counted is forgotten. Returns whether a finish ghost was met
    /// (the prompt then counts for no other role).
    pub fn ghost_resumed(&mut self, hashes: &[ContentHash], hit: u64, cap: u64, grain: u64, base: u64) -> bool {
        if (self.ghosts.map.is_empty() && self.evicted.map.is_empty()) || grain == 0 || base == 0 {
            return false;
        }
        let mut b = cap / grain * grain;
        let mut marginal = false;
        while b > hit {
            let index = usize::try_from(b / base).unwrap_or(usize::MAX);
            if let Some(hash) = index.checked_sub(1).and_then(|i| hashes.get(i)) {
                if self.ghosts.take(hash) {
                    self.finish_hits = self.finish_hits.saturating_add(1);
                    self.recent[FINISH_HITS] += 1.0;
                    return true;
                }
                if !marginal && self.evicted.take(hash) {
                    marginal = true;
                    self.recent[EVICTED_HITS] += 1.0;
                }
            }
            b -= grain;
        }
        false
    }
}

/// A count as `f64` (pools hold far fewer than 2^32 pages; a larger count saturates).
fn count_f64(n: usize) -> f64 {
    f64::from(u32::try_from(n).unwrap_or(u32::MAX))
}

/// The rule every role of SPEC 13.8b follows: a role is kept (written) until
/// `MIN_OBSERVATIONS` of it were counted, then while prompts resume at it per checkpoint
/// (`hits / count`, decayed counts) at least as often as at the role it is compared with
/// (`ref_hits / ref_count`); cross-multiplied, so nothing divides by zero.
fn pays(total: u64, count: f64, hits: f64, ref_count: f64, ref_hits: f64) -> bool {
    total < MIN_OBSERVATIONS || hits * ref_count >= ref_hits * count
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
    fn body_ends_are_written_while_one_serves_what_an_eviction_costs() {
        let key = |i: u8| GroupKey::new([i; 32], 1);
        let mut e = ReuseEvidence::default();
        for page in 0..16 {
            assert!(e.writes_body_end(), "warm-up");
            e.wrote(page, Role::Body);
        }
        e.resumed(0);
        e.resumed(1);
        assert!(e.writes_body_end(), "nothing evicted: a slot costs nothing");
        for i in 0..24 {
            e.note_boundary(key(i), [i; 32], false);
        }
        for i in 0..4 {
            e.evicted(&key(i), 64);
        }
        // Two prompts an eviction cost (their evicted ghosts past their hit).
        for i in 0..2 {
            assert!(!e.ghost_resumed(&[[i; 32]], 0, 4, 4, 4));
        }
        assert!(e.writes_body_end(), "2 * 4 >= 2 * min(16, 4)");
        assert!(!e.ghost_resumed(&[[2; 32]], 0, 4, 4, 4));
        assert!(!e.writes_body_end(), "2 * 4 < 3 * 4");
        e.resumed(2);
        assert!(e.writes_body_end(), "3 * 4 >= 3 * 4");
        for i in 4..24 {
            e.evicted(&key(i), 64);
        }
        assert!(!e.ghost_resumed(&[[3; 32]], 0, 4, 4, 4));
        // 24 evictions, 4 of them cost a prompt: 16 body ends are charged 16, not 24.
        assert!(e.writes_body_end(), "3 * 24 >= 4 * min(16, 24)");
    }

    #[test]
    fn a_checkpoint_counts_for_its_role_at_its_first_resume_only() {
        let mut e = ReuseEvidence::default();
        e.wrote(1, Role::Body);
        e.wrote(2, Role::Finish);
        e.wrote(3, Role::Chunk);
        for _ in 0..3 {
            for page in 1..=3 {
                e.resumed(page);
            }
        }
        assert_eq!(e.resume_counts(), [1, 1, 1, 1]);
        assert_eq!(e.chunk_counts(), [0, 1]);
        // A checkpoint written again on the page counts again at its first resume.
        e.wrote(1, Role::Body);
        e.resumed(1);
        e.resumed(1);
        assert_eq!(e.resume_counts(), [2, 2, 1, 1]);
        // So does one of another role; a page that took a checkpoint of no role counts for none.
        e.wrote(2, Role::Other);
        e.resumed(2);
        e.wrote(2, Role::Body);
        e.resumed(2);
        assert_eq!(e.resume_counts(), [3, 3, 1, 1]);
    }

    #[test]
    fn chunk_ends_are_kept_while_resumed_from_as_often_as_body_ends() {
        let mut e = ReuseEvidence::default();
        // Two body ends written, one resumed from: 1 / 2 per body end.
        e.wrote(0, Role::Body);
        e.wrote(1, Role::Body);
        e.resumed(0);
        // Until MIN_OBSERVATIONS were kept, they are, whatever was resumed.
        for page in 0..16 {
            e.wrote(200 + page, Role::Chunk);
            assert!(e.is_chunk_end(200 + page));
            assert!(e.keep_chunk_end(), "fewer than 16 chunk ends kept");
        }
        // 16 kept, none resumed from: 0 / 16 < 1 / 2, released now.
        assert!(!e.keep_chunk_end());
        // 8 prompts resume at them: 8 / 16 >= 1 / 2, kept again.
        for page in 0..8 {
            e.resumed(200 + page);
        }
        assert!(e.keep_chunk_end());
        assert_eq!(e.chunk_counts(), [17, 8]);
        // A chunk end's page that takes another checkpoint is no chunk end any more.
        e.wrote(200, Role::Other);
        assert!(!e.is_chunk_end(200));
    }

    fn hash(i: u8) -> ContentHash {
        [i; 32]
    }

    #[test]
    fn finish_checkpoints_are_kept_while_they_serve_more_prompts_than_the_evictions_they_cause() {
        let mut e = ReuseEvidence::default();
        // Until MIN_OBSERVATIONS were left, they are kept, whatever was resumed.
        for page in 0..16 {
            assert!(e.keep_finish(), "fewer than 16 finish checkpoints left");
            e.wrote(100 + page, Role::Finish);
        }
        // None resumed from: worth nothing, released (even with nothing evicted).
        assert!(!e.keep_finish());
        // Released ones leave ghosts; a prompt that would have resumed at one (at 8, deeper
        // than its hit 0) counts for finish checkpoints: 1 of 17, nothing evicted: kept.
        e.left_ghost(hash(1), 4);
        assert!(e.ghost_resumed(&[hash(9), hash(1)], 0, 8, 4, 4));
        assert_eq!(e.resume_counts()[2..], [17, 1]);
        assert!(e.keep_finish());
        // Cached: two decode checkpoints (the finish role) and four others; the four others are
        // evicted, 3 of them later wanted by a prompt: an eviction costs 3 / 4 of a prompt, and
        // the finish role held 2 of the 6, 5, 4, 3 cached checkpoints at each eviction, so it
        // caused 2/6 + 2/5 + 2/4 + 2/3 = 1.9 of them: 1 < 3 / 4 * 1.9, released.
        let finish_role = [GroupKey::new(hash(40), 1), GroupKey::new(hash(41), 1)];
        e.note_boundary(finish_role[0], hash(50), true);
        e.note_boundary(finish_role[1], hash(51), true);
        for i in 0..4u8 {
            e.note_boundary(GroupKey::new(hash(10 + i), 1), hash(20 + i), false);
        }
        for i in 0..4u8 {
            e.evicted(&GroupKey::new(hash(10 + i), 1), 8);
        }
        for i in 0..3u8 {
            assert!(
                !e.ghost_resumed(&[hash(20 + i)], 0, 4, 4, 4),
                "an evicted ghost is no finish hit"
            );
        }
        assert!(!e.keep_finish());
        // A ghost is taken once: the same prompt again finds none.
        assert!(!e.ghost_resumed(&[hash(20)], 0, 4, 4, 4));
        // Two more prompts resume at finish checkpoints: 3 >= 3 / 4 * 1.9, kept again.
        e.resumed(100);
        e.resumed(101);
        assert!(e.keep_finish());
        // The finish role's own checkpoints evicted cost no other prompt: they add nothing to C
        // and leave no ghost. Three of them (the two above and one more, each then the role's
        // share 1 of what is cached): charged, C would be 1.9 + 3 = 4.9 and 3 < 3 / 4 * 4.9,
        // released; C stays 1.9: kept.
        let third = GroupKey::new(hash(42), 1);
        e.note_boundary(third, hash(52), true);
        for key in [finish_role[0], finish_role[1], third] {
            e.evicted(&key, 8);
        }
        assert!(!e.ghost_resumed(&[hash(50)], 0, 4, 4, 4));
        assert!(e.keep_finish());
    }
}
