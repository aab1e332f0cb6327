//! The request-level page engine (SPEC 7 and 8): request ids -> tables, the step operations,
//! flat per-group block tables (returned, or written into caller buffers), metrics and the
//! global invariant check. Token-level requests (that own their tokens) are in
//! [`crate::requests`]; both kinds live in the same request slab.

use hashbrown::HashMap;
use rustc_hash::FxBuildHasher;

use crate::coordinator::{Coordinator, EvictionOrder, GroupSpec, PrefixMatch};
use crate::error::{CoreError, CoreResult};
use crate::events::KvEvent;
use crate::hash::ContentHash;
use crate::pool::NULL_PAGE;
use crate::request::RequestIdRef;
use crate::requests::TokenState;
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

/// A caller-provided output table of one group: `rows x cols` int32 in row-major (C) order.
/// Rows past the batch are left untouched.
#[derive(Debug)]
pub struct TableOut<'a> {
    /// The buffer, `rows * cols` values.
    pub data: &'a mut [i32],
    /// Rows of the buffer (at least the batch size).
    pub rows: usize,
    /// Columns of the buffer (at least the widest table of the batch in this group).
    pub cols: usize,
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

/// The metrics of `stats()` (docs/requests-api.md, "Metrics").
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Pages of the pool, the null page excluded.
    pub pages_total: usize,
    /// Pages on the free list.
    pub pages_free: usize,
    /// Pages with count > 0.
    pub pages_in_use: usize,
    /// Pages holding a key.
    pub pages_cached: usize,
    /// Pages holding a key with count 0.
    pub pages_cached_free: usize,
    /// Live requests (token-level and page-level).
    pub requests: usize,
    /// Sum of the prompt lengths given to `add_request` with the prefix cache in use.
    pub prefix_queries_tokens: u64,
    /// Sum of the hits `add_request` returned for those prompts.
    pub prefix_hits_tokens: u64,
    /// Cached pages whose key was dropped because the pool handed them out again.
    pub evictions: u64,
    /// Requests preempted.
    pub preemptions: u64,
    /// Per group (index order), the distinct real pages its tables reference.
    pub pages_in_use_by_group: Vec<usize>,
}

/// Options of a cache (the keyword arguments of the Python constructor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheOptions {
    /// Prefix caching on (register, match, claim).
    pub enable_caching: bool,
    /// How freeing a request orders its pages on the free list.
    pub eviction_order: EvictionOrder,
    /// Record KV events for [`FlatCache::take_events`].
    pub enable_kv_events: bool,
}

impl Default for CacheOptions {
    fn default() -> Self {
        Self {
            enable_caching: true,
            eviction_order: EvictionOrder::Hybrid,
            enable_kv_events: false,
        }
    }
}

/// A page id as `i32`: pools hold at most `i32::MAX` pages, so every id fits.
#[inline]
#[allow(clippy::cast_possible_wrap, reason = "page ids are < MAX_BLOCKS = i32::MAX")]
fn page_i32(page: u32) -> i32 {
    page as i32
}

/// Write one table as a flat row (`row.len() >= table.len()`): the page ids (holes 0), then
/// -1 padding.
#[inline]
fn write_row(row: &mut [i32], table: &Table) {
    let pages = table.pages();
    let (head, tail) = row.split_at_mut(pages.len());
    for (dst, &p) in head.iter_mut().zip(pages) {
        *dst = page_i32(p);
    }
    tail.fill(-1);
}

/// One live request: its tables (one per group), its token state if it is token-level, and
/// the pages promised to its next decode.
#[derive(Clone, Debug, Default)]
pub(crate) struct Entry {
    /// Whether the slot holds a live request.
    pub(crate) live: bool,
    /// One table per group, in group order.
    pub(crate) tables: Vec<Table>,
    /// `Some` for a request created by `add_request`.
    pub(crate) tokens: Option<TokenState>,
    /// Pages reserved for this request's next decode (docs/requests-api.md `reserve`).
    pub(crate) reserve: u64,
}

/// Counters behind [`CacheStats`] that the pool does not keep.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Counters {
    pub(crate) prefix_queries_tokens: u64,
    pub(crate) prefix_hits_tokens: u64,
    pub(crate) preemptions: u64,
}

/// The page engine of one model: a coordinator plus each live request.
///
/// Requests live in a slab (`entries`) indexed through `index`, so a batch resolves each id
/// once and then works by position.
#[derive(Clone, Debug)]
pub struct FlatCache {
    pub(crate) coord: Coordinator,
    pub(crate) index: HashMap<crate::request::RequestId, usize, FxBuildHasher>,
    pub(crate) entries: Vec<Entry>,
    /// Slab positions free for reuse.
    vacant: Vec<usize>,
    pub(crate) eviction: EvictionOrder,
    /// Sum of every request's `reserve` (u128: a sum of u64 page counts cannot overflow it).
    pub(crate) reserved: u128,
    pub(crate) counters: Counters,
    /// Reused buffer of slab positions for batch calls.
    pub(crate) scratch: Vec<usize>,
}

impl FlatCache {
    /// An engine over `specs` with a pool of `num_pages` pages (page 0 included), with the
    /// default options except `enable_caching`.
    pub fn new(specs: Vec<GroupSpec>, num_pages: u64, enable_caching: bool) -> CoreResult<Self> {
        Self::with_options(
            specs,
            num_pages,
            CacheOptions {
                enable_caching,
                ..CacheOptions::default()
            },
        )
    }

    /// An engine over `specs` with a pool of `num_pages` pages (page 0 included).
    pub fn with_options(specs: Vec<GroupSpec>, num_pages: u64, options: CacheOptions) -> CoreResult<Self> {
        let mut coord = Coordinator::new(specs, num_pages, options.enable_caching)?;
        coord.set_kv_events(options.enable_kv_events);
        Ok(Self {
            coord,
            index: HashMap::default(),
            entries: Vec::new(),
            vacant: Vec::new(),
            eviction: options.eviction_order,
            reserved: 0,
            counters: Counters::default(),
            scratch: Vec::new(),
        })
    }

    /// The coordinator (groups, page sizes, pool).
    pub fn coordinator(&self) -> &Coordinator {
        &self.coord
    }

    /// How freeing a request orders its pages.
    pub fn eviction_order(&self) -> EvictionOrder {
        self.eviction
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

    /// The metrics of `stats()`.
    pub fn stats(&self) -> CacheStats {
        let pool = self.coord.pool();
        let total = pool.num_blocks() - 1;
        CacheStats {
            pages_total: total,
            pages_free: pool.num_free(),
            pages_in_use: total - pool.num_free(),
            pages_cached: pool.num_cached(),
            pages_cached_free: pool.num_cached_free(),
            requests: self.index.len(),
            prefix_queries_tokens: self.counters.prefix_queries_tokens,
            prefix_hits_tokens: self.counters.prefix_hits_tokens,
            evictions: pool.evictions(),
            preemptions: self.counters.preemptions,
            pages_in_use_by_group: self.coord.pages_in_use_by_group().to_vec(),
        }
    }

    /// The KV events recorded since the last call, oldest first (always empty when events
    /// are off).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.coord.take_events()
    }

    /// Drop the key of every cached page with count 0 (they stay free, no `BlockRemoved`),
    /// record `AllBlocksCleared`, and return how many keys were dropped.
    pub fn reset_prefix_cache(&mut self) -> usize {
        self.coord.reset_prefix_cache()
    }

    /// Number of live requests.
    pub fn num_requests(&self) -> usize {
        self.index.len()
    }

    /// Whether `req` is a live request.
    pub fn has_request(&self, req: RequestIdRef<'_>) -> bool {
        self.index.contains_key(&req)
    }

    /// The slab position of `req`, or `UnknownRequest`.
    #[inline]
    pub(crate) fn find(&self, req: RequestIdRef<'_>) -> CoreResult<usize> {
        self.index
            .get(&req)
            .copied()
            .ok_or_else(|| CoreError::UnknownRequest(req.to_string()))
    }

    fn tables(&self, req: RequestIdRef<'_>) -> CoreResult<&[Table]> {
        Ok(&self.entries[self.find(req)?].tables)
    }

    /// The request's tables and the coordinator, borrowed together.
    fn split_mut(&mut self, req: RequestIdRef<'_>) -> CoreResult<(&mut Coordinator, &mut Vec<Table>)> {
        let i = self.find(req)?;
        Ok((&mut self.coord, &mut self.entries[i].tables))
    }

    /// Add a new request (the caller checked that `req` is not live); returns its position.
    pub(crate) fn insert(&mut self, req: RequestIdRef<'_>, tokens: Option<TokenState>) -> usize {
        let entry = Entry {
            live: true,
            tables: vec![Table::default(); self.coord.num_groups()],
            tokens,
            reserve: 0,
        };
        let at = if let Some(at) = self.vacant.pop() {
            self.entries[at] = entry;
            at
        } else {
            self.entries.push(entry);
            self.entries.len() - 1
        };
        self.index.insert(req.to_id(), at);
        at
    }

    /// Free the request at `at` (its pages in the eviction order, its reserve) and forget it;
    /// returns its token state, if any.
    pub(crate) fn release(&mut self, req: RequestIdRef<'_>, at: usize) -> Option<TokenState> {
        self.index.remove(&req);
        let mut entry = std::mem::take(&mut self.entries[at]);
        self.coord.free(&mut entry.tables, self.eviction);
        self.reserved -= u128::from(entry.reserve);
        self.vacant.push(at);
        entry.tokens
    }

    /// The request's position, created empty (page-level) on first use.
    fn ensure(&mut self, req: RequestIdRef<'_>) -> usize {
        match self.index.get(&req) {
            Some(&at) => at,
            None => self.insert(req, None),
        }
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
        let existing = self.index.get(&req).map(|&at| self.entries[at].tables.as_slice());
        self.coord.check_claim(existing, m)?;
        let at = self.ensure(req);
        self.coord.claim(&mut self.entries[at].tables, m);
        Ok(())
    }

    /// Make room for `n` more tokens in every group of `req` (created if new), all or nothing.
    pub fn acquire(&mut self, req: RequestIdRef<'_>, n: u64) -> bool {
        let at = self.ensure(req);
        self.coord.acquire(&mut self.entries[at].tables, n)
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

    /// Release all of `req`'s pages (in the eviction order), drop its reserve and forget it.
    pub fn free(&mut self, req: RequestIdRef<'_>) -> CoreResult<()> {
        let at = self.find(req)?;
        self.release(req, at);
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

    // ----- flat block tables --------------------------------------------------------------

    /// Flat block tables of a batch, one per group in group order: `[len(reqs), max_cols]`,
    /// holes 0, padding -1, rows in the order given (repeats allowed). Unavailable (a config
    /// error naming the build) without the `flat` feature.
    pub fn block_tables(&self, reqs: &[RequestIdRef<'_>]) -> CoreResult<Vec<FlatTable>> {
        if !crate::FLAT_KVCACHE {
            return Err(CoreError::FlatUnavailable);
        }
        let rows: Vec<&[Table]> = reqs.iter().map(|&r| self.tables(r)).collect::<CoreResult<_>>()?;
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
                let start = data.len();
                data.resize(start + cols, 0);
                write_row(&mut data[start..], &ts[g]);
            }
            out.push(FlatTable {
                rows: rows.len(),
                cols,
                data,
            });
        }
        Ok(out)
    }

    /// Write the batch's flat block tables into caller buffers, one per group in group order:
    /// row `r` of group `g` gets request `reqs[r]`'s page ids (holes 0) then -1 up to the
    /// buffer's columns; rows past the batch are untouched. Everything is checked before
    /// anything is written: an unknown request, a buffer with too few rows, or a table wider
    /// than its buffer (an error naming the group) leaves every buffer as it was.
    pub fn write_block_tables(&self, reqs: &[RequestIdRef<'_>], outs: &mut [TableOut<'_>]) -> CoreResult<()> {
        if !crate::FLAT_KVCACHE {
            return Err(CoreError::FlatUnavailable);
        }
        let specs = self.coord.specs();
        if outs.len() != specs.len() {
            return Err(CoreError::invalid(format!(
                "block_tables: out has {} tables but the cache has {} groups",
                outs.len(),
                specs.len()
            )));
        }
        let mut rows: Vec<&[Table]> = Vec::with_capacity(reqs.len());
        for &r in reqs {
            rows.push(self.tables(r)?);
        }
        for (g, out) in outs.iter().enumerate() {
            // Quoted the Python way, as the caller indexes the mapping: out['full'] (built only
            // for a message).
            let gid = || format!("'{}'", specs[g].group_id.escape_debug());
            if out.rows.checked_mul(out.cols) != Some(out.data.len()) {
                return Err(CoreError::invalid(format!(
                    "block_tables: out[{}] holds {} values, not {} x {}",
                    gid(),
                    out.data.len(),
                    out.rows,
                    out.cols
                )));
            }
            if out.rows < reqs.len() {
                return Err(CoreError::invalid(format!(
                    "block_tables: out[{}] has {} rows, fewer than the {} requests",
                    gid(),
                    out.rows,
                    reqs.len()
                )));
            }
            if let Some((r, ts)) = rows.iter().enumerate().find(|(_, ts)| ts[g].len() > out.cols) {
                return Err(CoreError::invalid(format!(
                    "block_tables: out[{}] has {} columns but request {} has {} pages in that group",
                    gid(),
                    out.cols,
                    reqs[r],
                    ts[g].len()
                )));
            }
        }
        for (g, out) in outs.iter_mut().enumerate() {
            let cols = out.cols;
            if cols == 0 {
                continue;
            }
            for (row, ts) in out.data.chunks_exact_mut(cols).zip(&rows) {
                write_row(row, &ts[g]);
            }
        }
        Ok(())
    }

    // ----- invariants ---------------------------------------------------------------------

    /// Check every invariant; the error describes the first violation: a page in the tables
    /// of two groups; a page's count differing from its table references; a count-0 page off
    /// the free list or a counted page on it; a key map entry pointing at a page that does not
    /// hold that key; `free + in_use + 1 != num_pages`; a per-group in-use count or the reserve
    /// total disagreeing with the tables and requests.
    pub fn check_invariants(&self) -> CoreResult<()> {
        let pool = self.coord.pool();
        let specs = self.coord.specs();
        let n = pool.num_blocks();
        // owner[p] = 1 + group of the tables holding p (0: none); refs[p] = table references.
        let mut owner = vec![0usize; n];
        let mut refs = vec![0u64; n];
        let mut reserved = 0u128;
        for entry in self.entries.iter().filter(|e| e.live) {
            reserved += u128::from(entry.reserve);
            for (g, table) in entry.tables.iter().enumerate() {
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
        for (g, &counted) in self.coord.pages_in_use_by_group().iter().enumerate() {
            let actual = owner.iter().filter(|&&o| o == g + 1).count();
            if counted != actual {
                return Err(CoreError::Invariant(format!(
                    "group {:?} counts {counted} pages in use but its tables reference {actual}",
                    specs[g].group_id
                )));
            }
        }
        let live = self.entries.iter().filter(|e| e.live).count();
        if live != self.index.len() || reserved != self.reserved {
            return Err(CoreError::Invariant(format!(
                "request ledger disagrees: {live} live entries for {} ids, reserves sum to {reserved} \
                 but the total is {}",
                self.index.len(),
                self.reserved
            )));
        }
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
        if !crate::FLAT_KVCACHE {
            assert!(matches!(c.block_tables(&[B, A]), Err(CoreError::FlatUnavailable)));
            return;
        }
        let t = c.block_tables(&[B, A]).unwrap();
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
        let at = c.insert(RequestIdRef::Int(9), None);
        c.entries[at].tables = vec![Table::default(), Table::from_claim(vec![shared])];
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
