//! Page-level calls (SPEC 7 and 8): the caller hashes and tracks tokens itself and drives
//! each step (claim, acquire, register, reclaim, free, and the prefill/decode steps that
//! chain them). A page-level request is created by its first claim or acquire.

use crate::engine::coordinator::{Coordinator, PrefixMatch};
use crate::engine::hash::ContentHash;
use crate::engine::ids::RequestIdRef;
use crate::engine::table::Table;
use crate::engine::FlatCache;
use crate::error::{CoreError, CoreResult};

/// The error for a page-level method called on a token-level request (the mirror of the
/// token-level methods' refusal of a page-level request).
fn token_level(method: &str, req: RequestIdRef<'_>) -> CoreError {
    CoreError::invalid(format!(
        "{method}: request {req} is token-level (created by add_request)"
    ))
}

impl FlatCache {
    /// Refuse a live token-level request: its tables follow its tokens, which only the
    /// token-level calls move (an unknown id passes: the callers create or refuse it).
    fn check_not_token_level(&self, method: &str, req: RequestIdRef<'_>) -> CoreResult<()> {
        match self.index.get(&req) {
            Some(&at) if self.entries[at].tokens.is_some() => Err(token_level(method, req)),
            _ => Ok(()),
        }
    }

    /// The request's position, created empty (page-level) on first use; a token-level
    /// request is an error naming `method`.
    fn ensure(&mut self, method: &str, req: RequestIdRef<'_>) -> CoreResult<usize> {
        self.check_not_token_level(method, req)?;
        Ok(match self.index.get(&req) {
            Some(&at) => at,
            None => self.insert(req, None),
        })
    }

    /// The position of a live page-level request (`UnknownRequest` if unknown, an error
    /// naming `method` if token-level).
    fn find_page(&self, method: &str, req: RequestIdRef<'_>) -> CoreResult<usize> {
        let at = self.find(req)?;
        if self.entries[at].tokens.is_some() {
            return Err(token_level(method, req));
        }
        Ok(at)
    }

    /// A page-level request's tables and the coordinator, borrowed together.
    fn split_mut(&mut self, method: &str, req: RequestIdRef<'_>) -> CoreResult<(&mut Coordinator, &mut Vec<Table>)> {
        let i = self.find_page(method, req)?;
        Ok((&mut self.coord, &mut self.entries[i].tables))
    }

    /// The hybrid prefix match of base-page hashes (read-only).
    pub fn match_prefix(&self, hashes: &[ContentHash]) -> CoreResult<PrefixMatch> {
        self.coord.match_prefix(hashes)
    }

    /// Claim `m` for `req` (created if new). A token-level request, a request whose tables
    /// hold pages, a match with the wrong number of groups or a stale page is an error and
    /// changes nothing (a new request is then not created).
    pub fn claim(&mut self, req: RequestIdRef<'_>, m: &PrefixMatch) -> CoreResult<()> {
        self.claim_as("claim", req, m)
    }

    /// [`Self::claim`], errors naming `method`.
    fn claim_as(&mut self, method: &str, req: RequestIdRef<'_>, m: &PrefixMatch) -> CoreResult<()> {
        self.check_not_token_level(method, req)?;
        let existing = self.index.get(&req).map(|&at| self.entries[at].tables.as_slice());
        if existing.is_some_and(|tables| tables.iter().any(|t| !t.is_empty())) {
            return Err(CoreError::invalid(format!(
                "{method}: request {req} already holds pages"
            )));
        }
        self.coord.check_claim(method, existing, m)?;
        let at = self.ensure(method, req)?;
        self.coord.claim(&mut self.entries[at].tables, m);
        Ok(())
    }

    /// Make room for `n` more tokens in every group of `req` (created if new), all or
    /// nothing; a token-level request is an error.
    pub fn acquire(&mut self, req: RequestIdRef<'_>, n: u64) -> CoreResult<bool> {
        let at = self.ensure("acquire", req)?;
        Ok(self.coord.acquire(&mut self.entries[at].tables, n))
    }

    /// [`Self::acquire`], answering what it appended: per group, the page ids (holes 0) of
    /// the slots past the table's length before the call, as [`Self::page_ids`] shows them;
    /// `None` (and no change but the request's creation) when the pool has too few free
    /// pages. A caller that mirrors the tables reads only the new slots, not every table.
    pub fn acquire_pages(&mut self, req: RequestIdRef<'_>, n: u64) -> CoreResult<Option<Vec<Vec<u32>>>> {
        let at = self.ensure("acquire_pages", req)?;
        let tables = &mut self.entries[at].tables;
        let before: Vec<usize> = tables.iter().map(Table::len).collect();
        if !self.coord.acquire(tables, n) {
            return Ok(None);
        }
        let tables = &self.entries[at].tables;
        // A table only grows on acquire; `get` keeps a shorter one from panicking.
        Ok(Some(self.view_ids_from(tables, |g, t| {
            before.get(g).and_then(|&len| t.pages().get(len..)).unwrap_or(&[])
        })))
    }

    /// Register base-page hashes (base pages `first_slot ..`) for `req`.
    pub fn register(
        &mut self,
        req: RequestIdRef<'_>,
        hashes: &[ContentHash],
        first_slot: u64,
        end_tokens: Option<u64>,
    ) -> CoreResult<()> {
        self.register_groups(req, hashes, first_slot, end_tokens, None)
    }

    /// [`Self::register`] in the groups `only` lists (indices checked by the caller: each
    /// below the group count, none twice), every group when `None`.
    pub fn register_groups(
        &mut self,
        req: RequestIdRef<'_>,
        hashes: &[ContentHash],
        first_slot: u64,
        end_tokens: Option<u64>,
        only: Option<&[usize]>,
    ) -> CoreResult<()> {
        let (coord, tables) = self.split_mut("register", req)?;
        coord.register_groups(tables, hashes, first_slot, end_tokens, None, only)
    }

    /// Check a `groups` argument against this cache's group count: each an index below it,
    /// none listed twice; the indices as `usize`.
    pub fn group_indices(&self, groups: &[u64]) -> CoreResult<Vec<usize>> {
        let n = self.coordinator().managers().len();
        let mut out: Vec<usize> = Vec::with_capacity(groups.len());
        for (i, &g) in groups.iter().enumerate() {
            let Some(index) = usize::try_from(g).ok().filter(|&index| index < n) else {
                return Err(CoreError::invalid(format!(
                    "groups[{i}] = {g} is no group of this cache (it has {n}: 0 to {})",
                    n - 1
                )));
            };
            if out.contains(&index) {
                return Err(CoreError::invalid(format!("groups[{i}] = {g} is listed twice")));
            }
            out.push(index);
        }
        Ok(out)
    }

    /// Reclaim `req`'s slid-out pages at `n` computed tokens.
    pub fn reclaim(&mut self, req: RequestIdRef<'_>, n: u64) -> CoreResult<()> {
        let order = self.eviction;
        let (coord, tables) = self.split_mut("reclaim", req)?;
        coord.reclaim(tables, n, order);
        Ok(())
    }

    /// Release all of `req`'s pages (in the eviction order), drop its reserve and forget it.
    /// A token-level request is an error (`finish` or `preempt` end it).
    pub fn free(&mut self, req: RequestIdRef<'_>) -> CoreResult<()> {
        let at = self.find_page("free", req)?;
        self.release(at);
        Ok(())
    }

    /// Pages an acquire of `n` tokens would allocate (`None`: for a fresh request).
    pub fn pages_needed(&self, n: u64, req: Option<RequestIdRef<'_>>) -> CoreResult<u64> {
        let tables = match req {
            Some(r) => Some(self.tables(r)?),
            None => None,
        };
        self.coord.pages_needed(tables, n)
    }

    /// [`Self::pages_needed`] for the request in `slot` (`None`: a fresh request).
    pub fn pages_needed_in(&self, n: u64, slot: Option<u64>) -> CoreResult<u64> {
        let tables = match slot {
            Some(s) => Some(self.entries[self.held("pages_needed", s)?].tables.as_slice()),
            None => None,
        };
        self.coord.pages_needed(tables, n)
    }

    /// Pages a reclaim of `req` at `n` would return to the free list.
    pub fn pages_reclaimable(&self, req: RequestIdRef<'_>, n: u64, count_uncached: bool) -> CoreResult<usize> {
        Ok(self.coord.pages_reclaimable(self.tables(req)?, n, count_uncached))
    }

    /// Pages a claim of `m` would take off the free list.
    pub fn pages_consumed_by_claim(&self, m: &PrefixMatch) -> CoreResult<usize> {
        self.coord.pages_consumed_by_claim(m)
    }

    /// `req`'s page ids per group (holes 0).
    pub fn page_ids(&self, req: RequestIdRef<'_>) -> CoreResult<Vec<Vec<u32>>> {
        Ok(self.view_ids(self.tables(req)?))
    }

    /// `req`'s free token slots in the last page, per group.
    pub fn tail_available(&self, req: RequestIdRef<'_>) -> CoreResult<Vec<u64>> {
        Ok(self.tables(req)?.iter().map(Table::tail_avail).collect())
    }

    /// The page ids per group (holes 0) of the request in `slot`.
    pub fn page_ids_in(&self, slot: u64) -> CoreResult<Vec<Vec<u32>>> {
        let at = self.held("page_ids", slot)?;
        Ok(self.view_ids(&self.entries[at].tables))
    }

    /// The page ids of `tables` as indices of each group's view (pool ids without an arena).
    fn view_ids(&self, tables: &[Table]) -> Vec<Vec<u32>> {
        self.view_ids_from(tables, |_, t| t.pages())
    }

    /// The ids of the slots `slots(g, table)` picks from each group's table, as
    /// [`Self::view_ids`] shows them.
    fn view_ids_from<'t>(&self, tables: &'t [Table], slots: impl Fn(usize, &'t Table) -> &'t [u32]) -> Vec<Vec<u32>> {
        let pool = self.coord.pool();
        tables
            .iter()
            .enumerate()
            .map(|(g, t)| {
                let base = pool.group_base(g);
                slots(g, t).iter().map(|&p| p.saturating_sub(base)).collect()
            })
            .collect()
    }

    /// The free token slots in the last page, per group, of the request in `slot`.
    pub fn tail_available_in(&self, slot: u64) -> CoreResult<Vec<u64>> {
        let at = self.held("tail_available", slot)?;
        Ok(self.entries[at].tables.iter().map(Table::tail_avail).collect())
    }

    /// Drop the key of every cached page with count 0 (they stay free) and return how many
    /// keys were dropped; the events match the state ([`crate::engine::coordinator::Coordinator::reset_prefix_cache`]).
    pub fn reset_prefix_cache(&mut self) -> usize {
        self.coord.reset_prefix_cache()
    }

    /// First chunk: claim the match, then acquire `n` tokens (on `false` the claim stays).
    pub fn prefill_first_chunk(&mut self, req: RequestIdRef<'_>, m: &PrefixMatch, n: u64) -> CoreResult<bool> {
        self.claim_as("prefill_first_chunk", req, m)?;
        let at = self.find_page("prefill_first_chunk", req)?;
        Ok(self.coord.acquire(&mut self.entries[at].tables, n))
    }

    /// Later chunk at `computed` tokens: register the full pages so far (hashes from base
    /// page 0, cut to `computed / base`), then reclaim, then acquire `n` tokens.
    pub fn prefill_chunk(
        &mut self,
        req: RequestIdRef<'_>,
        hashes: &[ContentHash],
        n: u64,
        computed: u64,
    ) -> CoreResult<bool> {
        let limit = self.coord.base_div().quotient(computed);
        let cut = usize::try_from(limit).map_or(hashes.len(), |l| l.min(hashes.len()));
        self.step("prefill_chunk", req, &hashes[..cut], 0, n, computed)
    }

    /// Decode step at `computed` tokens: hashes start at base page `first_page_slot` and are
    /// cut so that `first_page_slot + len <= computed / base`; register, reclaim, acquire.
    pub fn decode_step(
        &mut self,
        req: RequestIdRef<'_>,
        hashes: &[ContentHash],
        first_page_slot: u64,
        n: u64,
        computed: u64,
    ) -> CoreResult<bool> {
        let limit = self.coord.base_div().quotient(computed);
        let room = limit.saturating_sub(first_page_slot);
        let cut = usize::try_from(room).map_or(hashes.len(), |r| r.min(hashes.len()));
        self.step("decode_step", req, &hashes[..cut], first_page_slot, n, computed)
    }

    /// Register, THEN reclaim (registration skips holes), THEN acquire.
    fn step(
        &mut self,
        method: &str,
        req: RequestIdRef<'_>,
        hashes: &[ContentHash],
        first_slot: u64,
        n: u64,
        computed: u64,
    ) -> CoreResult<bool> {
        let order = self.eviction;
        let (coord, tables) = self.split_mut(method, req)?;
        coord.register(tables, hashes, first_slot, Some(computed))?;
        coord.reclaim(tables, computed, order);
        Ok(coord.acquire(tables, n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::coordinator::GroupSpec;
    use crate::engine::group::GroupKind;
    use crate::engine::hash::hash_pages;
    use crate::engine::testing::*;
    use crate::engine::CacheOptions;
    use crate::error::CoreError;

    fn hashes(n: u32) -> Vec<ContentHash> {
        let tokens: Vec<u32> = (0..n).map(|t| t * 31 + 7).collect();
        hash_pages::<&str>(&tokens, 4, &[], &[]).unwrap()
    }

    #[test]
    fn acquire_pages_answers_the_new_slots_of_each_table() {
        // A full group of page 4 beside a state group of page 8: the full table grows a slot
        // per 4 tokens, the state table puts its one page in its last new slot.
        let groups = || vec![spec("f", GroupKind::Full, 4), spec("s", GroupKind::State, 8)];
        let mut c = cache(groups(), 6, CacheOptions::default());
        let mut twin = cache(groups(), 6, CacheOptions::default());
        assert_eq!(c.acquire_pages(A, 6).unwrap(), Some(vec![vec![1, 2], vec![3]]));
        assert!(twin.acquire(A, 6).unwrap());
        assert_eq!(c.page_ids(A).unwrap(), twin.page_ids(A).unwrap());
        // Room left in the last pages: nothing new anywhere.
        assert_eq!(c.acquire_pages(A, 2).unwrap(), Some(vec![vec![], vec![]]));
        // Too few free pages: None, nothing allocated.
        assert_eq!(c.acquire_pages(A, 40).unwrap(), None);
        assert_eq!(c.pool_stats().num_free, 2);
        // Into a new state page: the unkeyed working page moves there, the slot it leaves is
        // a hole that the answer does not repeat.
        assert_eq!(c.acquire_pages(A, 1).unwrap(), Some(vec![vec![4], vec![3]]));
        assert_eq!(c.page_ids(A).unwrap(), vec![vec![1, 2, 4], vec![0, 3]]);
        // A new request is created even when nothing fits, as by acquire.
        assert_eq!(c.acquire_pages(B, 400).unwrap(), None);
        assert!(c.has_request(B));
        assert_eq!(c.acquire_pages(B, 0).unwrap(), Some(vec![vec![], vec![]]));
        c.check_invariants().unwrap();
    }

    #[test]
    fn state_pages_that_do_not_move_stay_until_reclaimed() {
        // PageCache([KVCacheSpec("state", 4)], 32): a sparse acquire puts one page in the last
        // slot; a later one moves that unkeyed page by default and takes a fresh one with
        // move_state_pages off, the old page staying until reclaim passes its slot.
        let state = || vec![spec("s", GroupKind::State, 4)];
        let mut moving = cache(state(), 32, CacheOptions::default());
        assert!(moving.acquire(A, 16).unwrap());
        assert_eq!(moving.page_ids(A).unwrap(), vec![vec![0, 0, 0, 1]]);
        assert_eq!(moving.pages_needed(3, Some(A)).unwrap(), 0);
        assert!(moving.acquire(A, 3).unwrap());
        assert_eq!(moving.page_ids(A).unwrap(), vec![vec![0, 0, 0, 0, 1]]);
        let options = CacheOptions {
            move_state_pages: false,
            ..CacheOptions::default()
        };
        let mut c = cache(state(), 32, options);
        assert!(c.acquire(A, 16).unwrap());
        assert_eq!(c.page_ids(A).unwrap(), vec![vec![0, 0, 0, 1]]);
        assert_eq!(c.pages_needed(3, Some(A)).unwrap(), 1);
        assert!(c.acquire(A, 3).unwrap());
        assert_eq!(c.page_ids(A).unwrap(), vec![vec![0, 0, 0, 1, 2]]);
        assert!(c.acquire(A, 9).unwrap()); // to token 28: slots 5 and 6, a page in slot 6
        assert_eq!(c.page_ids(A).unwrap(), vec![vec![0, 0, 0, 1, 2, 0, 3]]);
        c.check_invariants().unwrap();
        // Reclaim at 17 processed tokens: slots below (17 - 1) // 4 = 4 are released.
        c.reclaim(A, 17).unwrap();
        assert_eq!(c.page_ids(A).unwrap(), vec![vec![0, 0, 0, 0, 2, 0, 3]]);
        c.reclaim(A, 25).unwrap();
        assert_eq!(c.page_ids(A).unwrap(), vec![vec![0, 0, 0, 0, 0, 0, 3]]);
        assert_eq!(c.coordinator().pool().num_free(), 30); // 32 pages, page 0 and page 3 not free
        c.check_invariants().unwrap();
    }

    #[test]
    fn prefill_decode_finish_and_reuse() {
        let mut c = hybrid(32);
        let h = hashes(16);
        let m = c.match_prefix(&h[..3]).unwrap();
        assert_eq!(m.num_common_tokens, 0);
        assert!(c.prefill_first_chunk(A, &m, 16).unwrap());
        assert_eq!(c.page_ids(A).unwrap(), vec![vec![1, 2, 3, 4], vec![5, 6, 7, 8]]);
        // Decode token 17 at computed = 16: registers 4 pages, reclaims (16 - 8 + 1) // 4 = 2.
        assert!(c.decode_step(A, &h, 0, 1, 16).unwrap());
        assert_eq!(c.page_ids(A).unwrap(), vec![vec![1, 2, 3, 4, 9], vec![0, 0, 7, 8, 10]]);
        assert_eq!(c.tail_available(A).unwrap(), vec![3, 3]);
        c.check_invariants().unwrap();
        c.free(A).unwrap();
        assert!(!c.has_request(A));
        c.check_invariants().unwrap();
        // The prompt's pages come back from the cache: full 4 pages, sliding the run behind 16.
        let m = c.match_prefix(&h[..4]).unwrap();
        assert_eq!(m.num_common_tokens, 16);
        assert_eq!(m.pages, vec![vec![1, 2, 3, 4], vec![0, 0, 7, 8]]);
        assert_eq!(c.pages_consumed_by_claim(&m).unwrap(), 6);
        assert!(c.prefill_first_chunk(B, &m, 1).unwrap());
        c.check_invariants().unwrap();
        assert!(c.block_tables(&[RequestIdRef::Str("nope")]).is_err());
        if crate::FLAT_KVCACHE {
            let tables = c.block_tables(&[B, B]).unwrap();
            assert_eq!(tables.len(), 2);
            assert_eq!((tables[1].rows, tables[1].cols), (2, 5));
        }
    }

    #[test]
    fn unknown_requests_are_errors_and_acquire_creates_them() {
        let mut c = hybrid(4);
        assert!(matches!(c.free(A), Err(CoreError::UnknownRequest(_))));
        assert!(matches!(c.reclaim(A, 1), Err(CoreError::UnknownRequest(_))));
        assert!(matches!(c.page_ids(A), Err(CoreError::UnknownRequest(_))));
        assert!(matches!(
            c.decode_step(A, &[], 0, 1, 0),
            Err(CoreError::UnknownRequest(_))
        ));
        // 3 free pages; 8 tokens need 4: False, but the request exists with empty tables.
        assert!(!c.acquire(A, 8).unwrap());
        assert!(c.has_request(A));
        assert_eq!(c.page_ids(A).unwrap(), vec![Vec::<u32>::new(), vec![]]);
        assert_eq!(c.pages_needed(4, Some(A)).unwrap(), 2);
        assert_eq!(c.num_requests(), 1);
    }

    #[test]
    fn stale_claim_of_a_page_re_cached_for_another_group_is_refused() {
        // One full group and one sliding group of the same page size, 3 pages. a caches one
        // page per group (full: page 1, sliding: page 2) and frees them: free list [3, 1, 2].
        let mut c = cache(
            vec![spec("full", GroupKind::Full, 4), spec("swa", sw(5), 4)],
            4,
            CacheOptions::default(),
        );
        let h = hash_pages::<&str>(&toks(0..4), 4, &[], &[]).unwrap();
        assert!(c.acquire(A, 4).unwrap());
        assert_eq!(c.page_ids(A).unwrap(), vec![vec![1], vec![2]]);
        c.register(A, &h, 0, None).unwrap();
        c.free(A).unwrap();
        assert_eq!(free_list(&c), vec![3, 1, 2]);
        let m = c.match_prefix(&h).unwrap();
        assert_eq!(m.pages, vec![vec![1], vec![2]]);
        // b takes pages 3 (full) and 1 (sliding, evicting a's full key), registers the same
        // content and is freed: page 1 now holds the *sliding* key of that content.
        assert!(c.acquire(B, 4).unwrap());
        assert_eq!(c.page_ids(B).unwrap(), vec![vec![3], vec![1]]);
        c.register(B, &h, 0, None).unwrap();
        c.free(B).unwrap();
        // The old match would put page 1 into the full group while the sliding key maps to
        // it: refused, and nothing changes (c is not created).
        let err = c.claim(C, &m).unwrap_err();
        assert!(err.to_string().contains("stale"), "{err}");
        assert!(!c.has_request(C));
        // A hand-built match only needs each page to hold a key of the group it goes to.
        let by_hand = PrefixMatch::by_hand(4, vec![vec![3], vec![2]], vec![1, 1]);
        c.claim(C, &by_hand).unwrap();
        let wrong_group = PrefixMatch::by_hand(4, vec![vec![1], vec![3]], vec![1, 1]);
        assert!(c.claim(RequestIdRef::Int(8), &wrong_group).is_err());
        c.check_invariants().unwrap();
    }

    mod properties {
        use proptest::prelude::*;

        use super::*;

        #[derive(Clone, Debug)]
        enum Op {
            /// Admit request `r` with prompt `p` of `len` tokens (prefix match, first chunk).
            Admit(u8, u8, u32),
            /// Decode `k` tokens for request `r` (register, reclaim, acquire).
            Step(u8, u64),
            /// A bare acquire of `n` tokens.
            Acquire(u8, u64),
            /// Finish request `r`.
            Free(u8),
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                (0u8..4, 0u8..3, 1u32..64).prop_map(|(r, p, l)| Op::Admit(r, p, l)),
                (0u8..4, 1u64..12).prop_map(|(r, k)| Op::Step(r, k)),
                (0u8..4, 0u64..40).prop_map(|(r, n)| Op::Acquire(r, n)),
                (0u8..4).prop_map(Op::Free),
            ]
        }

        fn cache(pages: u64) -> FlatCache {
            let spec = |id: &str, kind, page_size| GroupSpec {
                group_id: id.into(),
                kind,
                page_size,
            };
            FlatCache::new(
                vec![
                    spec("full", GroupKind::Full, 4),
                    spec("swa", GroupKind::SlidingWindow { window: 10 }, 8),
                    spec("state", GroupKind::State, 8),
                ],
                pages,
                true,
            )
            .unwrap()
        }

        proptest! {
            /// Random admissions, decode steps, acquires and frees on a small hybrid pool keep
            /// every invariant; a failed bare acquire changes nothing.
            #[test]
            fn random_request_traffic_keeps_invariants(ops in proptest::collection::vec(op(), 1..50)) {
                let mut c = cache(40);
                // Prompts 0 and 1 share their first 32 tokens; prompt 2 is unrelated.
                let prompts: Vec<Vec<u32>> = vec![
                    (0..128).collect(),
                    (0..32).chain(1000..1096).collect(),
                    (5000..5128).collect(),
                ];
                let hashes: Vec<Vec<ContentHash>> =
                    prompts.iter().map(|t| hash_pages::<&str>(t, 4, &[], &[]).unwrap()).collect();
                // Per live request: (prompt, tokens acquired).
                let mut live: [Option<(usize, u64)>; 4] = [None; 4];
                for op in ops {
                    match op {
                        Op::Admit(r, p, len) => {
                            let id = RequestIdRef::Int(i64::from(r));
                            if live[r as usize].is_some() {
                                continue;
                            }
                            let p = p as usize;
                            let cap = ((len - 1) / 4) as usize;
                            let m = c.match_prefix(&hashes[p][..cap]).unwrap();
                            let rest = u64::from(len) - m.num_common_tokens;
                            if c.prefill_first_chunk(id, &m, rest).unwrap() {
                                live[r as usize] = Some((p, u64::from(len)));
                            } else {
                                c.free(id).unwrap();
                            }
                        }
                        Op::Step(r, k) => {
                            let Some((p, acquired)) = live[r as usize] else { continue };
                            let id = RequestIdRef::Int(i64::from(r));
                            let known = hashes[p].len() as u64 * 4;
                            if acquired + k > known {
                                continue;
                            }
                            if c.decode_step(id, &hashes[p], 0, k, acquired).unwrap() {
                                live[r as usize] = Some((p, acquired + k));
                            }
                        }
                        Op::Acquire(r, n) => {
                            let id = RequestIdRef::Int(i64::from(r));
                            let Some((p, acquired)) = live[r as usize] else { continue };
                            let before = (c.page_ids(id).unwrap(), c.tail_available(id).unwrap(), c.pool_stats());
                            if c.acquire(id, n).unwrap() {
                                live[r as usize] = Some((p, acquired + n));
                            } else {
                                let after = (c.page_ids(id).unwrap(), c.tail_available(id).unwrap(), c.pool_stats());
                                prop_assert_eq!(before, after);
                            }
                        }
                        Op::Free(r) => {
                            if live[r as usize].take().is_some() {
                                c.free(RequestIdRef::Int(i64::from(r))).unwrap();
                            }
                        }
                    }
                    prop_assert_eq!(c.check_invariants(), Ok(()));
                }
                for r in 0..4u8 {
                    if live[r as usize].is_some() {
                        c.free(RequestIdRef::Int(i64::from(r))).unwrap();
                    }
                }
                let stats = c.pool_stats();
                prop_assert_eq!(stats.num_free, stats.num_blocks - 1);
                prop_assert_eq!(c.num_requests(), 0);
            }
        }
    }
}
