//! The host-memory tier: evicted or registered device pages kept in host memory and loaded
//! back on a prefix hit, for every group kind.
//!
//! Layering: this module knows the device only as the pool, its keys and the event log
//! (`Device`); it knows nothing of the coordinator or of requests. The coordinator owns an
//! optional [`HostTier`] and calls it at four points: a tiered prefix match asks
//! [`HostTier::lookup`] for keys the device misses (a host hit is a separate entry of the
//! match, see [`crate::engine::coordinator::HostHit`]), a claim emits loads
//! (`HostTier::load`), registering and releasing pages emit stores by the policy, and an
//! acknowledgement finishes a transfer (`HostTier::finish`). The cache's public calls
//! (`take_transfers`, `ack_transfers`, ...) are in `engine/calls/host.rs`.
//!
//! Host pages live in *spaces*. Over a pool of equal pages ([`HostTier::new`]) one space of
//! `num_pages` host pages of the device pages' geometry serves every group. Over an arena
//! (SPEC 13), where each group has its own page geometry (a state group's page is a whole state
//! slot), each group with host pages has its own space of pages of its geometry
//! ([`HostTier::per_group`]); a group without any is not tiered (nothing of it is stored or
//! looked up). A space's page ids are its own, `[0, len)` (no null page): that is what a
//! [`Transfer`] names, with its group telling the space. Inside the tier the pages of all
//! spaces are one array (space `s` holds `[base_s, base_s + len_s)`), so the key map, the
//! transfers and the counters are shared; the never-used pages and the LRU list are per space,
//! so a store of one group only ever takes (and evicts) a page of its own space. Each host page
//! holds at most one group key (the same [`GroupKey`] as the device pool's key map); a key is
//! held by at most one host page.
//!
//! The cache never copies memory itself: it emits transfer operations that the engine runs
//! and then acknowledges, in any order.
//! - A *store* copies device page `d` to host page `h` (one group's layers). While it is in
//!   flight, `d` carries one extra reference (it is never handed out again, evicted or not),
//!   and `h` is reserved under its key but not yet findable. Its acknowledgement makes `h`
//!   findable and drops the extra reference (`d` joins the free list if nothing else holds it).
//! - A *load* copies host page `h` to device page `d`. `d` was allocated for the request that
//!   hit `h` (it sits in the request's table) and carries one extra reference until the load
//!   is acknowledged; `h` is pinned (never overwritten) until then. The acknowledgement
//!   registers `d` under the key (it becomes a device hit for everyone) and drops the pins. A
//!   request with loads in flight cannot be scheduled (see [`crate::engine::FlatCache`]).
//!
//! Store policy ([`HostStore`]):
//! - `WriteThrough` (default): every page newly registered on the device is stored at once (if
//!   its key is not on the host yet). Stores overlap with the request that wrote the page, and
//!   an evicted device page is always already on the host.
//! - `Evict`: a cached page is stored when its last reference goes, i.e. when it would become
//!   evictable; it joins the device free list only once the store is acknowledged. Pages that
//!   are hit again while still held are never copied.
//!
//! Host eviction: a store takes a never-used page of its space first, else the least recently
//! used findable page of its space that no load is reading (its key is dropped); with neither,
//! the store is skipped (counted). Storing a key the host already holds (findable or in flight)
//! is skipped silently, and so is a store of a group without host pages. The LRU lists are the
//! same [`LruList`] as the device free list: a space's page `h` is its node `h + 1`, and each
//! holds exactly the space's findable pages no load reads.

use hashbrown::HashMap;
use rustc_hash::FxBuildHasher;
use std::sync::Arc;

use crate::engine::events::{EventLog, KvEvent};
use crate::engine::hash::{ContentHash, GroupKey};
use crate::engine::lru::LruList;
use crate::engine::pool::{BlockPool, MAX_BLOCKS};
use crate::error::{CoreError, CoreResult};

/// Largest host tier, all spaces together: host page ids stay in the device pool's range
/// (below `2**31`).
pub const MAX_HOST_PAGES: u64 = MAX_BLOCKS;

/// When registered device pages are copied to the host tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HostStore {
    /// Store every newly registered page at once.
    #[default]
    WriteThrough,
    /// Store a cached page when its last reference goes (when it would become evictable).
    Evict,
}

impl HostStore {
    /// The policy named `name` (`"write_through"` or `"evict"`).
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "write_through" => Some(Self::WriteThrough),
            "evict" => Some(Self::Evict),
            _ => None,
        }
    }

    /// The policy's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::WriteThrough => "write_through",
            Self::Evict => "evict",
        }
    }
}

/// The direction of a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferKind {
    /// Device page -> host page.
    Store,
    /// Host page -> device page.
    Load,
}

/// One transfer handed to the engine by [`crate::engine::FlatCache::take_transfers`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// The id to acknowledge it with.
    pub id: u64,
    /// Store or load.
    pub kind: TransferKind,
    /// The group index (whose layers' buffers are copied, and whose host space `host` is in).
    pub group: u32,
    /// The device page (source of a store, destination of a load). [`HostTier::take`] gives
    /// the pool's id; the cache's `take_transfers` gives the index in the group's view (the
    /// same id without an arena).
    pub device: u32,
    /// The host page (destination of a store, source of a load), in the group's host space.
    pub host: u32,
}

/// What the `BlockStored` event of a loaded page says once it is registered on the device.
#[derive(Clone, Debug)]
pub(crate) struct LoadEvent {
    pub parent: Option<ContentHash>,
    pub token_ids: Vec<u32>,
    pub extra_keys: Arc<[String]>,
}

/// A transfer in flight.
#[derive(Clone, Debug)]
struct Op {
    kind: TransferKind,
    group: u32,
    device: u32,
    /// The host page in the tier's one array (not the space's id).
    host: u32,
    key: GroupKey,
    /// Handed out by `take_transfers` (only those can be acknowledged).
    taken: bool,
    /// A load's request: (slab position, serial) so a late acknowledgement after the request
    /// ended (or its slot was reused) is recognised.
    owner: Option<(usize, u64)>,
    /// A load's event payload.
    event: Option<LoadEvent>,
}

/// The device side a tier's operations change: the pool (pins, registrations of loaded
/// pages), the coordinator's count of pages in use per group, and the event log.
pub(crate) struct Device<'a> {
    pub pool: &'a mut BlockPool<GroupKey>,
    pub in_use: &'a mut [usize],
    pub events: &'a mut EventLog,
}

impl Device<'_> {
    /// Take one more reference on `page` of `group` (a transfer's pin).
    fn pin(&mut self, page: u32, group: u32) {
        if self.pool.retain(page) {
            self.in_use[group as usize] += 1;
        }
    }

    /// Drop a transfer's pin on `page` of `group`.
    fn unpin(&mut self, page: u32, group: u32) {
        if self.pool.release(page) {
            self.in_use[group as usize] -= 1;
        }
    }
}

/// Counters of the tier, over every space (exposed through `stats()`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostCounters {
    /// Stores emitted.
    pub stores: u64,
    /// Stores acknowledged.
    pub stores_done: u64,
    /// Stores skipped because every page of their space was in flight or being read.
    pub stores_skipped: u64,
    /// Loads emitted (one per page hit on the host).
    pub loads: u64,
    /// Loads acknowledged.
    pub loads_done: u64,
    /// Host keys dropped to make room for a store.
    pub evictions: u64,
}

/// One host page space: the pages `[base, base + len)` of the tier's arrays, with its own
/// never-used tail and LRU list.
#[derive(Clone, Debug)]
struct Space {
    base: u32,
    len: u32,
    /// The space's pages never used yet are `[next_unused, len)` (space ids).
    next_unused: u32,
    /// Findable pages no load reads, front = next to evict; space page `h` is node `h + 1`.
    lru: LruList,
}

impl Space {
    fn new(base: u32, len: u32) -> CoreResult<Self> {
        let lru = LruList::empty(len)
            .map_err(|_| CoreError::OutOfMemory(format!("host_pages = {len}: the host tier does not fit in memory")))?;
        Ok(Self {
            base,
            len,
            next_unused: 0,
            lru,
        })
    }
}

/// Which space serves each group.
#[derive(Clone, Debug)]
enum Layout {
    /// Space 0 serves every group (a pool of equal pages).
    Shared,
    /// Per group, its space (`None`: the group has no host pages).
    PerGroup(Vec<Option<u32>>),
}

/// The host tier: host pages in spaces, their keys, an LRU list per space of findable pages,
/// and the transfers in flight.
#[derive(Clone, Debug)]
pub struct HostTier {
    policy: HostStore,
    layout: Layout,
    spaces: Vec<Space>,
    /// The key each host page holds (in flight or findable), over every space.
    keys: Vec<Option<GroupKey>>,
    /// Whether the page's store was acknowledged (the page is findable).
    ready: Vec<bool>,
    /// Loads in flight reading each page.
    readers: Vec<u32>,
    /// Key -> host page (in the tier's one array).
    map: HashMap<GroupKey, u32, FxBuildHasher>,
    ops: HashMap<u64, Op, FxBuildHasher>,
    /// Ids emitted but not taken, in emission order.
    untaken: Vec<u64>,
    next_id: u64,
    pub(crate) counters: HostCounters,
}

/// The LRU node of space page `page` (< `MAX_HOST_PAGES`, so it fits).
#[inline]
fn node(page: u32) -> u32 {
    page + 1
}

/// A vector of `n` copies of `value`, allocation failure reported as an error.
fn filled<T: Clone>(n: usize, value: T) -> CoreResult<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| CoreError::OutOfMemory(format!("host_pages = {n}: the host tier does not fit in memory")))?;
    v.resize(n, value);
    Ok(v)
}

impl HostTier {
    /// A tier of `num_pages` host pages (> 0) with the store `policy`, one space serving
    /// every group (a pool of equal pages).
    pub fn new(num_pages: u64, policy: HostStore) -> CoreResult<Self> {
        if num_pages == 0 || num_pages > MAX_HOST_PAGES {
            return Err(CoreError::invalid(format!(
                "host_pages must be in [1, {MAX_HOST_PAGES}] for a host tier, got {num_pages}"
            )));
        }
        // num_pages < 2**31: the conversion holds.
        let len = u32::try_from(num_pages).map_err(|_| CoreError::overflow("host_pages"))?;
        Self::with_spaces(policy, Layout::Shared, &[len])
    }

    /// A tier whose group `g` has a space of `pages[g]` host pages of its own geometry (0: the
    /// group is not tiered), with the store `policy`: the host tier over an arena. At least one
    /// group has pages, and all of them together at most [`MAX_HOST_PAGES`].
    pub fn per_group(pages: &[u64], policy: HostStore) -> CoreResult<Self> {
        let total: u128 = pages.iter().map(|&n| u128::from(n)).sum();
        if total == 0 || total > u128::from(MAX_HOST_PAGES) {
            return Err(CoreError::invalid(format!(
                "host_pages: the groups' host pages add up to {total}, which must be in [1, {MAX_HOST_PAGES}] \
                 for a host tier (host page ids are int32)"
            )));
        }
        let mut of_group = Vec::with_capacity(pages.len());
        let mut lens = Vec::new();
        for &n in pages {
            if n == 0 {
                of_group.push(None);
            } else {
                // Each count is at most the total, below 2**31.
                of_group.push(Some(
                    u32::try_from(lens.len()).map_err(|_| CoreError::overflow("host_pages"))?,
                ));
                lens.push(u32::try_from(n).map_err(|_| CoreError::overflow("host_pages"))?);
            }
        }
        Self::with_spaces(policy, Layout::PerGroup(of_group), &lens)
    }

    /// The tier of spaces of `lens` pages (each > 0, their sum < 2**31), laid out in order.
    fn with_spaces(policy: HostStore, layout: Layout, lens: &[u32]) -> CoreResult<Self> {
        let mut spaces = Vec::with_capacity(lens.len());
        let mut base = 0u32;
        for &len in lens {
            spaces.push(Space::new(base, len)?);
            base = base.checked_add(len).ok_or_else(|| CoreError::overflow("host_pages"))?;
        }
        let n = base as usize;
        Ok(Self {
            policy,
            layout,
            spaces,
            keys: filled(n, None)?,
            ready: filled(n, false)?,
            readers: filled(n, 0)?,
            map: HashMap::default(),
            ops: HashMap::default(),
            untaken: Vec::new(),
            next_id: 1,
            counters: HostCounters::default(),
        })
    }

    /// The store policy.
    pub fn policy(&self) -> HostStore {
        self.policy
    }

    /// Number of host pages, every space together.
    pub fn num_pages(&self) -> usize {
        self.keys.len()
    }

    /// The space serving `group`, if it has one.
    #[inline]
    fn space_of(&self, group: u32) -> Option<usize> {
        match &self.layout {
            Layout::Shared => Some(0),
            Layout::PerGroup(of) => of.get(group as usize).copied().flatten().map(|s| s as usize),
        }
    }

    /// Host pages `group` can use: its space's (shared by every group without an arena).
    pub fn pages_of_group(&self, group: u32) -> usize {
        self.space_of(group).map_or(0, |s| self.spaces[s].len as usize)
    }

    /// Host pages holding a key (findable or being stored).
    pub fn num_used(&self) -> usize {
        self.map.len()
    }

    /// Transfers in flight (taken or not).
    pub fn num_in_flight(&self) -> usize {
        self.ops.len()
    }

    /// Whether newly registered device pages are stored at once (write-through).
    pub fn stores_on_register(&self) -> bool {
        self.policy == HostStore::WriteThrough
    }

    /// Whether cached device pages are stored when their last reference goes (evict).
    pub fn stores_on_release(&self) -> bool {
        self.policy == HostStore::Evict
    }

    /// The findable host page holding `key`, if any (read-only; a page of the tier's one
    /// array, as `load` takes it).
    #[inline]
    pub fn lookup(&self, key: &GroupKey) -> Option<u32> {
        let &page = self.map.get(key)?;
        self.ready[page as usize].then_some(page)
    }

    /// `group`'s LRU list, front (next to evict) first, as pages of its space.
    pub fn lru_order(&self, group: u32) -> Vec<u32> {
        self.space_of(group)
            .map_or_else(Vec::new, |s| self.spaces[s].lru.iter().map(|n| n - 1).collect())
    }

    /// A host page of space `s` for a new store: a never-used one, else the LRU front (its
    /// key dropped, with a `HostRemoved` event); `None` when every page of the space is in
    /// flight or being read. The page is returned in the tier's one array.
    fn take_page(&mut self, s: usize, events: &mut EventLog) -> Option<u32> {
        let space = &mut self.spaces[s];
        let local = if space.next_unused < space.len {
            space.next_unused += 1;
            space.next_unused - 1
        } else {
            space.lru.pop_front()? - 1
        };
        let page = space.base + local;
        if let Some(key) = self.keys[page as usize].take() {
            self.map.remove(&key);
            events.push(KvEvent::HostRemoved {
                hash: key.hash,
                group: key.group,
            });
            self.counters.evictions = self.counters.evictions.saturating_add(1);
        }
        self.ready[page as usize] = false;
        Some(page)
    }

    fn push_op(&mut self, op: Op) -> u64 {
        let id = self.next_id;
        // A u64 counter of single increments cannot overflow in practice.
        self.next_id = self.next_id.saturating_add(1);
        self.ops.insert(id, op);
        self.untaken.push(id);
        id
    }

    /// Emit a store of device page `device` (holding `key`) unless the host holds the key, the
    /// key's group has no host pages, or its space has no page for it; an emitted store pins
    /// `device` until it is acknowledged.
    pub(crate) fn store(&mut self, dev: &mut Device<'_>, device: u32, key: GroupKey) {
        let Some(s) = self.space_of(key.group) else {
            return;
        };
        if self.map.contains_key(&key) {
            return;
        }
        let Some(host) = self.take_page(s, dev.events) else {
            self.counters.stores_skipped = self.counters.stores_skipped.saturating_add(1);
            return;
        };
        self.keys[host as usize] = Some(key);
        self.map.insert(key, host);
        self.counters.stores = self.counters.stores.saturating_add(1);
        self.push_op(Op {
            kind: TransferKind::Store,
            group: key.group,
            device,
            host,
            key,
            taken: false,
            owner: None,
            event: None,
        });
        dev.pin(device, key.group);
    }

    /// The evict policy: store every cached device page that joined the free list since the
    /// last call (in release order); a stored page leaves the free list until acknowledged.
    /// Does nothing under write-through.
    pub(crate) fn store_released(&mut self, dev: &mut Device<'_>) {
        if !self.stores_on_release() {
            return;
        }
        for page in dev.pool.take_released() {
            if dev.pool.refs_of(page) != 0 {
                continue;
            }
            if let Some(&key) = dev.pool.key_of(page) {
                self.store(dev, page, key);
            }
        }
    }

    /// Emit a load of findable host page `host` (from [`Self::lookup`]) into device page
    /// `device` (already allocated and pinned by the caller); pins `host` until acknowledged.
    pub(crate) fn load(&mut self, host: u32, device: u32, owner: (usize, u64), event: LoadEvent) {
        let key = self.keys[host as usize].unwrap_or_else(|| unreachable!("a findable host page holds a key"));
        let s = self
            .space_of(key.group)
            .unwrap_or_else(|| unreachable!("a host page lies in its group's space"));
        // A findable page is on its space's LRU list exactly while no load reads it.
        if self.readers[host as usize] == 0 {
            let space = &mut self.spaces[s];
            space.lru.unlink(node(host - space.base));
        }
        self.readers[host as usize] += 1;
        self.counters.loads = self.counters.loads.saturating_add(1);
        self.push_op(Op {
            kind: TransferKind::Load,
            group: key.group,
            device,
            host,
            key,
            taken: false,
            owner: Some(owner),
            event: Some(event),
        });
    }

    /// Hand out the transfers emitted since the last call, in emission order; each names its
    /// host page in its group's space, and its device page by the pool's id.
    pub fn take(&mut self) -> Vec<Transfer> {
        let ids = std::mem::take(&mut self.untaken);
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let Some(op) = self.ops.get_mut(&id) else {
                continue;
            };
            op.taken = true;
            let (kind, group, device, host) = (op.kind, op.group, op.device, op.host);
            let base = self.space_of(group).map_or(0, |s| self.spaces[s].base);
            out.push(Transfer {
                id,
                kind,
                group,
                device,
                host: host - base,
            });
        }
        out
    }

    /// Check that `ids` can be acknowledged: each in flight, taken, and listed once.
    pub fn check_ack(&self, ids: &[u64]) -> CoreResult<()> {
        let mut seen = hashbrown::HashSet::with_capacity_and_hasher(ids.len(), FxBuildHasher);
        for &id in ids {
            match self.ops.get(&id) {
                None => {
                    return Err(CoreError::invalid(format!(
                        "ack_transfers: transfer {id} is not in flight (unknown or already acknowledged)"
                    )))
                }
                Some(op) if !op.taken => {
                    return Err(CoreError::invalid(format!(
                        "ack_transfers: transfer {id} was not handed out yet (call take_transfers first)"
                    )))
                }
                Some(_) => {}
            }
            if !seen.insert(id) {
                return Err(CoreError::invalid(format!(
                    "ack_transfers: transfer {id} is listed twice"
                )));
            }
        }
        Ok(())
    }

    /// Finish transfer `id` (checked by [`Self::check_ack`]; an unknown id does nothing and
    /// returns `None`). A store makes its host page findable (most recently used in its
    /// space, with a `HostStored` event); a load unpins its source and registers its
    /// destination under the key (a device hit from now on, with its `BlockStored` event)
    /// unless caching is off or the page holds a key already. Either way the device page's pin
    /// is dropped. Returns a load's owner. Call [`Self::store_released`] after a batch of these.
    pub(crate) fn finish(&mut self, dev: &mut Device<'_>, id: u64) -> Option<(usize, u64)> {
        let mut op = self.ops.remove(&id)?;
        let h = op.host as usize;
        match op.kind {
            TransferKind::Store => {
                self.ready[h] = true;
                dev.events.push(KvEvent::HostStored {
                    hash: op.key.hash,
                    group: op.key.group,
                });
                self.counters.stores_done = self.counters.stores_done.saturating_add(1);
            }
            TransferKind::Load => {
                self.readers[h] -= 1;
                self.counters.loads_done = self.counters.loads_done.saturating_add(1);
            }
        }
        // A store's page was not findable, a load's was read: neither is on the LRU list.
        if self.ready[h] && self.readers[h] == 0 {
            if let Some(s) = self.space_of(op.group) {
                let space = &mut self.spaces[s];
                space.lru.push_back(node(op.host - space.base));
            }
        }
        if op.kind == TransferKind::Load && dev.pool.caching_enabled() && dev.pool.key_of(op.device).is_none() {
            dev.pool.cache_unchecked(op.device, op.key);
            if let Some(ev) = op.event.take() {
                dev.events.push(KvEvent::Stored {
                    hashes: vec![op.key.hash],
                    parent: ev.parent,
                    token_ids: ev.token_ids,
                    group: op.group,
                    extra_keys: ev.extra_keys,
                });
            }
        }
        dev.unpin(op.device, op.group);
        op.owner
    }

    /// Per transfer in flight: the device page it holds a reference on, its group, and a
    /// load's owner.
    pub(crate) fn pins(&self) -> impl Iterator<Item = (u32, u32, Option<(usize, u64)>)> + '_ {
        self.ops.values().map(|op| (op.device, op.group, op.owner))
    }

    /// Check the tier's own bookkeeping; a description of the first violation.
    pub fn check(&self) -> Result<(), String> {
        let n = self.keys.len();
        let mut readers = vec![0u32; n];
        let mut storing = vec![false; n];
        for op in self.ops.values() {
            let h = op.host as usize;
            if h >= n {
                return Err(format!("transfer refers to host page {h} out of range"));
            }
            match op.kind {
                TransferKind::Load => readers[h] += 1,
                TransferKind::Store => storing[h] = true,
            }
            if self.keys[h] != Some(op.key) {
                return Err(format!("host page {h} does not hold the key of its transfer"));
            }
        }
        let mut covered = 0usize;
        for (s, space) in self.spaces.iter().enumerate() {
            if space.base as usize != covered || space.next_unused > space.len {
                return Err(format!("host space {s} is misplaced or past its end"));
            }
            covered += space.len as usize;
            // Membership per node: space page p is node p + 1.
            let on_lru = space.lru.check("host LRU list")?;
            for local in 0..space.len as usize {
                let p = space.base as usize + local;
                if let Some(k) = &self.keys[p] {
                    if self.space_of(k.group) != Some(s) {
                        return Err(format!(
                            "host page {p} holds a key of group {}, not of its space",
                            k.group
                        ));
                    }
                    if self.map.get(k) != Some(&u32::try_from(p).unwrap_or(u32::MAX)) {
                        return Err(format!("host key map does not point at host page {p}"));
                    }
                } else if local < space.next_unused as usize {
                    return Err(format!("host page {p} is used but holds no key"));
                }
                if readers[p] != self.readers[p] {
                    return Err(format!(
                        "host page {p} counts {} readers but {} loads read it",
                        self.readers[p], readers[p]
                    ));
                }
                if storing[p] == self.ready[p] && self.keys[p].is_some() {
                    return Err(format!("host page {p} is both findable and being stored, or neither"));
                }
                if readers[p] > 0 && !self.ready[p] {
                    return Err(format!("host page {p} is read before its store was acknowledged"));
                }
                let want = self.ready[p] && readers[p] == 0;
                if on_lru[local + 1] != want {
                    return Err(format!(
                        "host page {p} is on the LRU list: {}, expected {want}",
                        on_lru[local + 1]
                    ));
                }
            }
        }
        if covered != n {
            return Err("host spaces do not cover the host pages".to_owned());
        }
        if self.map.len() != self.keys.iter().filter(|k| k.is_some()).count() {
            return Err("host key map and host pages disagree".to_owned());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8, group: u32) -> GroupKey {
        GroupKey::new([n; 32], group)
    }

    /// The device side of a tier under test: a pool, two groups' in-use counts, an event log.
    struct Rig {
        pool: BlockPool<GroupKey>,
        in_use: Vec<usize>,
        events: EventLog,
    }

    impl Rig {
        fn new(pages: u64) -> Self {
            Self {
                pool: BlockPool::new(pages, true).unwrap(),
                in_use: vec![0; 2],
                events: EventLog::new(true),
            }
        }

        fn dev(&mut self) -> Device<'_> {
            Device {
                pool: &mut self.pool,
                in_use: &mut self.in_use,
                events: &mut self.events,
            }
        }

        /// Allocate a page and register `key` on it (count 1).
        fn cached(&mut self, key: GroupKey) -> u32 {
            let page = self.pool.allocate(1)[0];
            self.pool.cache_unchecked(page, key);
            page
        }
    }

    fn load_event() -> LoadEvent {
        LoadEvent {
            parent: None,
            token_ids: vec![7],
            extra_keys: Arc::from(Vec::new()),
        }
    }

    #[test]
    fn stores_take_unused_pages_then_become_findable_most_recent_last() {
        let mut rig = Rig::new(8);
        let mut tier = HostTier::new(2, HostStore::WriteThrough).unwrap();
        let (k1, k2, k3) = (key(1, 0), key(2, 0), key(3, 1));
        let (d1, d2, d3) = (rig.cached(k1), rig.cached(k2), rig.cached(k3));
        tier.store(&mut rig.dev(), d1, k1);
        tier.store(&mut rig.dev(), d2, k2);
        // The key is held (in flight): skipped silently. No page left: skipped and counted.
        tier.store(&mut rig.dev(), d3, k1);
        tier.store(&mut rig.dev(), d3, k3);
        assert_eq!((tier.counters.stores, tier.counters.stores_skipped), (2, 1));
        assert_eq!(
            (rig.pool.refs_of(d1), rig.pool.refs_of(d2), rig.pool.refs_of(d3)),
            (2, 2, 1)
        );
        assert_eq!((tier.lookup(&k1), tier.num_used(), tier.num_in_flight()), (None, 2, 2));
        let t = tier.take();
        assert_eq!(
            t.iter().map(|x| (x.id, x.kind, x.device, x.host)).collect::<Vec<_>>(),
            vec![(1, TransferKind::Store, d1, 0), (2, TransferKind::Store, d2, 1)]
        );
        assert!(tier.take().is_empty());
        assert!(tier.check_ack(&[1, 1]).is_err() && tier.check_ack(&[9]).is_err());
        tier.check_ack(&[2, 1]).unwrap();
        assert_eq!(tier.finish(&mut rig.dev(), 2), None);
        assert_eq!(tier.finish(&mut rig.dev(), 1), None);
        assert_eq!(tier.finish(&mut rig.dev(), 1), None, "an unknown id does nothing");
        assert_eq!((tier.lookup(&k1), tier.lookup(&k2)), (Some(0), Some(1)));
        assert_eq!(tier.lru_order(0), vec![1, 0]);
        assert_eq!((rig.pool.refs_of(d1), rig.pool.refs_of(d2)), (1, 1));
        assert_eq!(
            rig.events.take(),
            vec![
                KvEvent::HostStored {
                    hash: k2.hash,
                    group: 0
                },
                KvEvent::HostStored {
                    hash: k1.hash,
                    group: 0
                },
            ]
        );
        tier.check().unwrap();
        rig.pool.check().unwrap();
    }

    #[test]
    fn loads_pin_their_source_and_evictions_take_the_lru_front() {
        let mut rig = Rig::new(8);
        let mut tier = HostTier::new(2, HostStore::WriteThrough).unwrap();
        let (k1, k2, k3, k4) = (key(1, 0), key(2, 0), key(3, 1), key(4, 1));
        for k in [k1, k2] {
            let d = rig.cached(k);
            tier.store(&mut rig.dev(), d, k);
        }
        let ids: Vec<u64> = tier.take().iter().map(|t| t.id).collect();
        for id in ids {
            tier.finish(&mut rig.dev(), id);
        }
        rig.events.take();
        // Load k1's host page into a fresh device page (the caller's table reference and pin).
        let dest = rig.pool.allocate(1)[0];
        rig.pool.retain(dest);
        tier.load(0, dest, (5, 6), load_event());
        assert_eq!(tier.lru_order(0), vec![1]);
        // A store evicts the LRU front (k2), never the page being read; then nothing is left.
        let d3 = rig.cached(k3);
        tier.store(&mut rig.dev(), d3, k3);
        let d4 = rig.cached(k4);
        tier.store(&mut rig.dev(), d4, k4);
        assert_eq!(
            (tier.counters.evictions, tier.counters.stores_skipped, tier.lookup(&k2)),
            (1, 1, None)
        );
        assert_eq!(
            rig.events.take(),
            vec![KvEvent::HostRemoved {
                hash: k2.hash,
                group: 0
            }]
        );
        tier.check().unwrap();
        let t = tier.take();
        assert_eq!(
            t.iter()
                .map(|x| (x.kind, x.group, x.device, x.host))
                .collect::<Vec<_>>(),
            vec![(TransferKind::Load, 0, dest, 0), (TransferKind::Store, 1, d3, 1)]
        );
        // The load's acknowledgement registers its destination and unpins both sides.
        assert_eq!(tier.finish(&mut rig.dev(), t[0].id), Some((5, 6)));
        assert_eq!((rig.pool.key_of(dest), rig.pool.refs_of(dest)), (Some(&k1), 1));
        assert_eq!(tier.lru_order(0), vec![0]);
        assert_eq!(
            rig.events.take(),
            vec![KvEvent::Stored {
                hashes: vec![k1.hash],
                parent: None,
                token_ids: vec![7],
                group: 0,
                extra_keys: Arc::from(Vec::new()),
            }]
        );
        tier.check().unwrap();
        rig.pool.check().unwrap();
    }

    #[test]
    fn the_evict_policy_stores_released_cached_pages() {
        for policy in [HostStore::WriteThrough, HostStore::Evict] {
            let mut rig = Rig::new(4);
            rig.pool.set_record_released(true);
            let mut tier = HostTier::new(4, policy).unwrap();
            let k = key(1, 1);
            let cached = rig.cached(k);
            let plain = rig.pool.allocate(1)[0];
            rig.pool.free(&[u64::from(cached), u64::from(plain)]).unwrap();
            tier.store_released(&mut rig.dev());
            let evict = policy == HostStore::Evict;
            assert_eq!(tier.stores_on_release(), evict);
            assert_eq!(tier.stores_on_register(), !evict);
            // Only the cached page is stored: it leaves the free list, pinned for group 1.
            assert_eq!(tier.num_in_flight(), usize::from(evict));
            assert_eq!(rig.pool.refs_of(cached), u32::from(evict));
            assert_eq!(rig.in_use, vec![0, usize::from(evict)]);
            assert_eq!(rig.pool.refs_of(plain), 0);
            tier.check().unwrap();
        }
    }

    #[test]
    fn tier_size_is_checked() {
        assert!(HostTier::new(0, HostStore::Evict).is_err());
        assert!(HostTier::new(MAX_HOST_PAGES + 1, HostStore::Evict).is_err());
        let tier = HostTier::new(3, HostStore::Evict).unwrap();
        assert_eq!(
            (tier.num_pages(), tier.policy(), tier.lru_order(0)),
            (3, HostStore::Evict, vec![])
        );
    }

    #[test]
    fn per_group_spaces_have_their_own_ids_pages_and_lru() {
        // Group 0: 2 host pages, group 1: none, group 2: 1 page (the tier's pages 2 of its array).
        let mut rig = Rig::new(16);
        rig.in_use = vec![0; 3];
        let mut tier = HostTier::per_group(&[2, 0, 1], HostStore::WriteThrough).unwrap();
        assert_eq!(tier.num_pages(), 3);
        assert_eq!(
            (tier.pages_of_group(0), tier.pages_of_group(1), tier.pages_of_group(2)),
            (2, 0, 1)
        );
        let (a1, a2, a3) = (key(1, 0), key(2, 0), key(3, 0));
        let (b1, c1, c2) = (key(4, 1), key(5, 2), key(6, 2));
        let pages: Vec<u32> = [a1, a2, b1, c1].iter().map(|&k| rig.cached(k)).collect();
        for (&d, k) in pages.iter().zip([a1, a2, b1, c1]) {
            tier.store(&mut rig.dev(), d, k);
        }
        // Group 1 is not tiered: its store is neither emitted nor counted, nor pinned.
        assert_eq!((tier.counters.stores, tier.counters.stores_skipped), (3, 0));
        assert_eq!(
            pages.iter().map(|&d| rig.pool.refs_of(d)).collect::<Vec<_>>(),
            vec![2, 2, 1, 2]
        );
        // Group 2's second key finds its one page in flight: skipped, although group 0's space
        // will have a findable page; and group 0's third key waits for its own space too.
        let d = rig.cached(c2);
        tier.store(&mut rig.dev(), d, c2);
        let d = rig.cached(a3);
        tier.store(&mut rig.dev(), d, a3);
        assert_eq!(tier.counters.stores_skipped, 2);
        let t = tier.take();
        // Host ids are per space: group 2's first page is its page 0.
        assert_eq!(
            t.iter().map(|x| (x.group, x.host)).collect::<Vec<_>>(),
            vec![(0, 0), (0, 1), (2, 0)]
        );
        for x in &t {
            tier.finish(&mut rig.dev(), x.id);
        }
        assert_eq!(
            (tier.lru_order(0), tier.lru_order(1), tier.lru_order(2)),
            (vec![0, 1], vec![], vec![0])
        );
        assert_eq!((tier.lookup(&a1), tier.lookup(&c1)), (Some(0), Some(2)));
        tier.check().unwrap();
        rig.events.take();
        // A store of group 2 evicts group 2's page, never group 0's least recently used one.
        let d = rig.cached(c2);
        tier.store(&mut rig.dev(), d, c2);
        assert_eq!(
            rig.events.take(),
            vec![KvEvent::HostRemoved {
                hash: c1.hash,
                group: 2
            }]
        );
        assert_eq!((tier.lookup(&a1), tier.lookup(&c1)), (Some(0), None));
        let t = tier.take();
        assert_eq!((t[0].group, t[0].host, t[0].device), (2, 0, d));
        // A load of group 0's page 1 takes it off group 0's list only.
        let dest = rig.pool.allocate(1)[0];
        rig.pool.retain(dest);
        tier.load(tier.lookup(&a2).unwrap(), dest, (0, 0), load_event());
        assert_eq!((tier.lru_order(0), tier.lru_order(2)), (vec![0], vec![]));
        let loads = tier.take();
        assert_eq!(
            (loads[0].kind, loads[0].group, loads[0].host),
            (TransferKind::Load, 0, 1)
        );
        tier.check().unwrap();
        tier.finish(&mut rig.dev(), t[0].id);
        tier.finish(&mut rig.dev(), loads[0].id);
        assert_eq!((tier.lru_order(0), tier.lru_order(2)), (vec![0, 1], vec![0]));
        tier.check().unwrap();
        rig.pool.check().unwrap();
    }

    #[test]
    fn per_group_sizes_are_checked() {
        assert!(HostTier::per_group(&[0, 0], HostStore::Evict).is_err());
        assert!(HostTier::per_group(&[], HostStore::Evict).is_err());
        assert!(HostTier::per_group(&[MAX_HOST_PAGES, 1], HostStore::Evict).is_err());
        assert!(HostTier::per_group(&[u64::MAX, u64::MAX], HostStore::Evict).is_err());
        let tier = HostTier::per_group(&[3, 0, 1], HostStore::Evict).unwrap();
        assert_eq!(
            (tier.num_pages(), tier.pages_of_group(1), tier.pages_of_group(9)),
            (4, 0, 0)
        );
        tier.check().unwrap();
    }
}
