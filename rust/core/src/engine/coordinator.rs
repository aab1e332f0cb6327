//! The coordinator (SPEC 7): all groups of one model over one shared [`BlockPool`].
//!
//! It works on a request's tables (one [`Table`] per group, in group order) and knows nothing
//! of request ids; [`crate::engine::FlatCache`] maps ids to tables.
//!
//! It may own a host-memory tier ([`HostTier`], `host.rs`), which depends only on the pool,
//! the keys and the event log, never on this module. A tiered prefix match looks a key up on
//! the device first, then on the tier; its device pages stay in [`PrefixMatch::pages`] and
//! its host hits are listed apart in [`PrefixMatch::host_hits`]. Registering and releasing
//! pages hand the tier the pages its store policy wants, and claiming a tiered match
//! allocates the loads' destinations (`claim_tiered`).

use std::sync::Arc;

use crate::engine::events::{EventLog, KvEvent};
use crate::engine::group::{EvictionOrder, GroupKind, GroupManager, RegisterPlan, RegisterRange};
use crate::engine::hash::{fold_run, ContentHash, GroupKey};
use crate::engine::host::{Device, HostStore, HostTier, LoadEvent, Transfer};
use crate::engine::policy::{EvictionPolicy, ReuseEvidence};
use crate::engine::pool::{ArenaGeometry, BlockPool, Place, NULL_PAGE};
use crate::engine::prefixes::PathCounts;
use crate::engine::table::Table;
use crate::error::{CoreError, CoreResult};
use crate::num::Divisor;

/// One group of a cache: its id, rule and page size in tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    /// The group id (used as the key of the flat block tables).
    pub group_id: String,
    /// The retention rule.
    pub kind: GroupKind,
    /// Tokens per page (`> 0`).
    pub page_size: u64,
}

/// A slot of a tiered prefix match served by the host tier: its page there is loaded into a
/// new device page when the match is claimed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostHit {
    /// The group index.
    pub group: usize,
    /// The slot in the group's table.
    pub slot: usize,
    /// The host page holding the slot's key.
    pub page: u32,
}

/// The result of a prefix match: per-group pages (holes as 0) and the common token count.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Tokens every group can resume from (a multiple of the lcm page size).
    pub num_common_tokens: u64,
    /// Per group, the matched device page per slot (0 = hole, or a slot in `host_hits`).
    pub pages: Vec<Vec<u32>>,
    /// Per group, the number of slots served (device pages plus host hits).
    pub num_hit_pages: Vec<usize>,
    /// Per group, the (folded) content hash each real device page was matched under, in slot
    /// order; a claim refuses the match if a page no longer holds exactly that key. `None`
    /// for a match built by hand, whose pages must then each hold some key of their own group.
    pub keys: Option<Vec<Vec<ContentHash>>>,
    /// The slots served by the host tier (a tiered match only), groups in index order, slots
    /// ascending; `pages` holds 0 at each of them.
    pub host_hits: Vec<HostHit>,
    /// Tokens the full-attention groups matched (a multiple of the lcm page size, at least
    /// `num_common_tokens`; `num_common_tokens` when there are none): where the prompt leaves
    /// the cached path. Beyond `num_common_tokens` only a state checkpoint was missing, so a
    /// request cuts a chunk there to write one (the branch point of SPEC 13.5c).
    pub branch_tokens: u64,
}

impl PrefixMatch {
    /// The empty match of a cache with `groups` groups.
    pub fn empty(groups: usize) -> Self {
        Self {
            num_common_tokens: 0,
            pages: vec![Vec::new(); groups],
            num_hit_pages: vec![0; groups],
            keys: Some(vec![Vec::new(); groups]),
            host_hits: Vec::new(),
            branch_tokens: 0,
        }
    }

    /// A match built by hand (no remembered keys; see [`PrefixMatch::keys`]).
    pub fn by_hand(num_common_tokens: u64, pages: Vec<Vec<u32>>, num_hit_pages: Vec<usize>) -> Self {
        Self {
            num_common_tokens,
            pages,
            num_hit_pages,
            keys: None,
            host_hits: Vec::new(),
            branch_tokens: num_common_tokens,
        }
    }
}

/// What a token-level request knows when it registers: its tokens, every base-page hash from
/// base page 0, and its extra keys (for the `BlockStored` events' tokens and parents).
#[derive(Clone, Copy, Debug)]
pub struct TokenContext<'a> {
    /// The request's tokens.
    pub tokens: &'a [u32],
    /// The content hashes of its full base pages, from base page 0.
    pub hashes: &'a [ContentHash],
    /// Its extra keys.
    pub extra_keys: &'a Arc<[String]>,
}

/// Where a tiered match found the key of a slot.
#[derive(Clone, Copy, Debug)]
enum Served {
    /// A device page holds it.
    Device(u32),
    /// A findable host page holds it.
    Host(u32),
}

/// What a tiered match hands a group's match rule for a slot it found: only hit (any
/// non-zero value) or hole (0) matters there, the slot's page is read back from the lookup.
const KEPT: u32 = u32::MAX;

/// Greatest common divisor (Euclid).
fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Tokens covered by `slots` pages of `page_size`; saturating is safe because callers only
/// compare the result against bounds that fit in `u64` (a saturated extent never undercuts one).
#[inline]
fn extent(slots: usize, page_size: u64) -> u64 {
    u64::try_from(slots).unwrap_or(u64::MAX).saturating_mul(page_size)
}

/// All groups of one model, sharing one pool.
#[derive(Clone, Debug)]
pub struct Coordinator {
    specs: Vec<GroupSpec>,
    managers: Vec<GroupManager>,
    /// Base pages per page of each group (`m_g = P_g / base`).
    mult: Vec<Divisor>,
    base: Divisor,
    lcm: Divisor,
    /// The lcm of the state groups' page sizes (`None` without state groups).
    state_grain: Option<u64>,
    /// The state group, when there is exactly one.
    single_state: Option<usize>,
    /// Full groups first, then the others, each in index order.
    match_order: Vec<usize>,
    pool: BlockPool<GroupKey>,
    /// Per group, the distinct pages its tables reference (pages with count > 0 belong to
    /// exactly one group).
    in_use: Vec<usize>,
    events: EventLog,
    /// Shared empty extra keys for page-level `BlockStored` events.
    no_extra_keys: Arc<[String]>,
    /// The host-memory tier, if any (`host.rs`).
    host: Option<HostTier>,
    /// State pages that took a key (checkpoints written, SPEC 13.5).
    checkpoints_written: u64,
    /// Which checkpoints are kept (SPEC 13.8, `policy.rs`), and what `reuse` learned.
    policy: EvictionPolicy,
    evidence: ReuseEvidence,
    /// The paths of the checkpoints finished requests left (`prefixes.rs`; `reuse` only).
    prefixes: PathCounts,
    /// The full-attention groups whose page is the base page: their keys are base-page
    /// hashes, the ones a checkpoint's path names.
    full_at_base: Vec<u32>,
}

impl Coordinator {
    /// A coordinator over `specs` (at least one) with a pool of `num_pages` pages.
    pub fn new(specs: Vec<GroupSpec>, num_pages: u64, enable_caching: bool) -> CoreResult<Self> {
        Self::check_specs(&specs)?;
        let pool = BlockPool::new(num_pages, enable_caching)?;
        Self::over_pool(specs, pool)
    }

    /// A coordinator whose pages live in an arena (SPEC 13.2; the `pool::arena` module):
    /// `geometry.page_bytes` names one page size per group, in group order; a state group's
    /// page is a whole unit (one state slot), and at most one group may be a state group.
    pub fn with_arena(specs: Vec<GroupSpec>, geometry: &ArenaGeometry, enable_caching: bool) -> CoreResult<Self> {
        Self::check_specs(&specs)?;
        if geometry.page_bytes.len() != specs.len() {
            return Err(CoreError::invalid(format!(
                "arena: page_bytes names {} groups, the cache has {}",
                geometry.page_bytes.len(),
                specs.len()
            )));
        }
        let states: Vec<&str> = specs
            .iter()
            .filter(|s| s.kind == GroupKind::State)
            .map(|s| s.group_id.as_str())
            .collect();
        if states.len() > 1 {
            return Err(CoreError::invalid(format!(
                "arena: at most one state group (one state slot holds every state layer), got {states:?}"
            )));
        }
        for (spec, &bytes) in specs.iter().zip(&geometry.page_bytes) {
            if spec.kind == GroupKind::State && bytes != geometry.unit_bytes {
                return Err(CoreError::invalid(format!(
                    "arena: state group {:?} must have page_bytes = unit_bytes = {} (a state page is one unit), got {bytes}",
                    spec.group_id, geometry.unit_bytes
                )));
            }
        }
        let pool = BlockPool::with_arena(geometry, enable_caching)?;
        Self::over_pool(specs, pool)
    }

    /// Check group specs (see [`Self::new`]): at least one, each page size > 0, windows and
    /// chunks of their kinds, distinct group ids, and an lcm of the page sizes that fits u64.
    /// The bindings call it when they read `specs`, before the arguments after it.
    pub fn check_specs(specs: &[GroupSpec]) -> CoreResult<()> {
        if specs.is_empty() {
            return Err(CoreError::invalid("specs must hold at least one group"));
        }
        if u32::try_from(specs.len()).is_err() {
            return Err(CoreError::invalid("specs: too many groups (group indices are u32)"));
        }
        for (i, spec) in specs.iter().enumerate() {
            if spec.page_size == 0 {
                return Err(CoreError::invalid(format!("specs[{i}].page_size must be > 0, got 0")));
            }
            if let GroupKind::SlidingWindow { window: 0 } = spec.kind {
                return Err(CoreError::invalid(format!(
                    "specs[{i}].sliding_window must be >= 1 for a sliding_window group, got 0"
                )));
            }
            if let GroupKind::ChunkedLocal { chunk } = spec.kind {
                if chunk == 0 || chunk % spec.page_size != 0 {
                    return Err(CoreError::invalid(format!(
                        "specs[{i}].chunk_size must be a positive multiple of its page_size {}, got {chunk}",
                        spec.page_size
                    )));
                }
            }
            if specs[..i].iter().any(|s| s.group_id == spec.group_id) {
                return Err(CoreError::invalid(format!(
                    "specs: group id {:?} appears more than once",
                    spec.group_id
                )));
            }
        }
        let mut lcm = 1u64;
        for s in specs {
            lcm = (lcm / gcd(lcm, s.page_size))
                .checked_mul(s.page_size)
                .ok_or_else(|| Self::lcm_overflow(specs))?;
        }
        Ok(())
    }

    /// The lcm of the specs' page sizes does not fit u64: the error names the sizes.
    fn lcm_overflow(specs: &[GroupSpec]) -> CoreError {
        let sizes: Vec<u64> = specs.iter().map(|s| s.page_size).collect();
        CoreError::overflow(format!("specs: the lcm of the page sizes {sizes:?}"))
    }

    /// The coordinator of checked `specs` over `pool`.
    fn over_pool(specs: Vec<GroupSpec>, mut pool: BlockPool<GroupKey>) -> CoreResult<Self> {
        pool.count_evictions_by(|key| key.group as usize);
        let base = specs.iter().fold(0, |g, s| gcd(g, s.page_size));
        let mut lcm = 1u64;
        for s in &specs {
            lcm = (lcm / gcd(lcm, s.page_size))
                .checked_mul(s.page_size)
                .ok_or_else(|| Self::lcm_overflow(&specs))?;
        }
        let managers = specs.iter().map(|s| GroupManager::new(s.kind, s.page_size)).collect();
        let mult = specs.iter().map(|s| Divisor::new(s.page_size / base)).collect();
        let mut match_order: Vec<usize> = (0..specs.len()).filter(|&g| specs[g].kind.is_prefix_closed()).collect();
        match_order.extend((0..specs.len()).filter(|&g| !specs[g].kind.is_prefix_closed()));
        let groups = specs.len();
        // It divides `lcm`, which fits u64 (checked above).
        let state_grain = specs
            .iter()
            .filter(|s| s.kind == GroupKind::State)
            .map(|s| s.page_size)
            .reduce(|a, b| a / gcd(a, b) * b);
        let states: Vec<usize> = (0..specs.len())
            .filter(|&g| specs[g].kind == GroupKind::State)
            .collect();
        let single_state = if let [g] = states.as_slice() { Some(*g) } else { None };
        let full_at_base = (0..specs.len())
            .filter(|&g| specs[g].kind == GroupKind::Full && specs[g].page_size == base)
            .filter_map(|g| u32::try_from(g).ok())
            .collect();
        Ok(Self {
            single_state,
            specs,
            managers,
            mult,
            base: Divisor::new(base),
            lcm: Divisor::new(lcm),
            state_grain,
            match_order,
            pool,
            in_use: vec![0; groups],
            events: EventLog::new(false),
            no_extra_keys: Arc::from(Vec::new()),
            host: None,
            checkpoints_written: 0,
            policy: EvictionPolicy::Lru,
            evidence: ReuseEvidence::default(),
            prefixes: PathCounts::default(),
            full_at_base,
        })
    }

    /// Checkpoints written (state pages that took a key) and evicted (state keys dropped
    /// because their page was handed out again), over every state group; `None` without state
    /// groups.
    pub fn checkpoint_counts(&self) -> Option<(u64, u64)> {
        self.state_grain?;
        let evicted = (0..self.specs.len())
            .filter(|&g| self.specs[g].kind == GroupKind::State)
            .map(|g| self.pool.evictions_of_group(g))
            .fold(0, u64::saturating_add);
        Some((self.checkpoints_written, evicted))
    }

    /// SPEC 13.8b: the eviction stamp of the free cached checkpoint `page` (arena storage),
    /// `None` otherwise.
    pub fn checkpoint_stamp(&self, page: u32) -> Option<u64> {
        self.pool.eviction_stamp(page)
    }

    /// SPEC 13.8b: date the free cached checkpoint `page` at eviction stamp `stamp` (`None`:
    /// now), searching from `hint` where still valid; a no-op outside arena storage.
    pub fn date_checkpoint(&mut self, page: u32, stamp: Option<u64>, hint: Option<Place>) {
        self.pool.date(page, stamp, hint);
    }

    /// SPEC 13.8b: where the free cached checkpoint `page` sits in the eviction order (arena
    /// storage), a hint for a later [`Self::date_checkpoint`] near it.
    pub fn checkpoint_place(&self, page: u32) -> Option<Place> {
        self.pool.place(page)
    }

    /// Forget the checkpoint `key` held by `page` (a request's previous decode checkpoint,
    /// SPEC 13.5d keeps only its latest) when the page still holds exactly that key and nobody
    /// references it: the page stays free, a `BlockRemoved` is recorded. Returns whether it
    /// was dropped.
    pub fn drop_checkpoint(&mut self, page: u32, key: GroupKey) -> bool {
        if self.pool.key_of(page) != Some(&key) {
            return false;
        }
        let Some(dropped) = self.pool.drop_free_key(page) else {
            return false;
        };
        self.evidence.forget_boundary(&dropped);
        let mut keys = vec![dropped];
        if self.whole_prefixes() {
            Self::drop_path(
                &mut self.pool,
                &mut self.prefixes,
                &self.full_at_base,
                &dropped,
                &mut keys,
            );
        }
        if self.events.enabled() {
            Self::push_removed(keys, &mut self.events);
        }
        true
    }

    /// Record KV events from now on (or stop, dropping the unread ones).
    pub fn set_kv_events(&mut self, on: bool) {
        self.events = EventLog::new(on);
        self.sync_recording();
    }

    /// The pool records evictions for the events and for whole prefixes.
    fn sync_recording(&mut self) {
        let on = self.events.enabled()
            || self.whole_prefixes()
            || (self.policy == EvictionPolicy::Reuse && self.single_state.is_some());
        self.pool.set_record_evictions(on);
    }

    /// Whether whole hybrid prefixes are kept (`prefixes.rs`): the `reuse` policy, one state
    /// group, a full-attention group on the base page, prefix caching on, no host tier.
    pub fn whole_prefixes(&self) -> bool {
        self.policy == EvictionPolicy::Reuse
            && self.single_state.is_some()
            && !self.full_at_base.is_empty()
            && self.pool.caching_enabled()
            && self.host.is_none()
    }

    /// Remember checkpoint `key` (a finished request's, still cached) with the path
    /// `hashes[..len]` (`prefixes.rs`).
    pub fn remember_checkpoint(&mut self, key: GroupKey, hashes: &[ContentHash], len: usize) {
        self.prefixes.remember(key, hashes, len);
    }

    /// Drop the key of every free full-attention page among `hashes` (a finished request's,
    /// in order) that no remembered path holds (`prefixes.rs`: those past the prefix of
    /// `hashes` the paths hold); a `BlockRemoved` is recorded.
    pub fn drop_unheld(&mut self, hashes: &[ContentHash]) {
        let start = self.prefixes.held_len(hashes);
        let mut dropped = Vec::new();
        for hash in &hashes[start..] {
            for &group in &self.full_at_base {
                Self::drop_free(&mut self.pool, GroupKey { hash: *hash, group }, &mut dropped);
            }
        }
        if !dropped.is_empty() && self.events.enabled() {
            Self::push_removed(dropped, &mut self.events);
        }
    }

    /// Drop the key of the earliest-registered page holding `key` if it is free; the key
    /// joins `dropped`.
    fn drop_free(pool: &mut BlockPool<GroupKey>, key: GroupKey, dropped: &mut Vec<GroupKey>) {
        dropped.extend(pool.drop_free_key_of(&key));
    }

    /// Forget checkpoint `key`'s path and drop the free full-attention pages only it held
    /// (their keys join `dropped`).
    fn drop_path(
        pool: &mut BlockPool<GroupKey>,
        prefixes: &mut PathCounts,
        full: &[u32],
        key: &GroupKey,
        dropped: &mut Vec<GroupKey>,
    ) {
        prefixes.forget(key, |hash| {
            for &group in full {
                Self::drop_free(pool, GroupKey { hash: *hash, group }, dropped);
            }
        });
    }

    /// After an allocation: the keys it evicted become `BlockRemoved` events and, keeping
    /// whole prefixes, an evicted checkpoint's path is forgotten and the pages only it held are
    /// dropped (their events follow). Nothing when the pool records no evictions.
    fn after_allocation(&mut self) {
        if !self.pool.records_evictions() {
            return;
        }
        let mut keys = self.pool.take_evicted();
        if self.policy == EvictionPolicy::Reuse {
            if let Some(g) = self.single_state {
                let capacity = self.state_slots();
                for key in &keys {
                    if key.group as usize == g {
                        self.evidence.evicted(key, capacity);
                    }
                }
            }
        }
        if self.whole_prefixes() && !self.prefixes.is_empty() {
            for i in 0..keys.len() {
                let key = keys[i];
                if self.prefixes.remembers(&key) {
                    Self::drop_path(&mut self.pool, &mut self.prefixes, &self.full_at_base, &key, &mut keys);
                }
            }
        }
        if self.events.enabled() {
            Self::push_removed(keys, &mut self.events);
        }
    }

    /// Give the cache a host tier of `num_pages` pages of the device pages' geometry, shared
    /// by every group, with store `policy` (before any request exists).
    pub fn set_host(&mut self, num_pages: u64, policy: HostStore) -> CoreResult<()> {
        let tier = HostTier::new(num_pages, policy)?;
        self.pool.set_record_released(tier.stores_on_release());
        self.host = Some(tier);
        self.sync_recording();
        Ok(())
    }

    /// Give the cache a host tier in which group `g` has `pages[g]` host pages of its own page
    /// geometry (the tier over an arena, whose groups' pages differ; [`HostTier::per_group`]),
    /// with store `policy` (before any request exists). No tier when every count is 0.
    pub fn set_host_per_group(&mut self, pages: &[u64], policy: HostStore) -> CoreResult<()> {
        if pages.len() != self.specs.len() {
            return Err(CoreError::invalid(format!(
                "host_pages names {} groups, the cache has {}",
                pages.len(),
                self.specs.len()
            )));
        }
        if pages.iter().all(|&n| n == 0) {
            return Ok(());
        }
        let tier = HostTier::per_group(pages, policy)?;
        self.pool.set_record_released(tier.stores_on_release());
        self.host = Some(tier);
        self.sync_recording();
        Ok(())
    }

    /// The host tier, if any.
    pub fn host(&self) -> Option<&HostTier> {
        self.host.as_ref()
    }

    /// Whether KV events are recorded.
    pub fn kv_events_enabled(&self) -> bool {
        self.events.enabled()
    }

    /// The events recorded since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.take()
    }

    /// Per group, the distinct real pages its tables reference.
    pub fn pages_in_use_by_group(&self) -> &[usize] {
        &self.in_use
    }

    /// Whether a released page that holds no key goes to the front of the free list
    /// ([`BlockPool::set_reuse_uncached_first`]).
    pub fn set_reuse_uncached_first(&mut self, on: bool) {
        self.pool.set_reuse_uncached_first(on);
    }

    /// Whether the state groups move an unkeyed working page to the slot an acquire adds
    /// ([`GroupManager::set_moves_working_page`]; the cache option `move_state_pages`).
    pub fn set_move_state_pages(&mut self, on: bool) {
        for manager in &mut self.managers {
            manager.set_moves_working_page(on);
        }
    }

    /// Drop the key of every cached page with count 0 (they stay free, in place) and return
    /// how many keys were dropped; pages held by requests keep their keys.
    ///
    /// The events say exactly what changed: `AllBlocksCleared` when no request held a cached
    /// page (no key is left), else one `BlockRemoved` per group of dropped keys (groups in the
    /// order they first appear on the free list, hashes in free-list order), nothing when none
    /// was dropped.
    pub fn reset_prefix_cache(&mut self) -> usize {
        let pinned = self.pool.num_cached_pinned();
        let dropped = self.pool.clear_cached_free();
        let count = dropped.len();
        for key in &dropped {
            // Every free page lost its key already: only the paths are forgotten.
            self.prefixes.forget(key, |_| {});
            self.evidence.forget_boundary(key);
        }
        if !self.events.enabled() {
            return count;
        }
        if pinned == 0 {
            self.events.push(KvEvent::Cleared);
        } else {
            Self::push_removed(dropped, &mut self.events);
        }
        count
    }

    /// The group specs, in index order.
    pub fn specs(&self) -> &[GroupSpec] {
        &self.specs
    }

    /// Number of groups.
    pub fn num_groups(&self) -> usize {
        self.specs.len()
    }

    /// The base page size (gcd of the groups' page sizes).
    pub fn base_page_size(&self) -> u64 {
        self.base.get()
    }

    /// The base page size as a divisor.
    pub fn base_div(&self) -> Divisor {
        self.base
    }

    /// The boundaries where every state group can hold a snapshot: the lcm of the state groups'
    /// page sizes (`None` without state groups).
    pub fn state_grain(&self) -> Option<u64> {
        self.state_grain
    }

    /// Which checkpoints are kept (SPEC 13.8).
    pub fn eviction_policy(&self) -> EvictionPolicy {
        self.policy
    }

    /// Set the checkpoint policy (before any request exists).
    pub fn set_eviction_policy(&mut self, policy: EvictionPolicy) {
        self.policy = policy;
        self.sync_recording();
    }

    /// What the `reuse` policy learned (read-only).
    pub fn evidence(&self) -> &ReuseEvidence {
        &self.evidence
    }

    /// The state pages the pool can hold for the single state group (its ids less the null
    /// page): the evidence's decay horizon and ghost capacity (SPEC 13.8b); 0 without one.
    pub fn state_slots(&self) -> usize {
        self.single_state
            .map_or(0, |g| self.pool.group_ids(g).saturating_sub(1))
    }

    /// What the `reuse` policy learned.
    pub fn evidence_mut(&mut self) -> &mut ReuseEvidence {
        &mut self.evidence
    }

    /// The grain prompts share at (SPEC 13.8): the state grain under `lru`, the learned
    /// sharing grain under `reuse`; `None` without state groups.
    pub fn sharing_grain(&self) -> Option<u64> {
        let grain = self.state_grain?;
        Some(match self.policy {
            EvictionPolicy::Lru => grain,
            EvictionPolicy::Reuse => self.evidence.sharing_grain(grain),
        })
    }

    /// The state group, when the model has exactly one.
    pub fn single_state_group(&self) -> Option<usize> {
        self.single_state
    }

    /// The lcm of the groups' page sizes.
    pub fn lcm_page_size(&self) -> u64 {
        self.lcm.get()
    }

    /// The shared pool.
    pub fn pool(&self) -> &BlockPool<GroupKey> {
        &self.pool
    }

    /// The group managers, in index order.
    pub fn managers(&self) -> &[GroupManager] {
        &self.managers
    }

    /// Group index as `u32` (validated in [`Self::new`]).
    #[allow(
        clippy::cast_possible_truncation,
        reason = "the group count is checked to fit u32 in new()"
    )]
    fn group_u32(g: usize) -> u32 {
        g as u32
    }

    // ----- match --------------------------------------------------------------------------

    /// The key of group `g`'s slot `i`: the fold of base pages `[i*m, (i+1)*m)` (the caller
    /// guarantees they exist), memoised per slot for groups wider than the base page.
    fn slot_key(&self, g: usize, i: usize, hashes: &[ContentHash], memo: &mut Vec<Option<ContentHash>>) -> GroupKey {
        let group = Self::group_u32(g);
        let m = self.mult[g].get();
        if m == 1 {
            return GroupKey::new(hashes[i], group);
        }
        if memo.len() <= i {
            memo.resize(i + 1, None);
        }
        let hash = *memo[i].get_or_insert_with(|| {
            // m <= hashes.len() here, so it fits usize.
            let m = usize::try_from(m).unwrap_or(usize::MAX);
            fold_run(&hashes[i * m..(i + 1) * m])
        });
        GroupKey::new(hash, group)
    }

    /// Match group `g` over its slots below `bound` tokens: the matched device pages (holes
    /// as 0). With a host tier (`tiered`), a key missing on the device is looked up on the
    /// tier, and the slots the match keeps from there replace `hits` as `(slot, host page)`,
    /// slots ascending (their entries in the pages are 0).
    fn match_group(
        &self,
        g: usize,
        bound: u64,
        hashes: &[ContentHash],
        memo: &mut Vec<Option<ContentHash>>,
        tiered: Option<(&HostTier, &mut Vec<(usize, u32)>)>,
    ) -> Vec<u32> {
        // bound <= len(hashes) * base, so bound / P_g <= len(hashes) fits usize.
        let end = usize::try_from(self.managers[g].page().quotient(bound)).unwrap_or(0);
        let Some((host, hits)) = tiered else {
            return self.managers[g]
                .match_slots(end, |i| self.pool.lookup(&self.slot_key(g, i, hashes, memo)))
                .0;
        };
        // The group's rule decides which slots the match keeps (it copies the lookup's answer
        // into each kept slot and 0 into holes); where each looked-up key lives is recorded
        // per slot, so the rule is handed only a non-hole mark.
        let mut found: Vec<Option<Served>> = vec![None; end];
        let (mut pages, _) = self.managers[g].match_slots(end, |i| {
            let key = self.slot_key(g, i, hashes, memo);
            let at = self
                .pool
                .lookup(&key)
                .map(Served::Device)
                .or_else(|| host.lookup(&key).map(Served::Host))?;
            found[i] = Some(at);
            Some(KEPT)
        });
        hits.clear();
        for (slot, page) in pages.iter_mut().enumerate() {
            if *page == NULL_PAGE {
                continue;
            }
            *page = match found[slot] {
                Some(Served::Device(p)) => p,
                Some(Served::Host(h)) => {
                    hits.push((slot, h));
                    NULL_PAGE
                }
                None => unreachable!("a kept slot was looked up"),
            };
        }
        pages
    }

    /// The hybrid prefix match of base-page content hashes (read-only).
    ///
    /// Sweep: in match order, match each group up to the bound, then lower the bound to that
    /// group's extent (aligned down to the lcm). Converge: re-match every non-prefix-closed
    /// group whose extent exceeds the bound until nothing changes. Finally truncate every
    /// group to the bound.
    pub fn match_prefix(&self, hashes: &[ContentHash]) -> CoreResult<PrefixMatch> {
        self.match_prefix_in(hashes, None)
    }

    /// [`Self::match_prefix`] where every group's lookup answers device-or-host (device
    /// first): the slots served by the host tier are [`PrefixMatch::host_hits`]. Without a
    /// host tier it is the device match.
    pub fn match_prefix_tiered(&self, hashes: &[ContentHash]) -> CoreResult<PrefixMatch> {
        self.match_prefix_in(hashes, self.host.as_ref())
    }

    fn match_prefix_in(&self, hashes: &[ContentHash], host: Option<&HostTier>) -> CoreResult<PrefixMatch> {
        let groups = self.specs.len();
        if !self.pool.caching_enabled() {
            return Ok(PrefixMatch::empty(groups));
        }
        let total = u64::try_from(hashes.len())
            .ok()
            .and_then(|n| n.checked_mul(self.base.get()))
            .ok_or_else(|| CoreError::overflow("content_hashes"))?;
        let mut bound = self.lcm.align_down(total);
        let mut found: Vec<Vec<u32>> = vec![Vec::new(); groups];
        let mut memo: Vec<Vec<Option<ContentHash>>> = vec![Vec::new(); groups];
        // Per group, the slots served by the host tier (empty without one).
        let mut on_host: Vec<Vec<(usize, u32)>> = Vec::new();
        if host.is_some() {
            on_host.resize(groups, Vec::new());
        }
        let mut closed_bound = None;
        for &g in &self.match_order {
            found[g] = self.match_group(g, bound, hashes, &mut memo[g], host.zip(on_host.get_mut(g)));
            bound = bound.min(self.lcm.align_down(extent(found[g].len(), self.specs[g].page_size)));
            if self.specs[g].kind.is_prefix_closed() {
                closed_bound = Some(bound);
            }
        }
        loop {
            let mut changed = false;
            for g in 0..groups {
                let page_size = self.specs[g].page_size;
                if self.specs[g].kind.is_prefix_closed() || extent(found[g].len(), page_size) <= bound {
                    continue;
                }
                found[g] = self.match_group(g, bound, hashes, &mut memo[g], host.zip(on_host.get_mut(g)));
                bound = bound.min(self.lcm.align_down(extent(found[g].len(), page_size)));
                changed = true;
            }
            if !changed {
                break;
            }
        }
        let mut num_hit_pages = Vec::with_capacity(groups);
        let mut keys = Vec::with_capacity(groups);
        let mut host_hits = Vec::new();
        for (g, pages) in found.iter_mut().enumerate() {
            let slots = usize::try_from(self.managers[g].page().quotient(bound)).unwrap_or(usize::MAX);
            pages.truncate(slots);
            // Every real page was found by a lookup of the key it holds now.
            let held: Vec<ContentHash> = pages
                .iter()
                .filter(|&&p| p != NULL_PAGE)
                .filter_map(|&p| self.pool.key_of(p).map(|k| k.hash))
                .collect();
            // The group's host hits inside the bound.
            let before = host_hits.len();
            if let Some(hits) = on_host.get(g) {
                let kept = hits.iter().filter(|&&(slot, _)| slot < slots);
                host_hits.extend(kept.map(|&(slot, page)| HostHit { group: g, slot, page }));
            }
            num_hit_pages.push(held.len() + host_hits.len() - before);
            keys.push(held);
        }
        Ok(PrefixMatch {
            num_common_tokens: bound,
            pages: found,
            num_hit_pages,
            keys: Some(keys),
            host_hits,
            branch_tokens: closed_bound.map_or(bound, |b| b.max(bound)),
        })
    }

    // ----- claim --------------------------------------------------------------------------

    /// Check that `m` can be claimed by a request holding `tables` (`None`: a new request).
    pub fn check_claim(&self, method: &str, tables: Option<&[Table]>, m: &PrefixMatch) -> CoreResult<()> {
        if tables.is_some_and(|ts| ts.iter().any(|t| !t.is_empty())) {
            return Err(CoreError::invalid(format!(
                "{method}: the request's tables already hold pages"
            )));
        }
        if m.pages.len() != self.specs.len() {
            return Err(CoreError::invalid(format!(
                "{method}: the match has {} groups but the cache has {}",
                m.pages.len(),
                self.specs.len()
            )));
        }
        let total: usize = m.pages.iter().map(Vec::len).sum();
        for (g, pages) in m.pages.iter().enumerate() {
            let remembered = match &m.keys {
                Some(keys) => match keys.get(g) {
                    Some(k) if k.len() == pages.iter().filter(|&&p| p != NULL_PAGE).count() => Some(k.as_slice()),
                    _ => {
                        return Err(CoreError::invalid(format!(
                            "{method}: the match's keys of group {:?} do not fit its pages",
                            self.specs[g].group_id
                        )))
                    }
                },
                None => None,
            };
            let group = Self::group_u32(g);
            let mut real = 0usize;
            for &page in pages {
                self.pool.check_page(u64::from(page))?;
                if page == NULL_PAGE {
                    continue;
                }
                let held = self.pool.key_of(page);
                let fresh = match remembered {
                    Some(keys) => held == Some(&GroupKey::new(keys[real], group)),
                    None => held.is_some_and(|k| k.group == group),
                };
                real += 1;
                if !fresh {
                    return Err(CoreError::invalid(format!(
                        "{method}: stale match: page {page} of group {:?} no longer holds the key it was matched under",
                        self.specs[g].group_id
                    )));
                }
                if u64::from(self.pool.refs_of(page)) + u64::try_from(total).unwrap_or(u64::MAX) > u64::from(u32::MAX) {
                    return Err(CoreError::invalid(format!(
                        "{method}: page {page}: reference count overflow"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Take references on the matched pages and make them the tables (after [`Self::check_claim`]).
    pub fn claim(&mut self, tables: &mut [Table], m: &PrefixMatch) {
        for ((table, pages), in_use) in tables.iter_mut().zip(&m.pages).zip(&mut self.in_use) {
            for &page in pages {
                if page != NULL_PAGE && self.pool.retain(page) {
                    *in_use += 1;
                }
            }
            *table = Table::from_claim(pages.clone());
        }
    }

    /// Whether a new request that claims `m` (none: no hit) and then acquires `n` tokens finds
    /// its pages, exactly as the claim and the allocation would take them (in arena mode the
    /// units are counted as they would be bound, which the free credit only estimates). A
    /// host hit of a tiered match counts as one more page of its group, taken with the
    /// group's acquire (the load's destination is taken earlier, at the claim: an estimate
    /// there).
    pub fn fits_claim_then_acquire(&self, m: Option<&PrefixMatch>, n: u64) -> bool {
        let mut claimed = Vec::new();
        let mut needs = Vec::with_capacity(self.managers.len());
        for (g, manager) in self.managers.iter().enumerate() {
            let pages = m.map_or_else(Vec::new, |m| m.pages[g].clone());
            claimed.extend(pages.iter().copied().filter(|&p| p != NULL_PAGE));
            let table = Table::from_claim(pages);
            let loads = m.map_or(0, |m| m.host_hits.iter().filter(|h| h.group == g).count());
            let need = manager.blocks_needed(&table, n, manager.state_movable(&self.pool, &table));
            needs.push(need.saturating_add(loads as u64));
        }
        self.pool.fits_after_claim(&claimed, &needs)
    }

    /// Pages a claim of `m` takes off the free list: distinct real pages with count 0.
    pub fn pages_consumed_by_claim(&self, m: &PrefixMatch) -> CoreResult<usize> {
        let mut pages: Vec<u32> = Vec::new();
        for &page in m.pages.iter().flatten() {
            self.pool.check_page(u64::from(page))?;
            if page != NULL_PAGE && self.pool.refs_of(page) == 0 {
                pages.push(page);
            }
        }
        pages.sort_unstable();
        pages.dedup();
        Ok(pages.len())
    }

    // ----- acquire ------------------------------------------------------------------------

    /// Pages an acquire of `n` tokens would allocate over all groups (`None`: fresh tables).
    pub fn pages_needed(&self, tables: Option<&[Table]>, n: u64) -> CoreResult<u64> {
        let fresh = Table::default();
        let mut sum = 0u64;
        for (g, manager) in self.managers.iter().enumerate() {
            let table = tables.map_or(&fresh, |ts| &ts[g]);
            sum = sum
                .checked_add(
                    manager
                        .blocks_needed(table, n, manager.state_movable(&self.pool, table))
                        .saturating_mul(self.pool.page_cost(g)),
                )
                .ok_or_else(|| CoreError::overflow("num_tokens"))?;
        }
        Ok(sum)
    }

    /// Make room for `n` more tokens in every group, check-then-act: if the pages needed over
    /// all groups exceed the free pages, nothing is allocated and `false` is returned.
    /// Groups allocate in index order.
    pub fn acquire(&mut self, tables: &mut [Table], n: u64) -> bool {
        // Saturating is exact here: a saturated need exceeds any free count, which is the answer.
        let needs = self
            .managers
            .iter()
            .zip(tables.iter())
            .map(|(m, t)| m.blocks_needed(t, n, m.state_movable(&self.pool, t)));
        if !self.pool.fits(needs) {
            return false;
        }
        for (g, table) in tables.iter_mut().enumerate().take(self.managers.len()) {
            let manager = &self.managers[g];
            // Pages, not slots: a state group's new slots are holes but its last.
            let movable = manager.state_movable(&self.pool, table);
            let pages = usize::try_from(manager.blocks_needed(table, n, movable)).unwrap_or(usize::MAX);
            let ok = manager.acquire(&mut self.pool, g, table, n);
            debug_assert!(ok, "acquire failed after the check");
            self.in_use[g] += pages;
            self.after_allocation();
        }
        true
    }

    /// Record one `BlockRemoved` per group of `keys`, in the order each group first appears,
    /// hashes in the order of `keys`.
    fn push_removed(mut keys: Vec<GroupKey>, events: &mut EventLog) {
        while !keys.is_empty() {
            let group = keys[0].group;
            let hashes: Vec<ContentHash> = keys.iter().filter(|k| k.group == group).map(|k| k.hash).collect();
            keys.retain(|k| k.group != group);
            events.push(KvEvent::Removed { hashes, group });
        }
    }

    // ----- register -----------------------------------------------------------------------

    /// Where group `g` registers base hashes `[first_slot, first_slot + len)`, or `None` if it
    /// registers nothing by its kind's rule ([`GroupManager`]; state groups register only at
    /// `end_tokens` on a page boundary). A range past the end of the table is an error.
    fn register_plan(
        &self,
        g: usize,
        table: &Table,
        len: usize,
        first_slot: u64,
        end_tokens: Option<u64>,
    ) -> CoreResult<Option<RegisterPlan>> {
        let range = RegisterRange {
            first_slot,
            len,
            base: self.base.get(),
            end_tokens,
        };
        let Some(plan) = self.managers[g].register_plan(self.mult[g], range) else {
            return Ok(None);
        };
        if plan.start.checked_add(plan.count).is_none_or(|end| end > table.len()) {
            // The end in u128: the start may be near u64::MAX.
            let end = plan.start as u128 + plan.count as u128;
            return Err(CoreError::invalid(format!(
                "register: slots [{}, {end}) of group {g} run past its table of {} pages",
                plan.start,
                table.len()
            )));
        }
        Ok(Some(plan))
    }

    /// Register base-page hashes `hashes` (base pages `first_slot ..`) in every group's table:
    /// keys are the group's folds of complete aligned runs; state groups register only the
    /// last key and only when the range ends exactly at `end_tokens` on their page boundary.
    /// Every group's range is checked before anything is registered. Nothing at all happens
    /// with caching off.
    pub fn register(
        &mut self,
        tables: &[Table],
        hashes: &[ContentHash],
        first_slot: u64,
        end_tokens: Option<u64>,
    ) -> CoreResult<()> {
        self.register_with(tables, hashes, first_slot, end_tokens, None)
    }

    /// [`Self::register`] for a request that may know its tokens (`ctx`, for the
    /// `BlockStored` events: tokens, extra keys, and the parent hash of any slot).
    pub fn register_with(
        &mut self,
        tables: &[Table],
        hashes: &[ContentHash],
        first_slot: u64,
        end_tokens: Option<u64>,
        ctx: Option<TokenContext<'_>>,
    ) -> CoreResult<()> {
        self.register_groups(tables, hashes, first_slot, end_tokens, ctx, None)
    }

    /// [`Self::register_with`] for the groups `only` lists (every group when `None`): the
    /// others register nothing, as if their plan were empty (vLLM's sparse retention keys a
    /// sliding group's slot only where a later request could resume, a full group's always).
    pub fn register_groups(
        &mut self,
        tables: &[Table],
        hashes: &[ContentHash],
        first_slot: u64,
        end_tokens: Option<u64>,
        ctx: Option<TokenContext<'_>>,
        only: Option<&[usize]>,
    ) -> CoreResult<()> {
        if !self.pool.caching_enabled() {
            return Ok(());
        }
        let chosen = |g: usize| only.is_none_or(|list| list.contains(&g));
        let mut keys = 0usize;
        for (g, table) in tables.iter().enumerate().filter(|&(g, _)| chosen(g)) {
            keys += self
                .register_plan(g, table, hashes.len(), first_slot, end_tokens)?
                .map_or(0, |p| p.count);
        }
        if keys == 0 {
            return Ok(());
        }
        for (g, table) in tables.iter().enumerate().filter(|&(g, _)| chosen(g)) {
            let Some(plan) = self.register_plan(g, table, hashes.len(), first_slot, end_tokens)? else {
                continue;
            };
            let group = Self::group_u32(g);
            // m <= len(hashes) when count > 0, so it fits usize.
            let m = usize::try_from(self.mult[g].get()).unwrap_or(usize::MAX);
            let manager = self.managers[g];
            let recording = self.events.enabled();
            let write_through = self.host.as_ref().is_some_and(HostTier::stores_on_register);
            let mut stored: Vec<(usize, ContentHash)> = Vec::new();
            let cached_before = self.pool.num_cached();
            manager.register(&mut self.pool, table, plan.start, plan.count, |j| {
                let at = plan.skip + j * m;
                let hash = if m == 1 {
                    hashes[at]
                } else {
                    fold_run(&hashes[at..at + m])
                };
                if recording || write_through {
                    stored.push((plan.start + j, hash));
                }
                GroupKey::new(hash, group)
            });
            if self.specs[g].kind == GroupKind::State {
                let written = (self.pool.num_cached() - cached_before) as u64;
                self.checkpoints_written = self.checkpoints_written.saturating_add(written);
            }
            if let Some((host, mut dev)) = self.tier().filter(|_| write_through) {
                for &(slot, hash) in &stored {
                    host.store(&mut dev, table.pages()[slot], GroupKey::new(hash, group));
                }
            }
            if recording && !stored.is_empty() {
                let event = self.stored_event(g, table, &stored, hashes, first_slot, ctx);
                self.events.push(event);
            }
        }
        Ok(())
    }

    /// The `BlockStored` event of group `g`'s newly cached `(slot, hash)` pairs (non-empty).
    ///
    /// The parent is the hash of the slot before the first one: folded from the request's
    /// hashes when they cover it (a token-level request knows them all; a page-level call
    /// knows `hashes`, base pages from `first_slot`), else the key its page holds, else `None`.
    fn stored_event(
        &self,
        g: usize,
        table: &Table,
        stored: &[(usize, ContentHash)],
        hashes: &[ContentHash],
        first_slot: u64,
        ctx: Option<TokenContext<'_>>,
    ) -> KvEvent {
        let m = usize::try_from(self.mult[g].get()).unwrap_or(usize::MAX);
        let first = stored[0].0;
        let parent = first.checked_sub(1).and_then(|prev| {
            // Base pages [prev*m, first*m) of the slot before.
            let lo = prev.checked_mul(m)?;
            let hi = first.checked_mul(m)?;
            let fold = |run: &[ContentHash]| if m == 1 { run[0] } else { fold_run(run) };
            if let Some(c) = ctx {
                if hi <= c.hashes.len() {
                    return Some(fold(&c.hashes[lo..hi]));
                }
            }
            let given = usize::try_from(first_slot).ok()?;
            if lo >= given && hi - given <= hashes.len() {
                return Some(fold(&hashes[lo - given..hi - given]));
            }
            let page = table.pages()[prev];
            (page != NULL_PAGE)
                .then(|| self.pool.key_of(page).map(|k| k.hash))
                .flatten()
        });
        let page_size = usize::try_from(self.specs[g].page_size).unwrap_or(usize::MAX);
        let token_ids = match ctx {
            Some(c) => {
                let mut out = Vec::with_capacity(stored.len().saturating_mul(page_size));
                for &(slot, _) in stored {
                    // Registered slots lie inside the computed (hence known) tokens.
                    let lo = slot.saturating_mul(page_size);
                    if let Some(page) = c.tokens.get(lo..lo.saturating_add(page_size)) {
                        out.extend_from_slice(page);
                    }
                }
                out
            }
            None => Vec::new(),
        };
        KvEvent::Stored {
            hashes: stored.iter().map(|&(_, h)| h).collect(),
            parent,
            token_ids,
            group: Self::group_u32(g),
            extra_keys: ctx.map_or_else(|| Arc::clone(&self.no_extra_keys), |c| Arc::clone(c.extra_keys)),
        }
    }

    // ----- reclaim, free ------------------------------------------------------------------

    /// Reclaim the slid-out pages of every group at `n` computed tokens (index order), each
    /// group's released in `order` ([`GroupManager::reclaim`]).
    pub fn reclaim(&mut self, tables: &mut [Table], n: u64, order: EvictionOrder) {
        for ((manager, table), in_use) in self.managers.iter().zip(tables.iter_mut()).zip(&mut self.in_use) {
            *in_use -= manager.reclaim(&mut self.pool, table, n, order);
        }
        self.store_released();
    }

    /// Pages [`Self::reclaim`] at `n` would return to the free list.
    pub fn pages_reclaimable(&self, tables: &[Table], n: u64, count_uncached: bool) -> usize {
        self.managers
            .iter()
            .zip(tables)
            .map(|(m, t)| m.reclaimable(&self.pool, t, n, count_uncached))
            .sum()
    }

    /// Release every group's pages in `order` and empty the tables.
    pub fn free(&mut self, tables: &mut [Table], order: EvictionOrder) {
        match order {
            EvictionOrder::Group => {
                for ((manager, table), in_use) in self.managers.iter().zip(tables.iter_mut()).zip(&mut self.in_use) {
                    *in_use -= manager.free(&mut self.pool, table);
                }
            }
            EvictionOrder::Hybrid => self.free_hybrid(tables),
        }
        self.store_released();
    }

    /// Release all groups' real pages by the end token of their slot, descending (ties:
    /// lower group index first), then empty the tables. A merge over the groups' tables
    /// from their tails; slots below a table's known-hole bound are skipped.
    fn free_hybrid(&mut self, tables: &mut [Table]) {
        // left[g]: group g's slots not yet released are [floor[g], left[g]).
        let mut left: Vec<usize> = tables.iter().map(Table::len).collect();
        let floor: Vec<usize> = tables.iter().map(Table::holes_below).collect();
        loop {
            let mut best: Option<(usize, u64)> = None;
            for (g, (&l, &f)) in left.iter().zip(&floor).enumerate() {
                if l <= f {
                    continue;
                }
                let end = extent(l, self.specs[g].page_size);
                if best.is_none_or(|(_, e)| end > e) {
                    best = Some((g, end));
                }
            }
            let Some((g, _)) = best else { break };
            left[g] -= 1;
            let page = tables[g].pages()[left[g]];
            if page != NULL_PAGE && self.pool.release(page) {
                self.in_use[g] -= 1;
            }
        }
        for table in tables {
            table.take_pages();
        }
    }

    // ----- host tier (host.rs) ------------------------------------------------------------

    /// The host tier with the device side its operations change, if there is a tier.
    fn tier(&mut self) -> Option<(&mut HostTier, Device<'_>)> {
        let host = self.host.as_mut()?;
        let dev = Device {
            pool: &mut self.pool,
            in_use: &mut self.in_use,
            events: &mut self.events,
        };
        Some((host, dev))
    }

    /// Hand the tier the cached pages released since the last call (its evict policy stores
    /// them; see [`HostTier::store_released`]).
    pub(crate) fn store_released(&mut self) {
        if let Some((host, mut dev)) = self.tier() {
            host.store_released(&mut dev);
        }
    }

    /// Tokens of a `hit` served from host memory: those at or after the first slot any group
    /// loads from the host tier (0 when the match is all device pages).
    pub fn host_hit_tokens(&self, m: &PrefixMatch, hit: u64) -> u64 {
        let first = m
            .host_hits
            .iter()
            .map(|h| extent(h.slot, self.specs[h.group].page_size))
            .fold(hit, u64::min);
        hit - first
    }

    /// What claiming a tiered match takes, each page counted as its group's
    /// [`BlockPool::page_cost`] (1 without an arena): (distinct device pages with count 0, one
    /// device page per host hit).
    pub fn tiered_claim_cost(&self, m: &PrefixMatch) -> (usize, usize) {
        let mut device: Vec<(u32, usize)> = m
            .pages
            .iter()
            .enumerate()
            .flat_map(|(g, pages)| pages.iter().map(move |&page| (page, g)))
            .filter(|&(page, _)| page != NULL_PAGE && self.pool.refs_of(page) == 0)
            .collect();
        device.sort_unstable();
        device.dedup_by_key(|&mut (page, _)| page);
        let cost = device
            .iter()
            .map(|&(_, g)| self.pool.page_cost(g))
            .fold(0u64, u64::saturating_add);
        let loads = m
            .host_hits
            .iter()
            .map(|h| self.pool.page_cost(h.group))
            .fold(0u64, u64::saturating_add);
        (
            usize::try_from(cost).unwrap_or(usize::MAX),
            usize::try_from(loads).unwrap_or(usize::MAX),
        )
    }

    /// Host hits of `m` per group, in group order.
    fn loads_per_group(&self, m: &PrefixMatch) -> Vec<usize> {
        let mut loads = vec![0usize; self.specs.len()];
        for hit in &m.host_hits {
            loads[hit.group] += 1;
        }
        loads
    }

    /// Whether a new request can claim the tiered match `m`: its device hits, then one device
    /// page of its group per host hit (the loads' destinations, taken group by group in index
    /// order). Without an arena: the free pages cover both; in arena mode, exactly as the
    /// units would be bound ([`BlockPool::fits_after_claim`]).
    pub fn tiered_claim_fits(&self, m: &PrefixMatch) -> bool {
        if !self.pool.is_arena() {
            let (device, loads) = self.tiered_claim_cost(m);
            return device.saturating_add(loads) <= self.pool.num_free();
        }
        let claimed: Vec<u32> = m.pages.iter().flatten().copied().filter(|&p| p != NULL_PAGE).collect();
        let needs: Vec<u64> = self.loads_per_group(m).iter().map(|&n| n as u64).collect();
        self.pool.fits_after_claim(&claimed, &needs)
    }

    /// Claim a tiered match for a new request (empty `tables`): take a reference on every
    /// device hit, then allocate one device page per host hit, group by group in index order
    /// (in the order of [`PrefixMatch::host_hits`]), put it in the table, pin it and emit its
    /// load. Returns the number of loads. The caller checked that the pages are free
    /// ([`Self::tiered_claim_fits`]); if not, nothing changes and this is an error.
    pub(crate) fn claim_tiered(
        &mut self,
        tables: &mut [Table],
        m: &PrefixMatch,
        owner: (usize, u64),
        ctx: TokenContext<'_>,
    ) -> CoreResult<usize> {
        let loads = m.host_hits.len();
        if loads > 0 && (self.host.is_none() || !self.tiered_claim_fits(m)) {
            return Err(CoreError::Invariant(
                "claim: not enough free pages for the host loads of a match".to_owned(),
            ));
        }
        let mut pages = m.pages.clone();
        for (g, group_pages) in pages.iter().enumerate() {
            for &page in group_pages {
                if page != NULL_PAGE && self.pool.retain(page) {
                    self.in_use[g] += 1;
                }
            }
        }
        let mut dest = Vec::with_capacity(loads);
        for (g, &n) in self.loads_per_group(m).iter().enumerate() {
            if n > 0 {
                let ok = self.pool.allocate_group_into(&mut dest, g, n);
                debug_assert!(ok, "the loads' pages were checked to fit");
            }
        }
        if dest.len() != loads {
            return Err(CoreError::Invariant(
                "claim: the host loads' pages did not fit after the check".to_owned(),
            ));
        }
        self.after_allocation();
        for (hit, &d) in m.host_hits.iter().zip(&dest) {
            pages[hit.group][hit.slot] = d;
            // The load's pin: the page stays allocated until acknowledged, even if the
            // request ends first.
            self.pool.retain(d);
            self.in_use[hit.group] += 1;
            let event = self.load_event(hit.group, hit.slot, ctx);
            if let Some(host) = self.host.as_mut() {
                host.load(hit.page, d, owner, event);
            }
        }
        for (table, group_pages) in tables.iter_mut().zip(pages) {
            *table = Table::from_claim(group_pages);
        }
        Ok(loads)
    }

    /// The `BlockStored` payload of group `g`'s slot `slot` loaded for a token-level request.
    fn load_event(&self, g: usize, slot: usize, ctx: TokenContext<'_>) -> LoadEvent {
        let m = usize::try_from(self.mult[g].get()).unwrap_or(usize::MAX);
        let parent = slot.checked_sub(1).and_then(|prev| {
            let run = ctx.hashes.get(prev.checked_mul(m)?..slot.checked_mul(m)?)?;
            Some(if m == 1 { run[0] } else { fold_run(run) })
        });
        let page_size = usize::try_from(self.specs[g].page_size).unwrap_or(usize::MAX);
        let lo = slot.saturating_mul(page_size);
        let token_ids = ctx
            .tokens
            .get(lo..lo.saturating_add(page_size))
            .map_or_else(Vec::new, <[u32]>::to_vec);
        LoadEvent {
            parent,
            token_ids,
            extra_keys: Arc::clone(ctx.extra_keys),
        }
    }

    /// Check that transfers `ids` can be acknowledged (no host tier: only `[]` can).
    pub fn check_ack(&self, ids: &[u64]) -> CoreResult<()> {
        match &self.host {
            Some(host) => host.check_ack(ids),
            None => match ids.first() {
                None => Ok(()),
                Some(id) => Err(CoreError::invalid(format!(
                    "ack_transfers: transfer {id} is not in flight (this cache has no host tier)"
                ))),
            },
        }
    }

    /// Finish a checked transfer ([`HostTier::finish`]); returns a load's owner. Call
    /// [`Self::store_released`] after a batch of these.
    pub(crate) fn finish_transfer(&mut self, id: u64) -> Option<(usize, u64)> {
        let (host, mut dev) = self.tier()?;
        host.finish(&mut dev, id)
    }

    /// Hand out the transfers emitted since the last call (empty without a host tier), each
    /// device page as the index in its group's view (`BlockPool::group_base`; the pool's id
    /// without an arena) and each host page in its group's host space.
    pub fn take_transfers(&mut self) -> Vec<Transfer> {
        let mut out = self.host.as_mut().map_or_else(Vec::new, HostTier::take);
        if self.pool.is_arena() {
            for t in &mut out {
                t.device -= self.pool.group_base(t.group as usize);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::hash::hash_pages;

    fn spec(id: &str, kind: GroupKind, page_size: u64) -> GroupSpec {
        GroupSpec {
            group_id: id.to_owned(),
            kind,
            page_size,
        }
    }

    fn sw(window: u64) -> GroupKind {
        GroupKind::SlidingWindow { window }
    }

    fn fresh(c: &Coordinator) -> Vec<Table> {
        vec![Table::default(); c.num_groups()]
    }

    fn prompt(n: u32, base: usize) -> Vec<ContentHash> {
        let tokens: Vec<u32> = (0..n).collect();
        hash_pages::<&str>(&tokens, base, &[], &[]).unwrap()
    }

    #[test]
    fn new_derives_base_lcm_and_match_order() {
        let c = Coordinator::new(
            vec![
                spec("a", sw(8), 4),
                spec("b", GroupKind::Full, 6),
                spec("c", GroupKind::State, 2),
            ],
            10,
            true,
        )
        .unwrap();
        assert_eq!((c.base_page_size(), c.lcm_page_size()), (2, 12));
        assert_eq!(c.match_order, vec![1, 0, 2]);
        assert_eq!(c.mult, vec![Divisor::new(2), Divisor::new(3), Divisor::new(1)]);
        assert!(Coordinator::new(vec![], 10, true).is_err());
        assert!(Coordinator::new(vec![spec("a", GroupKind::Full, 0)], 10, true).is_err());
        assert!(Coordinator::new(vec![spec("a", sw(0), 4)], 10, true).is_err());
        assert!(Coordinator::new(vec![spec("a", GroupKind::Full, 4), spec("a", sw(4), 4)], 10, true).is_err());
        let huge = vec![
            spec("a", GroupKind::Full, u64::MAX),
            spec("b", GroupKind::Full, u64::MAX - 1),
        ];
        assert_eq!(
            Coordinator::new(huge, 10, true).unwrap_err().to_string(),
            format!(
                "specs: the lcm of the page sizes [{}, {}] does not fit in an unsigned 64-bit integer",
                u64::MAX,
                u64::MAX - 1
            )
        );
    }

    #[test]
    fn acquire_is_all_or_nothing_across_groups() {
        let mut c = Coordinator::new(vec![spec("f", GroupKind::Full, 4), spec("s", sw(4), 4)], 6, true).unwrap();
        let mut t = fresh(&c);
        // 5 free pages; 8 tokens need 2 + 2.
        assert_eq!(c.pages_needed(None, 8).unwrap(), 4);
        assert!(c.acquire(&mut t, 8));
        assert_eq!((t[0].pages(), t[1].pages()), (&[1, 2][..], &[3, 4][..]));
        // 4 more tokens need 1 + 1 but only 1 page is free: nothing changes in either group.
        assert_eq!(c.pages_needed(Some(&t), 4).unwrap(), 2);
        assert!(!c.acquire(&mut t, 4));
        assert_eq!((t[0].len(), t[1].len(), c.pool().num_free()), (2, 2, 1));
        assert!(!c.acquire(&mut t, u64::MAX));
        let ones = Coordinator::new(
            vec![spec("a", GroupKind::Full, 1), spec("b", GroupKind::Full, 1)],
            6,
            true,
        )
        .unwrap();
        assert_eq!(
            ones.pages_needed(None, u64::MAX).unwrap_err(),
            CoreError::overflow("num_tokens")
        );
    }

    /// Prefill `n` tokens of `hashes` for a fresh request, register them, and free it.
    fn cache_prompt(c: &mut Coordinator, hashes: &[ContentHash], n: u64) {
        let mut t = fresh(c);
        assert!(c.acquire(&mut t, n));
        c.register(&t, hashes, 0, Some(n)).unwrap();
        c.free(&mut t, EvictionOrder::Group);
    }

    #[test]
    fn full_and_sliding_match_converge_on_a_common_boundary() {
        // base 2; full P = 4 (m = 2), sliding P = 2, W = 3 (needed = 1); lcm = 4.
        let mut c = Coordinator::new(vec![spec("sw", sw(3), 2), spec("full", GroupKind::Full, 4)], 64, true).unwrap();
        let hashes = prompt(16, 2); // 8 base pages
        cache_prompt(&mut c, &hashes, 16);
        let m = c.match_prefix(&hashes).unwrap();
        assert_eq!(m.num_common_tokens, 16);
        assert_eq!(m.num_hit_pages, vec![1, 4]);
        assert_eq!(m.pages[0][..7], [0; 7]);
        assert_ne!(m.pages[0][7], 0);
        // A miss in the prefix: a request whose 4th base page differs.
        let mut other = hashes.clone();
        other[5] = [7; 32];
        let m = c.match_prefix(&other).unwrap();
        // Full stops at slot 2 (base pages 4, 5): extent 8. Sliding re-matched to bound 8.
        assert_eq!(m.num_common_tokens, 8);
        assert_eq!(m.pages[1].len(), 2);
        assert_eq!(m.pages[0].len(), 4);
        assert_eq!(m.num_hit_pages[0], 1);
        // Odd number of base pages: bound aligned down to lcm 4 -> 12 tokens.
        let m = c.match_prefix(&hashes[..7]).unwrap();
        assert_eq!(m.num_common_tokens, 12);
    }

    /// Register group `g`'s keys (m = 1) for exactly `slots` of its table.
    fn cache_slots(c: &mut Coordinator, t: &[Table], g: usize, slots: &[usize], hashes: &[ContentHash]) {
        for &s in slots {
            let key = GroupKey::new(hashes[s], Coordinator::group_u32(g));
            c.pool.cache_unchecked(t[g].pages()[s], key);
        }
    }

    #[test]
    fn converge_rematches_until_every_sliding_group_agrees() {
        // base = lcm = 2; x and y need 1 cached page behind a boundary (W = 3, P = 2).
        let mut c = Coordinator::new(
            vec![
                spec("full", GroupKind::Full, 2),
                spec("x", sw(3), 2),
                spec("y", sw(3), 2),
            ],
            64,
            true,
        )
        .unwrap();
        let hashes = prompt(12, 2); // 6 base pages
        let mut t = fresh(&c);
        assert!(c.acquire(&mut t, 12));
        cache_slots(&mut c, &t, 0, &[0, 1, 2, 3, 4, 5], &hashes);
        cache_slots(&mut c, &t, 1, &[0, 1, 2, 5], &hashes);
        cache_slots(&mut c, &t, 2, &[0, 1, 3, 4], &hashes);
        // Sweep: full -> 12; x hits slot 5 -> 12; y misses slot 5, hits 4 -> 10.
        // Converge round 1: x at 10 misses 4, 3, hits 2 -> 6; y at 6 misses 2, hits 1 -> 4.
        // Round 2: x at 4 hits 1 -> 4. Round 3: no change.
        let m = c.match_prefix(&hashes).unwrap();
        assert_eq!(m.num_common_tokens, 4);
        assert_eq!(m.pages[0], t[0].pages()[..2].to_vec());
        assert_eq!(m.pages[1], vec![0, t[1].pages()[1]]);
        assert_eq!(m.pages[2], vec![0, t[2].pages()[1]]);
        assert_eq!(m.num_hit_pages, vec![2, 1, 1]);
    }

    #[test]
    fn converge_with_hybrid_page_sizes_aligns_to_the_lcm() {
        // full P = 2 (m = 1), x P = 4 (m = 2, W = 5: needed 1), y P = 2 (W = 3: needed 1).
        // base 2, lcm 4.
        let mut c = Coordinator::new(
            vec![
                spec("full", GroupKind::Full, 2),
                spec("x", sw(5), 4),
                spec("y", sw(3), 2),
            ],
            64,
            true,
        )
        .unwrap();
        let hashes = prompt(16, 2); // 8 base pages
        let mut t = fresh(&c);
        assert!(c.acquire(&mut t, 16));
        cache_slots(&mut c, &t, 0, &[0, 1, 2, 3, 4, 5, 6, 7], &hashes);
        for s in [0usize, 1] {
            let key = GroupKey::new(fold_run(&hashes[2 * s..2 * s + 2]), 1);
            c.pool.cache_unchecked(t[1].pages()[s], key);
        }
        cache_slots(&mut c, &t, 2, &[0, 1, 2, 4, 5, 6, 7], &hashes);
        // Sweep: full -> 16; x misses slots 3, 2, hits 1 -> extent 8; y at 8 (4 slots) misses
        // 3, hits 2 -> extent 6, aligned down to 4. Converge: x at 4 hits 0 -> 4; y's extent
        // 6 > 4 -> re-matched at 4 (2 slots): hits 1 -> 4. Nothing changes after that.
        let m = c.match_prefix(&hashes).unwrap();
        assert_eq!(m.num_common_tokens, 4);
        assert_eq!(m.pages[0], t[0].pages()[..2].to_vec());
        assert_eq!(m.pages[1], vec![t[1].pages()[0]]);
        assert_eq!(m.pages[2], vec![0, t[2].pages()[1]]);
        assert_eq!(m.num_hit_pages, vec![2, 1, 1]);
    }

    #[test]
    fn match_is_read_only_and_empty_with_caching_off() {
        let mut c = Coordinator::new(vec![spec("f", GroupKind::Full, 2)], 16, true).unwrap();
        let hashes = prompt(8, 2);
        cache_prompt(&mut c, &hashes, 8);
        let before: Vec<u32> = c.pool().free_list().collect();
        let m = c.match_prefix(&hashes).unwrap();
        assert_eq!(m.num_hit_pages, vec![4]);
        assert_eq!(c.pool().free_list().collect::<Vec<_>>(), before);
        let off = Coordinator::new(vec![spec("f", GroupKind::Full, 2)], 16, false).unwrap();
        assert_eq!(off.match_prefix(&hashes).unwrap(), PrefixMatch::empty(1));
    }

    #[test]
    fn claim_touches_real_pages_and_rejects_stale_or_misshaped_matches() {
        let mut c = Coordinator::new(vec![spec("f", GroupKind::Full, 2), spec("s", sw(3), 2)], 32, true).unwrap();
        let hashes = prompt(8, 2);
        cache_prompt(&mut c, &hashes, 8);
        let m = c.match_prefix(&hashes).unwrap();
        assert_eq!(c.pages_consumed_by_claim(&m).unwrap(), 4 + 1);
        let mut t = fresh(&c);
        c.check_claim("claim", Some(&t), &m).unwrap();
        c.claim(&mut t, &m);
        assert_eq!(t[0].pages(), m.pages[0].as_slice());
        assert_eq!(t[1].tail_avail(), 0);
        assert_eq!(c.pages_consumed_by_claim(&m).unwrap(), 0);
        // Tables hold pages now.
        assert!(c.check_claim("claim", Some(&t), &m).is_err());
        let wrong = PrefixMatch::empty(3);
        assert!(c.check_claim("claim", None, &wrong).is_err());
        c.free(&mut t, EvictionOrder::Group);
        // Evict every cached page: the match is stale.
        let free = c.pool().num_free();
        let _ = c.pool.allocate(free);
        assert!(c.check_claim("claim", None, &m).is_err());
        let mut out_of_range = PrefixMatch::empty(2);
        out_of_range.pages[0] = vec![99];
        assert!(c.check_claim("claim", None, &out_of_range).is_err());
        assert!(c.pages_consumed_by_claim(&out_of_range).is_err());
    }

    #[test]
    fn register_folds_and_state_registers_only_at_a_page_boundary() {
        // base 2 (from "a"): full and state have P = 4, so m = 2.
        let mut c = Coordinator::new(
            vec![
                spec("f", GroupKind::Full, 4),
                spec("st", GroupKind::State, 4),
                spec("a", GroupKind::Full, 2),
            ],
            64,
            true,
        )
        .unwrap();
        let hashes = prompt(12, 2); // 6 base pages
        let mut t = fresh(&c);
        assert!(c.acquire(&mut t, 12)); // 3 + 3 + 6 pages
        let cached = |c: &Coordinator, g: usize, s: usize| c.pool().is_cached(u64::from(t[g].pages()[s])).unwrap();
        // The range ends at 10 tokens, not a state page boundary: state registers nothing.
        c.register(&t, &hashes[..5], 0, Some(10)).unwrap();
        assert_eq!(
            (cached(&c, 0, 1), cached(&c, 0, 2), cached(&c, 2, 4)),
            (true, false, true)
        );
        assert!((0..3).all(|s| !cached(&c, 1, s)));
        // No end_tokens: state registers nothing.
        c.register(&t, &hashes, 0, None).unwrap();
        assert!(cached(&c, 0, 2) && (0..3).all(|s| !cached(&c, 1, s)));
        // end_tokens is a boundary but the range (8 tokens) does not end there: nothing.
        c.register(&t, &hashes[..4], 0, Some(12)).unwrap();
        assert!((0..3).all(|s| !cached(&c, 1, s)));
        // Ends exactly at 12 on a page boundary: only the last state slot (2) registers.
        c.register(&t, &hashes, 0, Some(12)).unwrap();
        assert_eq!(
            (cached(&c, 1, 0), cached(&c, 1, 1), cached(&c, 1, 2)),
            (false, false, true)
        );
        let want = GroupKey::new(fold_run(&hashes[4..6]), 1);
        assert_eq!(c.pool().lookup(&want), Some(t[1].pages()[2]));
        let want = GroupKey::new(fold_run(&hashes[0..2]), 0);
        assert_eq!(c.pool().lookup(&want), Some(t[0].pages()[0]));
        let want = GroupKey::new(hashes[3], 2);
        assert_eq!(c.pool().lookup(&want), Some(t[2].pages()[3]));
        assert_eq!(c.pool().num_cached(), 3 + 1 + 6);
    }

    #[test]
    fn register_from_an_unaligned_first_slot_starts_at_the_next_run() {
        let mut c = Coordinator::new(vec![spec("f", GroupKind::Full, 6)], 32, true).unwrap();
        let mut c3 = Coordinator::new(
            vec![spec("f", GroupKind::Full, 2), spec("g", GroupKind::Full, 6)],
            32,
            true,
        )
        .unwrap();
        let hashes = prompt(24, 2); // 12 base pages
        let mut t = fresh(&c3);
        // 12 + 4 pages. Base pages 1..12: group g skips to base 3 -> slots 1, 2, 3.
        assert!(c3.acquire(&mut t, 24));
        c3.register(&t, &hashes[1..], 1, None).unwrap();
        assert!(!c3.pool().is_cached(u64::from(t[1].pages()[0])).unwrap());
        for s in 1..4 {
            let want = GroupKey::new(fold_run(&hashes[s * 3..s * 3 + 3]), 1);
            assert_eq!(c3.pool().lookup(&want), Some(t[1].pages()[s]));
        }
        // Past the table: an error before anything is registered.
        let cached = c3.pool().num_cached();
        assert!(c3.register(&t, &hashes, 1, None).is_err());
        assert_eq!(c3.pool().num_cached(), cached);
        let mut t1 = fresh(&c);
        assert!(c.acquire(&mut t1, 6));
        assert!(c.register(&t1, &[], 5, None).is_err());
        c.register(&t1, &[], 1, None).unwrap();
    }

    #[test]
    fn register_does_nothing_with_caching_off() {
        let mut c = Coordinator::new(vec![spec("f", GroupKind::Full, 2)], 8, false).unwrap();
        let mut t = fresh(&c);
        assert!(c.acquire(&mut t, 4));
        c.register(&t, &prompt(4, 2), 0, Some(4)).unwrap();
        assert_eq!(c.pool().num_cached(), 0);
    }
}
