//! The cache's host-tier calls: claiming a tiered match with its loads, the check that keeps
//! a request with loads in flight from being scheduled, and `take_transfers` /
//! `ack_transfers` and their probes. The tier itself is [`crate::engine::host`]; this layer
//! ties its transfers to requests (a load's owner is a slot and serial).

use crate::engine::coordinator::{PrefixMatch, TokenContext};
use crate::engine::host::{HostTier, Transfer};
use crate::engine::ids::RequestIdRef;
use crate::engine::FlatCache;
use crate::error::{CoreError, CoreResult};

impl FlatCache {
    /// Claim a (tiered) match for the new token-level request in slot `at`: device
    /// hits are claimed, host hits get device destinations and load transfers.
    pub(in crate::engine) fn claim_with_loads(&mut self, at: usize, m: &PrefixMatch) -> CoreResult<()> {
        let entry = &mut self.entries[at];
        let Some(state) = entry.tokens.as_ref() else {
            return Ok(());
        };
        let ctx = TokenContext {
            tokens: &state.tokens,
            hashes: &state.hashes,
            extra_keys: &state.extra_keys,
        };
        let loads = self.coord.claim_tiered(&mut entry.tables, m, (at, entry.serial), ctx)?;
        entry.loading = u64::try_from(loads).unwrap_or(u64::MAX);
        Ok(())
    }

    /// A request with loads in flight cannot be scheduled: its pages are not filled yet.
    pub(in crate::engine) fn check_loaded(&self, method: &str, at: usize) -> CoreResult<()> {
        match self.entries[at].loading {
            0 => Ok(()),
            n => Err(CoreError::invalid(format!(
                "{method}: {} has {n} host page load(s) in flight; run take_transfers() \
                 and ack_transfers() first (loads_in_flight tells when it can be scheduled)",
                self.named(at)
            ))),
        }
    }

    /// The transfers emitted since the last call, in emission order (empty without a host
    /// tier), each device page as the index in its group's view (the pool's id without an
    /// arena) and each host page in its group's host space. The engine runs them, then
    /// acknowledges them with [`Self::ack_transfers`].
    pub fn take_transfers(&mut self) -> Vec<Transfer> {
        self.coord.take_transfers()
    }

    /// Acknowledge finished transfers, in any order. Everything is checked first (each id in
    /// flight, handed out by `take_transfers`, listed once): on error nothing changes. A load
    /// acknowledged after its request ended only releases the page (registered under its key).
    pub fn ack_transfers(&mut self, ids: &[u64]) -> CoreResult<()> {
        self.coord.check_ack(ids)?;
        for &id in ids {
            if let Some((at, serial)) = self.coord.finish_transfer(id) {
                if let Some(entry) = self.entries.get_mut(at) {
                    if entry.live && entry.serial == serial {
                        entry.loading = entry.loading.saturating_sub(1);
                    }
                }
            }
        }
        self.coord.store_released();
        Ok(())
    }

    /// Host-tier loads of `req` not acknowledged yet (0: it can be scheduled).
    pub fn loads_in_flight(&self, req: RequestIdRef<'_>) -> CoreResult<u64> {
        Ok(self.entries[self.find(req)?].loading)
    }

    /// Host-tier loads of the request in `slot` not acknowledged yet.
    pub fn loads_in_flight_in(&self, slot: u64) -> CoreResult<u64> {
        Ok(self.entries[self.held("loads_in_flight", slot)?].loading)
    }

    /// Transfers in flight (taken or not).
    pub fn transfers_in_flight(&self) -> usize {
        self.coord.host().map_or(0, HostTier::num_in_flight)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::host::{HostStore, TransferKind};
    use crate::engine::ids::RequestIdRef;
    use crate::engine::testing::*;
    use crate::engine::CacheOptions;

    /// Full P = 4 and sliding P = 4, W = 8 over 8 real device pages and `host` host pages.
    fn tiered(host: u64, policy: HostStore) -> FlatCache {
        cache(
            vec![
                spec("full", crate::engine::group::GroupKind::Full, 4),
                spec("swa", sw(8), 4),
            ],
            9,
            CacheOptions {
                host_pages: host,
                host_store: policy,
                ..CacheOptions::default()
            },
        )
    }

    fn ids(ts: &[Transfer]) -> Vec<u64> {
        ts.iter().map(|t| t.id).collect()
    }

    #[test]
    fn write_through_stores_registered_pages_and_pins_them_until_acknowledged() {
        let mut c = tiered(16, HostStore::WriteThrough);
        let sa = add(&mut c, A, toks(0..16)).0;
        assert!(sched(&mut c, sa, 16, 0).unwrap());
        c.finish(&[sa]).unwrap(); // registers 4 pages per group, then frees them
        let t = c.take_transfers();
        // One store per registered page: group 0 slots 0..3, then group 1; host pages in order.
        assert_eq!(t.len(), 8);
        assert!(t.iter().all(|x| x.kind == TransferKind::Store));
        assert_eq!(t.iter().map(|x| x.host).collect::<Vec<_>>(), (0..8).collect::<Vec<_>>());
        assert_eq!(
            t.iter().map(|x| x.group).collect::<Vec<_>>(),
            vec![0, 0, 0, 0, 1, 1, 1, 1]
        );
        // Every stored page is still held by its store: nothing can be allocated.
        assert_eq!(c.coordinator().pool().num_free(), 0);
        assert!(!c.acquire(B, 1).unwrap());
        c.check_invariants().unwrap();
        let mut order = ids(&t);
        order.reverse();
        c.ack_transfers(&order).unwrap();
        assert_eq!(c.coordinator().pool().num_free(), 8);
        assert_eq!(c.transfers_in_flight(), 0);
        c.check_invariants().unwrap();
    }

    /// A write-through tier holding `A`'s 16-token prompt (stored and acknowledged) while the
    /// device holds no cached page: a page-level request took all 8 pages, then freed them.
    fn stored_then_evicted() -> FlatCache {
        let mut c = tiered(16, HostStore::WriteThrough);
        run_and_finish(&mut c, A, toks(0..16));
        let stores = c.take_transfers();
        c.ack_transfers(&ids(&stores)).unwrap();
        assert!(c.acquire(B, 16).unwrap());
        c.free(B).unwrap();
        assert_eq!(c.coordinator().pool().num_cached(), 0);
        c
    }

    #[test]
    fn host_hits_load_back_and_the_request_waits_for_them() {
        let mut c = stored_then_evicted();
        // 17 tokens: cap 4 pages. Full hits slots 0..3 on the host; the sliding group needs
        // its window behind 16: ceil(7 / 4) = 2 pages (slots 2, 3). 6 loads, 6 device pages.
        let p = prompt(&c, toks(0..17));
        assert_eq!(c.prefix_hit_tokens(&p).unwrap(), 16);
        assert_eq!(c.pages_needed_to_admit(&p, 1, 0).unwrap(), 6 + 2);
        let (sc, hit) = add(&mut c, C, toks(0..17));
        assert_eq!(hit, 16);
        assert_eq!(c.loads_in_flight(C).unwrap(), 6);
        assert_eq!(c.loads_in_flight_in(sc).unwrap(), 6);
        assert!(matches!(sched(&mut c, sc, 1, 0), Err(CoreError::InvalidArgument(_))));
        // Even a schedule of no tokens, or one behind a request that could run, is refused.
        assert!(c.schedule(&[sc], &[0], 0).is_err());
        let sb = add(&mut c, B, toks(200..201)).0;
        assert!(c.schedule(&[sb, sc], &[1, 1], 0).is_err());
        assert_eq!(c.num_computed_tokens(sb).unwrap(), 0);
        c.finish(&[sb]).unwrap();
        assert!(matches!(c.loads_in_flight_in(sb), Err(CoreError::UnknownSlot { .. })));
        let loads = c.take_transfers();
        assert_eq!(loads.len(), 6);
        assert!(loads.iter().all(|x| x.kind == TransferKind::Load));
        let ids_ = c.page_ids(C).unwrap();
        assert_eq!(ids_[0].len(), 4);
        assert_eq!(ids_[1][..2], [0, 0]);
        // Destinations are the request's pages, and the sources the host pages of the keys.
        let dest: Vec<u32> = ids_[0].iter().chain(&ids_[1][2..]).copied().collect();
        assert_eq!(loads.iter().map(|x| x.device).collect::<Vec<_>>(), dest);
        assert_eq!(loads.iter().map(|x| x.host).collect::<Vec<_>>(), vec![0, 1, 2, 3, 6, 7]);
        c.check_invariants().unwrap();
        // Acknowledged in any order; then the pages are device hits and C can run.
        c.ack_transfers(&[loads[3].id, loads[0].id]).unwrap();
        assert_eq!(c.loads_in_flight(C).unwrap(), 4);
        assert_eq!(c.loads_in_flight_in(sc).unwrap(), 4);
        c.check_invariants().unwrap();
        let rest: Vec<u64> = loads[4..].iter().chain(&loads[1..3]).map(|x| x.id).collect();
        c.ack_transfers(&rest).unwrap();
        assert!(sched(&mut c, sc, 1, 0).unwrap());
        c.check_invariants().unwrap();
    }

    #[test]
    fn finishing_during_a_load_loses_no_page_and_late_acks_register_it() {
        let mut c = stored_then_evicted();
        let (sc, hit) = add(&mut c, C, toks(0..17));
        assert_eq!(hit, 16);
        let loads = c.take_transfers();
        preempt1(&mut c, sc).unwrap();
        // The 6 destinations stay pinned by their loads.
        assert_eq!(c.coordinator().pool().num_free(), 2);
        c.check_invariants().unwrap();
        // The same id can be re-added meanwhile; a late ack must not count for it.
        // It takes the same slot: only the serial tells the two apart.
        assert_eq!(add(&mut c, C, toks(100..110)), (sc, 0));
        let mut late = ids(&loads);
        late.reverse();
        c.ack_transfers(&late).unwrap();
        assert_eq!(c.loads_in_flight(C).unwrap(), 0);
        assert_eq!(c.loads_in_flight_in(sc).unwrap(), 0);
        c.check_invariants().unwrap();
        c.finish(&[sc]).unwrap();
        assert_eq!(c.coordinator().pool().num_free(), 8);
        c.check_invariants().unwrap();
        // The loaded pages were registered: a device hit now, no loads.
        let (sa, hit) = add(&mut c, A, toks(0..17));
        assert_eq!(hit, 16);
        assert_eq!(c.loads_in_flight(A).unwrap(), 0);
        assert_eq!(c.loads_in_flight_in(sa).unwrap(), 0);
        assert!(c.take_transfers().is_empty());
    }

    #[test]
    fn evict_policy_stores_a_page_when_it_becomes_evictable() {
        let mut c = tiered(16, HostStore::Evict);
        let sa = add(&mut c, A, toks(0..12)).0;
        assert!(sched(&mut c, sa, 12, 0).unwrap());
        append(&mut c, sa, &[12]).unwrap();
        // At c = 12: registers 3 + 3 pages (no store: all held), then reclaims sliding slot
        // 0 ((12 - 7) // 4 = 1): that cached page's last reference goes, so it is stored.
        assert!(sched(&mut c, sa, 1, 0).unwrap());
        let first = c.take_transfers();
        assert_eq!(first.len(), 1);
        assert_eq!(
            (first[0].kind, first[0].group, first[0].host),
            (TransferKind::Store, 1, 0)
        );
        c.finish(&[sa]).unwrap();
        // The 5 other cached pages are stored as they are released; the partial 4th pages
        // hold no key and are freed at once.
        let rest = c.take_transfers();
        assert_eq!(rest.len(), 5);
        assert_eq!(c.coordinator().pool().num_free(), 2);
        c.check_invariants().unwrap();
        c.ack_transfers(&ids(&rest)).unwrap();
        c.ack_transfers(&ids(&first)).unwrap();
        assert_eq!(c.coordinator().pool().num_free(), 8);
        c.check_invariants().unwrap();
    }

    #[test]
    fn acknowledgements_are_checked_before_anything_changes() {
        let mut c = tiered(4, HostStore::WriteThrough);
        run_and_finish(&mut c, A, toks(0..16));
        // 8 pages registered, 4 host pages: the first 4 stored, the rest skipped.
        assert_eq!(c.coordinator().host().unwrap().counters.stores_skipped, 4);
        let t = c.take_transfers();
        assert_eq!(t.len(), 4);
        for bad in [vec![t[0].id, 999], vec![t[0].id, t[0].id]] {
            assert!(matches!(c.ack_transfers(&bad), Err(CoreError::InvalidArgument(_))));
        }
        assert_eq!(c.transfers_in_flight(), 4);
        c.ack_transfers(&ids(&t)).unwrap();
        assert!(c.ack_transfers(&[t[0].id]).is_err());
        let no_tier = &mut hybrid(8);
        assert!(no_tier.ack_transfers(&[1]).is_err());
        no_tier.ack_transfers(&[]).unwrap();
        c.check_invariants().unwrap();
    }

    #[test]
    fn a_late_ack_never_counts_for_a_new_request_in_the_same_slot() {
        // 20 real device pages: room for two requests' loads at once.
        let mut c = cache(
            vec![
                spec("full", crate::engine::group::GroupKind::Full, 4),
                spec("swa", sw(8), 4),
            ],
            21,
            CacheOptions {
                host_pages: 16,
                host_store: HostStore::WriteThrough,
                ..CacheOptions::default()
            },
        );
        run_and_finish(&mut c, A, toks(0..16));
        let stores = c.take_transfers();
        c.ack_transfers(&ids(&stores)).unwrap();
        assert!(c.acquire(B, 40).unwrap()); // 10 + 10 pages: every cached device page evicted
        c.free(B).unwrap();
        let (sc, hit) = add(&mut c, C, toks(0..17));
        assert_eq!((sc, hit), (0, 16));
        let old = c.take_transfers();
        assert_eq!(c.loads_in_flight_in(sc).unwrap(), 6);
        c.preempt(&[sc]).unwrap();
        // A new request in the same slot with loads of its own.
        let (sd, hit) = add(&mut c, RequestIdRef::Str("d"), toks(0..17));
        assert_eq!(sd, sc);
        let mine = c.take_transfers();
        let own = c.loads_in_flight_in(sd).unwrap();
        assert!(hit > 0 && own > 0, "hit {hit}, {own} loads");
        assert_eq!(own, u64::try_from(mine.len()).unwrap());
        c.check_invariants().unwrap();
        // The old request's late acknowledgements leave the new one's count alone.
        c.ack_transfers(&ids(&old)).unwrap();
        assert_eq!(c.loads_in_flight_in(sd).unwrap(), own);
        assert!(sched(&mut c, sd, 1, 0).is_err());
        c.check_invariants().unwrap();
        c.ack_transfers(&ids(&mine)).unwrap();
        assert_eq!(c.loads_in_flight_in(sd).unwrap(), 0);
        assert!(sched(&mut c, sd, 1, 0).unwrap());
        c.check_invariants().unwrap();
    }

    /// Full attention (P = 4, 40-byte pages: 3 per 120-byte unit) and one state group (P = G =
    /// 8, a slot is a unit) over 8 units, with `host` host pages per group (full, state).
    fn arena_tiered(host: [u64; 2], policy: HostStore) -> FlatCache {
        let geometry = crate::engine::pool::ArenaGeometry {
            unit_bytes: 120,
            num_units: 8,
            page_bytes: vec![40, 120],
        };
        let specs = vec![
            spec("full", crate::engine::group::GroupKind::Full, 4),
            spec("state", crate::engine::group::GroupKind::State, 8),
        ];
        let options = CacheOptions {
            host_store: policy,
            ..CacheOptions::default()
        };
        FlatCache::with_arena_host_pages(specs, &geometry, options, &host).unwrap()
    }

    #[test]
    fn an_arena_checkpoint_comes_back_from_the_host_as_the_first_step_reads_it() {
        let mut c = arena_tiered([8, 2], HostStore::WriteThrough);
        assert_eq!(c.coordinator().host().map(HostTier::num_pages), Some(10));
        let (sa, _) = add(&mut c, A, toks(0..20));
        // 16 tokens, then 4: the second schedule registers the 4 full pages and the state
        // checkpoint at 16 (slot 1: the state page of unit 3), storing each at once.
        assert!(sched(&mut c, sa, 16, 0).unwrap());
        assert!(sched(&mut c, sa, 4, 0).unwrap());
        assert_eq!(c.page_ids_in(sa).unwrap(), vec![vec![3, 4, 5, 6, 7], vec![0, 3, 4]]);
        let stores = c.take_transfers();
        // Device pages are view indices, host pages per group's space.
        assert_eq!(
            stores
                .iter()
                .map(|t| (t.kind, t.group, t.device, t.host))
                .collect::<Vec<_>>(),
            vec![
                (TransferKind::Store, 0, 3, 0),
                (TransferKind::Store, 0, 4, 1),
                (TransferKind::Store, 0, 5, 2),
                (TransferKind::Store, 0, 6, 3),
                (TransferKind::Store, 1, 3, 0),
            ]
        );
        c.finish(&[sa]).unwrap(); // the 5th full page (a store); nothing follows the prompt, so not its end
        let more = c.take_transfers();
        assert_eq!((more.len(), more[0].group, more[0].host), (1, 0, 4));
        c.check_invariants().unwrap();
        c.ack_transfers(&ids(&stores)).unwrap();
        c.ack_transfers(&ids(&more)).unwrap();
        // Evict everything on the device; the host keeps its keys.
        assert_eq!(c.reset_prefix_cache(), 6);
        c.check_invariants().unwrap();
        // A prompt sharing the 20 tokens: full attention finds 5 pages on the host, the deepest
        // checkpoint (16) is there too: the hit, with 4 full loads and the checkpoint's load.
        let (sb, hit) = add(&mut c, B, toks(0..24));
        assert_eq!(hit, 16);
        assert_eq!(c.loads_in_flight_in(sb).unwrap(), 5);
        assert!(
            sched(&mut c, sb, 8, 0).is_err(),
            "nothing reads a page before its load lands"
        );
        let loads = c.take_transfers();
        assert!(loads.iter().all(|t| t.kind == TransferKind::Load));
        let tables = c.page_ids_in(sb).unwrap();
        let state_load = loads.iter().find(|t| t.group == 1).unwrap();
        assert_eq!((state_load.host, tables[1][..1].to_vec()), (0, vec![0]));
        assert_eq!(
            tables[1][1], state_load.device,
            "the checkpoint's load lands in the state slot"
        );
        assert_eq!(
            loads
                .iter()
                .filter(|t| t.group == 0)
                .map(|t| t.device)
                .collect::<Vec<_>>(),
            tables[0]
        );
        assert_eq!(
            loads
                .iter()
                .filter(|t| t.group == 0)
                .map(|t| t.host)
                .collect::<Vec<_>>(),
            vec![0, 1, 2, 3]
        );
        c.check_invariants().unwrap();
        let mut order = ids(&loads);
        order.reverse();
        c.ack_transfers(&order).unwrap();
        // The first step reads the loaded checkpoint and writes a new slot.
        assert!(sched(&mut c, sb, 8, 0).unwrap());
        let (read, write) = c.state_slots(&[sb], &[8]).unwrap();
        assert_eq!(read, vec![i32::try_from(state_load.device).unwrap()]);
        assert_ne!(write, read);
        let s = c.stats();
        let host = s.host.unwrap();
        assert_eq!((host.loads, host.hits_tokens, s.checkpoints.unwrap().hit), (5, 16, 1));
        c.check_invariants().unwrap();
    }

    #[test]
    fn an_arena_group_without_host_pages_is_not_tiered() {
        // The state group has no host pages: its checkpoint is never stored, so after the
        // device forgets it a prompt hits nothing, although its full pages are on the host.
        let mut c = arena_tiered([8, 0], HostStore::WriteThrough);
        let (sa, _) = add(&mut c, A, toks(0..20));
        assert!(sched(&mut c, sa, 16, 0).unwrap());
        assert!(sched(&mut c, sa, 4, 0).unwrap());
        c.finish(&[sa]).unwrap();
        let stores = c.take_transfers();
        assert!(stores.iter().all(|t| t.group == 0) && stores.len() == 5);
        assert_eq!(c.coordinator().host().unwrap().counters.stores_skipped, 0);
        c.ack_transfers(&ids(&stores)).unwrap();
        c.reset_prefix_cache();
        let (sb, hit) = add(&mut c, B, toks(0..24));
        assert_eq!((hit, c.loads_in_flight_in(sb).unwrap()), (0, 0));
        c.check_invariants().unwrap();
    }

    #[test]
    fn the_evict_policy_stores_an_arena_checkpoint_when_it_is_released() {
        let mut c = arena_tiered([8, 2], HostStore::Evict);
        let (sa, _) = add(&mut c, A, toks(0..20));
        assert!(sched(&mut c, sa, 16, 0).unwrap());
        assert!(sched(&mut c, sa, 4, 0).unwrap());
        // Everything is held: nothing stored yet.
        assert!(c.take_transfers().is_empty());
        c.finish(&[sa]).unwrap();
        let stores = c.take_transfers();
        let groups: Vec<u32> = stores.iter().map(|t| t.group).collect();
        assert_eq!(
            groups.iter().filter(|&&g| g == 1).count(),
            1,
            "the checkpoint: {groups:?}"
        );
        assert_eq!(groups.len(), 6);
        c.check_invariants().unwrap();
        c.ack_transfers(&ids(&stores)).unwrap();
        c.check_invariants().unwrap();
        c.reset_prefix_cache();
        let (sb, hit) = add(&mut c, B, toks(0..24));
        assert_eq!((hit, c.loads_in_flight_in(sb).unwrap()), (16, 5));
        c.check_invariants().unwrap();
    }
}
