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
//! The tier holds `num_pages` host pages of the device pages' geometry; host page ids are
//! their own space `[0, num_pages)` (no null page). Each host page holds at most one group key
//! (the same [`GroupKey`] as the device pool's key map); a key is held by at most one host page.
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
//! Host eviction: a store takes a never-used host page first, else the least recently used
//! findable host page that no load is reading (its key is dropped); with neither, the store
//! is skipped (counted). Storing a key the host already holds (findable or in flight) is
//! skipped silently. The LRU list is the same [`LruList`] as the device free list: host page
//! `h` is its node `h + 1`, and it holds exactly the findable pages no load reads.

use hashbrown::HashMap;
use rustc_hash::FxBuildHasher;
use std::sync::Arc;

use crate::engine::events::{EventLog, KvEvent};
use crate::engine::hash::{ContentHash, GroupKey};
use crate::engine::lru::LruList;
use crate::engine::pool::{BlockPool, MAX_BLOCKS};
use crate::error::{CoreError, CoreResult};

/// Largest host tier: host page ids stay in the device pool's range (below `2**31`).
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
    /// The group index (whose layers' buffers are copied).
    pub group: u32,
    /// The device page (source of a store, destination of a load).
    pub device: u32,
    /// The host page (destination of a store, source of a load).
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

/// Counters of the tier (exposed through `stats()`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostCounters {
    /// Stores emitted.
    pub stores: u64,
    /// Stores acknowledged.
    pub stores_done: u64,
    /// Stores skipped because every host page was in flight or being read.
    pub stores_skipped: u64,
    /// Loads emitted (one per page hit on the host).
    pub loads: u64,
    /// Loads acknowledged.
    pub loads_done: u64,
    /// Host keys dropped to make room for a store.
    pub evictions: u64,
}

/// The host tier: host pages, their keys, an LRU of findable pages, and the transfers in
/// flight.
#[derive(Clone, Debug)]
pub struct HostTier {
    policy: HostStore,
    /// The key each host page holds (in flight or findable).
    keys: Vec<Option<GroupKey>>,
    /// Whether the page's store was acknowledged (the page is findable).
    ready: Vec<bool>,
    /// Loads in flight reading each page.
    readers: Vec<u32>,
    /// Key -> host page.
    map: HashMap<GroupKey, u32, FxBuildHasher>,
    /// Findable pages no load reads, front = next to evict; page `h` is node `h + 1`.
    lru: LruList,
    /// Host pages never used yet are `[next_unused, num_pages)`.
    next_unused: u32,
    ops: HashMap<u64, Op, FxBuildHasher>,
    /// Ids emitted but not taken, in emission order.
    untaken: Vec<u64>,
    next_id: u64,
    pub(crate) counters: HostCounters,
}

/// The LRU node of host page `page` (< `MAX_HOST_PAGES`, so it fits).
#[inline]
fn node(page: u32) -> u32 {
    page + 1
}

impl HostTier {
    /// A tier of `num_pages` host pages (> 0) with the store `policy`.
    pub fn new(num_pages: u64, policy: HostStore) -> CoreResult<Self> {
        if num_pages == 0 || num_pages > MAX_HOST_PAGES {
            return Err(CoreError::invalid(format!(
                "host_pages must be in [1, {MAX_HOST_PAGES}] for a host tier, got {num_pages}"
            )));
        }
        // num_pages < 2**31: both conversions hold.
        let n = usize::try_from(num_pages).map_err(|_| CoreError::overflow("host_pages"))?;
        let capacity = u32::try_from(num_pages).map_err(|_| CoreError::overflow("host_pages"))?;
        let lru = LruList::empty(capacity)
            .map_err(|_| CoreError::OutOfMemory(format!("host_pages = {n}: the host tier does not fit in memory")))?;
        Ok(Self {
            policy,
            keys: vec![None; n],
            ready: vec![false; n],
            readers: vec![0; n],
            map: HashMap::default(),
            lru,
            next_unused: 0,
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

    /// Number of host pages.
    pub fn num_pages(&self) -> usize {
        self.keys.len()
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

    /// The findable host page holding `key`, if any (read-only).
    #[inline]
    pub fn lookup(&self, key: &GroupKey) -> Option<u32> {
        let &page = self.map.get(key)?;
        self.ready[page as usize].then_some(page)
    }

    /// The LRU list, front (next to evict) first.
    pub fn lru_order(&self) -> Vec<u32> {
        self.lru.iter().map(|n| n - 1).collect()
    }

    /// A host page for a new store: a never-used one, else the LRU front (its key dropped,
    /// with a `HostRemoved` event); `None` when every page is in flight or being read.
    fn take_page(&mut self, events: &mut EventLog) -> Option<u32> {
        if (self.next_unused as usize) < self.keys.len() {
            let page = self.next_unused;
            self.next_unused += 1;
            return Some(page);
        }
        let page = self.lru.pop_front()? - 1;
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

    /// Emit a store of device page `device` (holding `key`) unless the host holds the key or
    /// has no page for it; an emitted store pins `device` until it is acknowledged.
    pub(crate) fn store(&mut self, dev: &mut Device<'_>, device: u32, key: GroupKey) {
        if self.map.contains_key(&key) {
            return;
        }
        let Some(host) = self.take_page(dev.events) else {
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

    /// Emit a load of findable host page `host` into device page `device` (already allocated
    /// and pinned by the caller); pins `host` until acknowledged.
    pub(crate) fn load(&mut self, host: u32, device: u32, owner: (usize, u64), event: LoadEvent) {
        let key = self.keys[host as usize].unwrap_or_else(|| unreachable!("a findable host page holds a key"));
        // A findable page is on the LRU list exactly while no load reads it.
        if self.readers[host as usize] == 0 {
            self.lru.unlink(node(host));
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

    /// Hand out the transfers emitted since the last call, in emission order.
    pub fn take(&mut self) -> Vec<Transfer> {
        let ids = std::mem::take(&mut self.untaken);
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(op) = self.ops.get_mut(&id) {
                op.taken = true;
                out.push(Transfer {
                    id,
                    kind: op.kind,
                    group: op.group,
                    device: op.device,
                    host: op.host,
                });
            }
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
    /// returns `None`). A store makes its host page findable (most recently used, with a
    /// `HostStored` event); a load unpins its source and registers its destination under
    /// the key (a device hit from now on, with its `BlockStored` event) unless caching is
    /// off or the page holds a key already. Either way the device page's pin is dropped.
    /// Returns a load's owner. Call [`Self::store_released`] after a batch of these.
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
            self.lru.push_back(node(op.host));
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
        // Membership per node: host page p is node p + 1.
        let on_lru = self.lru.check("host LRU list")?;
        for p in 0..n {
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
            if on_lru[p + 1] != want {
                return Err(format!(
                    "host page {p} is on the LRU list: {}, expected {want}",
                    on_lru[p + 1]
                ));
            }
            if let Some(k) = &self.keys[p] {
                if self.map.get(k) != Some(&u32::try_from(p).unwrap_or(u32::MAX)) {
                    return Err(format!("host key map does not point at host page {p}"));
                }
            } else if p < self.next_unused as usize {
                return Err(format!("host page {p} is used but holds no key"));
            }
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
        assert_eq!(tier.lru_order(), vec![1, 0]);
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
        assert_eq!(tier.lru_order(), vec![1]);
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
        assert_eq!(tier.lru_order(), vec![0]);
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
            (tier.num_pages(), tier.policy(), tier.lru_order()),
            (3, HostStore::Evict, vec![])
        );
    }
}
