//! The request-level page engine (SPEC 7 and 8): request ids -> tables, the step operations,
//! flat per-group block tables and the global invariant check.

use hashbrown::hash_map::RawEntryMut;
use hashbrown::HashMap;
use rustc_hash::FxBuildHasher;

use crate::coordinator::{Coordinator, GroupSpec, PrefixMatch};
use crate::error::{CoreError, CoreResult};
use crate::hash::ContentHash;
use crate::pool::NULL_PAGE;
use crate::request::{RequestId, RequestIdRef};
use crate::table::Table;

/// The message of the error raised for flat tables when the `flat` feature is off.
pub const FLAT_UNAVAILABLE: &str = "flat per-group block tables are unavailable: this build of flat_kvcache \
                                    was compiled without the `flat` cargo feature";

/// One group's flat block table for a batch: `rows x cols` int32, row-major; holes are 0 and
/// padding past a row's end is -1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatTable {
    /// Number of rows (requests in the batch).
    pub rows: usize,
    /// Number of columns (the longest table of the batch in this group).
    pub cols: usize,
    /// `rows * cols` page ids.
    pub data: Vec<i32>,
}

/// Probe counters of the shared pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolStats {
    /// Total pages, the null page included.
    pub num_blocks: usize,
    /// Pages on the free list.
    pub num_free: usize,
    /// Pages holding a key.
    pub num_cached: usize,
    /// Cached pages with count 0.
    pub num_cached_free: usize,
    /// Cached pages with count > 0.
    pub num_cached_pinned: usize,
}

/// A page id as `i32`: pools hold at most `i32::MAX` pages, so every id fits.
#[inline]
#[allow(clippy::cast_possible_wrap, reason = "page ids are < MAX_BLOCKS = i32::MAX")]
fn page_i32(page: u32) -> i32 {
    page as i32
}

/// The page engine of one model: a coordinator plus each live request's tables.
#[derive(Clone, Debug)]
pub struct FlatCache {
    coord: Coordinator,
    requests: HashMap<RequestId, Vec<Table>, FxBuildHasher>,
}

impl FlatCache {
    /// An engine over `specs` with a pool of `num_pages` pages (page 0 included).
    pub fn new(specs: Vec<GroupSpec>, num_pages: u64, enable_caching: bool) -> CoreResult<Self> {
        Ok(Self {
            coord: Coordinator::new(specs, num_pages, enable_caching)?,
            requests: HashMap::default(),
        })
    }

    /// The coordinator (groups, page sizes, pool).
    pub fn coordinator(&self) -> &Coordinator {
        &self.coord
    }

    /// Probe counters of the pool.
    pub fn pool_stats(&self) -> PoolStats {
        let pool = self.coord.pool();
        PoolStats {
            num_blocks: pool.num_blocks(),
            num_free: pool.num_free(),
            num_cached: pool.num_cached(),
            num_cached_free: pool.num_cached_free(),
            num_cached_pinned: pool.num_cached_pinned(),
        }
    }

    /// Number of live requests.
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// Whether `req` has tables.
    pub fn has_request(&self, req: RequestIdRef<'_>) -> bool {
        self.requests.contains_key(&req)
    }

    fn tables(&self, req: RequestIdRef<'_>) -> CoreResult<&Vec<Table>> {
        self.requests
            .get(&req)
            .ok_or_else(|| CoreError::UnknownRequest(req.to_string()))
    }

    /// The request's tables and the coordinator, borrowed together.
    fn split_mut(&mut self, req: RequestIdRef<'_>) -> CoreResult<(&mut Coordinator, &mut Vec<Table>)> {
        match self.requests.get_mut(&req) {
            Some(tables) => Ok((&mut self.coord, tables)),
            None => Err(CoreError::UnknownRequest(req.to_string())),
        }
    }

    /// The request's tables, created empty on first use.
    fn ensure(&mut self, req: RequestIdRef<'_>) -> (&mut Coordinator, &mut Vec<Table>) {
        let groups = self.coord.num_groups();
        let tables = match self.requests.raw_entry_mut().from_key(&req) {
            RawEntryMut::Occupied(entry) => entry.into_mut(),
            RawEntryMut::Vacant(entry) => entry.insert(req.to_id(), vec![Table::default(); groups]).1,
        };
        (&mut self.coord, tables)
    }

    // ----- SPEC 7 -------------------------------------------------------------------------

    /// The hybrid prefix match of base-page hashes (read-only).
    pub fn match_prefix(&self, hashes: &[ContentHash]) -> CoreResult<PrefixMatch> {
        self.coord.match_prefix(hashes)
    }

    /// Claim `m` for `req` (created if new). A request whose tables hold pages, a match with
    /// the wrong number of groups or a stale page is an error and changes nothing (a new
    /// request is then not created).
    pub fn claim(&mut self, req: RequestIdRef<'_>, m: &PrefixMatch) -> CoreResult<()> {
        self.coord.check_claim(self.requests.get(&req).map(Vec::as_slice), m)?;
        let (coord, tables) = self.ensure(req);
        coord.claim(tables, m);
        Ok(())
    }

    /// Make room for `n` more tokens in every group of `req` (created if new), all or nothing.
    pub fn acquire(&mut self, req: RequestIdRef<'_>, n: u64) -> bool {
        let (coord, tables) = self.ensure(req);
        coord.acquire(tables, n)
    }

    /// Register base-page hashes (base pages `first_slot ..`) for `req`.
    pub fn register(
        &mut self,
        req: RequestIdRef<'_>,
        hashes: &[ContentHash],
        first_slot: u64,
        end_tokens: Option<u64>,
    ) -> CoreResult<()> {
        let (coord, tables) = self.split_mut(req)?;
        coord.register(tables, hashes, first_slot, end_tokens)
    }

    /// Reclaim `req`'s slid-out pages at `n` computed tokens.
    pub fn reclaim(&mut self, req: RequestIdRef<'_>, n: u64) -> CoreResult<()> {
        let (coord, tables) = self.split_mut(req)?;
        coord.reclaim(tables, n);
        Ok(())
    }

    /// Release all of `req`'s pages and forget it.
    pub fn free(&mut self, req: RequestIdRef<'_>) -> CoreResult<()> {
        let Some(mut tables) = self.requests.remove(&req) else {
            return Err(CoreError::UnknownRequest(req.to_string()));
        };
        self.coord.free(&mut tables);
        Ok(())
    }

    /// Pages an acquire of `n` tokens would allocate (`None`: for a fresh request).
    pub fn pages_needed(&self, n: u64, req: Option<RequestIdRef<'_>>) -> CoreResult<u64> {
        let tables = match req {
            Some(r) => Some(self.tables(r)?.as_slice()),
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
        Ok(self.tables(req)?.iter().map(|t| t.pages().to_vec()).collect())
    }

    /// `req`'s free token slots in the last page, per group.
    pub fn tail_available(&self, req: RequestIdRef<'_>) -> CoreResult<Vec<u64>> {
        Ok(self.tables(req)?.iter().map(Table::tail_avail).collect())
    }

    // ----- SPEC 8 -------------------------------------------------------------------------

    /// First chunk: claim the match, then acquire `n` tokens (on `false` the claim stays).
    pub fn prefill_first_chunk(&mut self, req: RequestIdRef<'_>, m: &PrefixMatch, n: u64) -> CoreResult<bool> {
        self.claim(req, m)?;
        Ok(self.acquire(req, n))
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
        self.step(req, &hashes[..cut], 0, n, computed)
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
        self.step(req, &hashes[..cut], first_page_slot, n, computed)
    }

    /// Register, THEN reclaim (registration skips holes), THEN acquire.
    fn step(
        &mut self,
        req: RequestIdRef<'_>,
        hashes: &[ContentHash],
        first_slot: u64,
        n: u64,
        computed: u64,
    ) -> CoreResult<bool> {
        let (coord, tables) = self.split_mut(req)?;
        coord.register(tables, hashes, first_slot, Some(computed))?;
        coord.reclaim(tables, computed);
        Ok(coord.acquire(tables, n))
    }

    /// Flat block tables of a batch, one per group in group order: `[len(reqs), max_cols]`,
    /// holes 0, padding -1, rows in the order given (repeats allowed). Unavailable (a config
    /// error naming the build) without the `flat` feature.
    pub fn block_tables(&self, reqs: &[RequestIdRef<'_>]) -> CoreResult<Vec<FlatTable>> {
        if !crate::FLAT_KVCACHE {
            return Err(CoreError::Config(FLAT_UNAVAILABLE.to_owned()));
        }
        let rows: Vec<&Vec<Table>> = reqs.iter().map(|&r| self.tables(r)).collect::<CoreResult<_>>()?;
        let mut out = Vec::with_capacity(self.coord.num_groups());
        for g in 0..self.coord.num_groups() {
            let cols = rows.iter().map(|ts| ts[g].len()).max().unwrap_or(0);
            let size = rows
                .len()
                .checked_mul(cols)
                .ok_or_else(|| CoreError::overflow("reqs"))?;
            let mut data = Vec::new();
            data.try_reserve_exact(size)
                .map_err(|_| CoreError::OutOfMemory(format!("block_tables: {} x {cols} int32", rows.len())))?;
            for ts in &rows {
                let pages = ts[g].pages();
                data.extend(pages.iter().map(|&p| page_i32(p)));
                data.extend(std::iter::repeat_n(-1, cols - pages.len()));
            }
            out.push(FlatTable {
                rows: rows.len(),
                cols,
                data,
            });
        }
        Ok(out)
    }

    /// Check every invariant; the error describes the first violation: a page in the tables
    /// of two groups; a page's count differing from its table references; a count-0 page off
    /// the free list or a counted page on it; a key map entry pointing at a page that does not
    /// hold that key; `free + in_use + 1 != num_pages`.
    pub fn check_invariants(&self) -> CoreResult<()> {
        let pool = self.coord.pool();
        let specs = self.coord.specs();
        let n = pool.num_blocks();
        // owner[p] = 1 + group of the tables holding p (0: none); refs[p] = table references.
        let mut owner = vec![0usize; n];
        let mut refs = vec![0u64; n];
        for tables in self.requests.values() {
            for (g, table) in tables.iter().enumerate() {
                for &page in table.pages() {
                    if page == NULL_PAGE {
                        continue;
                    }
                    let p = page as usize;
                    if owner[p] != 0 && owner[p] != g + 1 {
                        return Err(CoreError::Invariant(format!(
                            "page {page} is in the tables of groups {:?} and {:?}",
                            specs[owner[p] - 1].group_id,
                            specs[g].group_id
                        )));
                    }
                    owner[p] = g + 1;
                    refs[p] += 1;
                }
            }
        }
        for (p, &expected) in refs.iter().enumerate().skip(1) {
            let page = u32::try_from(p).unwrap_or(u32::MAX);
            let count = pool.refs_of(page);
            if u64::from(count) != expected {
                return Err(CoreError::Invariant(format!(
                    "page {page} has count {count} but {expected} table reference(s)"
                )));
            }
        }
        pool.check().map_err(CoreError::Invariant)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::hash_pages;
    use crate::table::GroupKind;

    fn hybrid(num_pages: u64) -> FlatCache {
        FlatCache::new(
            vec![
                GroupSpec {
                    group_id: "full".into(),
                    kind: GroupKind::Full,
                    page_size: 4,
                },
                GroupSpec {
                    group_id: "swa".into(),
                    kind: GroupKind::SlidingWindow { window: 8 },
                    page_size: 4,
                },
            ],
            num_pages,
            true,
        )
        .unwrap()
    }

    fn hashes(n: u32) -> Vec<ContentHash> {
        let tokens: Vec<u32> = (0..n).map(|t| t * 31 + 7).collect();
        hash_pages::<&str>(&tokens, 4, &[], &[]).unwrap()
    }

    const A: RequestIdRef<'static> = RequestIdRef::Str("a");
    const B: RequestIdRef<'static> = RequestIdRef::Int(5);

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
        let tables = c.block_tables(&[B, B]).unwrap();
        assert_eq!(tables.len(), 2);
        assert_eq!((tables[1].rows, tables[1].cols), (2, 5));
        assert!(c.block_tables(&[RequestIdRef::Str("nope")]).is_err());
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
        assert!(!c.acquire(A, 8));
        assert!(c.has_request(A));
        assert_eq!(c.page_ids(A).unwrap(), vec![Vec::<u32>::new(), vec![]]);
        assert_eq!(c.pages_needed(4, Some(A)).unwrap(), 2);
        assert_eq!(c.num_requests(), 1);
    }

    #[test]
    fn block_tables_pad_with_minus_one_and_keep_holes() {
        let mut c = hybrid(64);
        assert!(c.acquire(A, 20));
        assert!(c.acquire(B, 4));
        c.reclaim(A, 20).unwrap(); // (20 - 7) // 4 = 3 slid out
        let t = c.block_tables(&[B, A]).unwrap();
        if !crate::FLAT_KVCACHE {
            return;
        }
        assert_eq!((t[1].rows, t[1].cols), (2, 5));
        let a = c.page_ids(A).unwrap();
        let b = c.page_ids(B).unwrap();
        let mut row_b: Vec<i32> = b[1].iter().map(|&p| page_i32(p)).collect();
        row_b.resize(5, -1);
        let row_a: Vec<i32> = a[1].iter().map(|&p| page_i32(p)).collect();
        assert_eq!(&t[1].data[..5], &row_b[..]);
        assert_eq!(&t[1].data[5..], &row_a[..]);
        assert_eq!(&row_a[..3], &[0, 0, 0]);
        assert!(c.block_tables(&[]).unwrap().iter().all(|t| t.rows == 0 && t.cols == 0));
    }

    #[test]
    fn check_invariants_reports_a_corrupted_table() {
        let mut c = hybrid(16);
        assert!(c.acquire(A, 4));
        let shared = c.page_ids(A).unwrap()[0][0];
        // Corrupt: put group 0's page into group 1's table of another request.
        c.requests.insert(
            RequestId::Int(9),
            vec![Table::default(), Table::from_claim(vec![shared])],
        );
        let err = c.check_invariants().unwrap_err();
        assert!(
            err.to_string()
                .contains(&format!("page {shared} is in the tables of groups")),
            "{err}"
        );
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
                            if c.acquire(id, n) {
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
