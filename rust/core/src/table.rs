//! Per-request block tables and the three group managers (SPEC 6).
//!
//! A [`Table`] is one request's pages in one group: slot `i` covers tokens `[i*P, (i+1)*P)`,
//! holes (slid-out or never-matched slots) are the null page 0, and tables never shrink.
//! A [`GroupManager`] holds a group's rule (full attention, sliding window, or state) and
//! applies it to tables: acquire, register, prefix match, reclaim and their dry runs.

use std::hash::Hash;

use crate::num::divisor::Divisor;
use crate::pool::{BlockPool, NULL_PAGE};

/// The retention rule of a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupKind {
    /// Full attention: keeps all history; prefix-closed.
    Full,
    /// Sliding-window attention over `window` tokens (keeps the last `window - 1`).
    SlidingWindow {
        /// The window `W >= 1` in tokens.
        window: u64,
    },
    /// Linear attention / mamba state: a sliding window with `W = 2`; registers only the
    /// final page of a range that ends exactly on a page boundary.
    State,
}

/// Why a (kind name, window) pair names no [`GroupKind`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KindError {
    /// The name is none of [`GroupKind::NAMES`].
    UnknownName,
    /// `sliding_window` needs a window `>= 1`.
    WindowRequired,
    /// `full` and `state` take no window.
    WindowNotAllowed,
}

impl GroupKind {
    /// The kind names the public API uses, in the order messages list them.
    pub const NAMES: [&'static str; 3] = ["full", "sliding_window", "state"];

    /// The public name of this kind (one of [`Self::NAMES`]).
    pub fn name(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::SlidingWindow { .. } => "sliding_window",
            Self::State => "state",
        }
    }

    /// The kind a public name and window describe; the one place kind names are parsed.
    pub fn from_name(name: &str, window: Option<u64>) -> Result<Self, KindError> {
        match (name, window) {
            ("full", None) => Ok(Self::Full),
            ("state", None) => Ok(Self::State),
            ("sliding_window", Some(window)) if window >= 1 => Ok(Self::SlidingWindow { window }),
            ("sliding_window", _) => Err(KindError::WindowRequired),
            ("full" | "state", Some(_)) => Err(KindError::WindowNotAllowed),
            _ => Err(KindError::UnknownName),
        }
    }

    /// The configured sliding window (`None` for full attention and state groups).
    pub fn sliding_window(self) -> Option<u64> {
        match self {
            Self::SlidingWindow { window } => Some(window),
            Self::Full | Self::State => None,
        }
    }

    /// The effective window in tokens (`None` for full attention).
    pub fn window(self) -> Option<u64> {
        match self {
            Self::Full => None,
            Self::SlidingWindow { window } => Some(window),
            Self::State => Some(2),
        }
    }

    /// Whether a match of this group is prefix-closed (full attention only).
    pub fn is_prefix_closed(self) -> bool {
        matches!(self, Self::Full)
    }
}

/// One request's pages in one group.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Table {
    /// Page per slot; `0` is a hole.
    pages: Vec<u32>,
    /// Free token slots in the last page.
    tail_avail: u64,
    /// Slots below this are known holes (everything under a previous reclaim bound), so a
    /// reclaim scans only new ground. Nothing ever puts a real page below it again: claims
    /// only fill empty tables and acquires append.
    holes_below: usize,
}

impl Table {
    /// Page ids per slot, holes as 0.
    pub fn pages(&self) -> &[u32] {
        &self.pages
    }

    /// Free token slots in the last page.
    pub fn tail_avail(&self) -> u64 {
        self.tail_avail
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Whether the table has no slots.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Slots below this index are known holes (nothing below a past reclaim bound is real).
    pub(crate) fn holes_below(&self) -> usize {
        self.holes_below
    }

    /// A table holding `pages` (holes included) with a full last page, as after a claim.
    pub(crate) fn from_claim(pages: Vec<u32>) -> Self {
        Self {
            pages,
            tail_avail: 0,
            holes_below: 0,
        }
    }

    /// Take the pages out, leaving an empty table.
    pub(crate) fn take_pages(&mut self) -> Vec<u32> {
        self.tail_avail = 0;
        self.holes_below = 0;
        std::mem::take(&mut self.pages)
    }
}

/// A group's rule applied to tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupManager {
    kind: GroupKind,
    page: Divisor,
    /// Consecutive cached pages a resumable boundary needs: `ceil((W-1)/P)` (0 for full).
    needed: u64,
}

impl GroupManager {
    /// A manager for pages of `page_size > 0` tokens (validated by the coordinator).
    pub fn new(kind: GroupKind, page_size: u64) -> Self {
        let page = Divisor::new(page_size);
        let needed = kind.window().map_or(0, |w| page.ceil_div(w.saturating_sub(1)));
        Self { kind, page, needed }
    }

    /// The group's rule.
    pub fn kind(&self) -> GroupKind {
        self.kind
    }

    /// Tokens per page.
    pub fn page_size(&self) -> u64 {
        self.page.get()
    }

    /// Tokens per page, as a divisor.
    pub fn page(&self) -> Divisor {
        self.page
    }

    /// Pages [`Self::acquire`] would allocate for `n` more tokens (its exact dry run).
    pub fn blocks_needed(&self, table: &Table, n: u64) -> u64 {
        if n <= table.tail_avail {
            0
        } else {
            self.page.ceil_div(n - table.tail_avail)
        }
    }

    /// Make room for `n` more tokens: use the tail, then allocate whole pages all or nothing.
    /// Returns false (and changes nothing) when the pool has too few free pages.
    pub fn acquire<K: Clone + Eq + Hash>(&self, pool: &mut BlockPool<K>, table: &mut Table, n: u64) -> bool {
        if n <= table.tail_avail {
            table.tail_avail -= n;
            return true;
        }
        let over = n - table.tail_avail;
        let Ok(count) = usize::try_from(self.page.ceil_div(over)) else {
            return false;
        };
        if !pool.allocate_into(&mut table.pages, count) {
            return false;
        }
        let rem = self.page.remainder(over);
        table.tail_avail = if rem == 0 { 0 } else { self.page.get() - rem };
        true
    }

    /// Register keys for slots `first .. first + count` (the caller has checked the range):
    /// holes, pages that already hold a key, and the last slot while its page has free
    /// token slots are skipped. `key(j)` gives the key of slot `first + j`; it is called only
    /// for slots that are registered, so skipped slots cost no hashing.
    pub fn register<K: Clone + Eq + Hash>(
        &self,
        pool: &mut BlockPool<K>,
        table: &Table,
        first: usize,
        count: usize,
        mut key: impl FnMut(usize) -> K,
    ) {
        let last = table.pages.len().wrapping_sub(1);
        for j in 0..count {
            let slot = first + j;
            let page = table.pages[slot];
            if page == NULL_PAGE || pool.key_of(page).is_some() || (slot == last && table.tail_avail > 0) {
                continue;
            }
            pool.cache_unchecked(page, key(j));
        }
    }

    /// Match slots `[0, end)`; `hit(i)` looks up slot `i`'s key. Returns the matched pages
    /// (holes as 0; the length is the matched extent in slots) and the number of real pages.
    ///
    /// Full attention walks left to right and stops at the first miss. Sliding window and
    /// state scan right to left from `end` for a run of `needed` consecutive hits behind a
    /// boundary; a miss moves the boundary just left of it; a run that reaches slot 0 is
    /// accepted even if shorter. Slots left of the accepted run are holes.
    pub fn match_slots(&self, end: usize, mut hit: impl FnMut(usize) -> Option<u32>) -> (Vec<u32>, usize) {
        if self.kind.is_prefix_closed() {
            let mut pages = Vec::new();
            for i in 0..end {
                match hit(i) {
                    Some(page) => pages.push(page),
                    None => break,
                }
            }
            let hits = pages.len();
            return (pages, hits);
        }
        let needed = usize::try_from(self.needed).unwrap_or(usize::MAX);
        let mut boundary = end;
        let mut run: Vec<u32> = Vec::new(); // hits behind `boundary`, right to left
        for i in (0..end).rev() {
            if run.len() >= needed {
                break;
            }
            if let Some(page) = hit(i) {
                run.push(page);
            } else {
                boundary = i;
                run.clear();
            }
        }
        let hits = run.len();
        let mut pages = vec![NULL_PAGE; boundary - hits];
        pages.extend(run.iter().rev());
        (pages, hits)
    }

    /// The reclaim bound at `n` computed tokens: slots `[0, k)` have fully slid out of the
    /// window (`k = min((n - W + 1) // P, len)`, 0 when `n - W + 1 <= 0`; 0 for full groups).
    pub fn reclaim_bound(&self, table: &Table, n: u64) -> usize {
        let Some(window) = self.kind.window() else {
            return 0;
        };
        // n - W + 1 > 0  <=>  n >= W, computed without overflow as n - (W - 1).
        match n.checked_sub(window.saturating_sub(1)) {
            Some(past) if past > 0 => {
                usize::try_from(self.page.quotient(past)).map_or(table.pages.len(), |k| k.min(table.pages.len()))
            }
            _ => 0,
        }
    }

    /// Replace every real page of the slid-out slots `[0, k)` by a hole and release them,
    /// lowest slot first (so the lowest slot is evicted first). Holes in the middle do not
    /// stop it (SPEC 12.2). Returns how many released pages became free (count 0).
    pub fn reclaim<K: Clone + Eq + Hash>(&self, pool: &mut BlockPool<K>, table: &mut Table, n: u64) -> usize {
        let k = self.reclaim_bound(table, n);
        if k <= table.holes_below {
            return 0;
        }
        let mut freed = 0;
        for slot in &mut table.pages[table.holes_below..k] {
            if *slot != NULL_PAGE {
                freed += usize::from(pool.release(*slot));
                *slot = NULL_PAGE;
            }
        }
        table.holes_below = k;
        freed
    }

    /// Pages [`Self::reclaim`] at `n` would return to the free list: real slid-out pages whose
    /// last reference is this table (and, unless `count_uncached`, that hold a key).
    pub fn reclaimable<K: Clone + Eq + Hash>(
        &self,
        pool: &BlockPool<K>,
        table: &Table,
        n: u64,
        count_uncached: bool,
    ) -> usize {
        let k = self.reclaim_bound(table, n);
        if k <= table.holes_below {
            return 0;
        }
        table.pages[table.holes_below..k]
            .iter()
            .filter(|&&p| p != NULL_PAGE && pool.refs_of(p) == 1 && (count_uncached || pool.key_of(p).is_some()))
            .count()
    }

    /// Release every page of `table` in reverse slot order (tail first) and empty it.
    /// Returns how many released pages became free (count 0).
    pub fn free<K: Clone + Eq + Hash>(&self, pool: &mut BlockPool<K>, table: &mut Table) -> usize {
        let mut freed = 0;
        for &page in table.take_pages().iter().rev() {
            if page != NULL_PAGE {
                freed += usize::from(pool.release(page));
            }
        }
        freed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Pool = BlockPool<u32>;

    #[test]
    fn kind_names_round_trip() {
        for kind in [
            GroupKind::Full,
            GroupKind::SlidingWindow { window: 7 },
            GroupKind::State,
        ] {
            assert_eq!(GroupKind::from_name(kind.name(), kind.sliding_window()), Ok(kind));
            assert!(GroupKind::NAMES.contains(&kind.name()));
        }
        assert_eq!(
            GroupKind::from_name("sliding_window", Some(0)),
            Err(KindError::WindowRequired)
        );
        assert_eq!(
            GroupKind::from_name("sliding_window", None),
            Err(KindError::WindowRequired)
        );
        assert_eq!(GroupKind::from_name("full", Some(4)), Err(KindError::WindowNotAllowed));
        assert_eq!(GroupKind::from_name("Full", None), Err(KindError::UnknownName));
    }

    fn sliding(p: u64, w: u64) -> GroupManager {
        GroupManager::new(GroupKind::SlidingWindow { window: w }, p)
    }

    /// `hit` for a match from a slot -> page map where `0` is a miss.
    fn lookup(cached: &[u32]) -> impl FnMut(usize) -> Option<u32> + '_ {
        |i| cached.get(i).copied().filter(|&p| p != 0)
    }

    #[test]
    fn acquire_uses_the_tail_then_whole_pages() {
        let mut pool = Pool::new(10, true).unwrap();
        let g = GroupManager::new(GroupKind::Full, 4);
        let mut t = Table::default();
        assert_eq!(g.blocks_needed(&t, 0), 0);
        assert!(g.acquire(&mut pool, &mut t, 0));
        assert_eq!(g.blocks_needed(&t, 5), 2);
        assert!(g.acquire(&mut pool, &mut t, 5));
        assert_eq!((t.pages(), t.tail_avail()), (&[1, 2][..], 3));
        assert_eq!(g.blocks_needed(&t, 3), 0);
        assert!(g.acquire(&mut pool, &mut t, 3));
        assert_eq!(t.tail_avail(), 0);
        assert!(g.acquire(&mut pool, &mut t, 8));
        assert_eq!((t.len(), t.tail_avail()), (4, 0));
        // 6 free pages; 7 pages are not available: nothing changes.
        assert_eq!(g.blocks_needed(&t, 25), 7);
        assert!(!g.acquire(&mut pool, &mut t, 25));
        assert_eq!((t.len(), t.tail_avail(), pool.num_free()), (4, 0, 5));
        assert!(!g.acquire(&mut pool, &mut t, u64::MAX));
    }

    #[test]
    fn full_match_stops_at_the_first_miss() {
        let g = GroupManager::new(GroupKind::Full, 4);
        assert_eq!(g.match_slots(5, lookup(&[3, 4, 0, 6, 7])), (vec![3, 4], 2));
        assert_eq!(g.match_slots(2, lookup(&[3, 4, 5])), (vec![3, 4], 2));
        assert_eq!(g.match_slots(0, lookup(&[3])), (vec![], 0));
    }

    #[test]
    fn sliding_match_accepts_a_run_of_needed_hits() {
        // P = 4, W = 9: needed = ceil(8/4) = 2.
        let g = sliding(4, 9);
        // Slots 0..6 all cached: the run [4, 5] behind boundary 6; slots 0..4 are holes.
        assert_eq!(
            g.match_slots(6, lookup(&[1, 2, 3, 4, 5, 6])),
            (vec![0, 0, 0, 0, 5, 6], 2)
        );
        // The miss at slot 4 moves the boundary to 4; the run of slots 2, 3 is accepted.
        assert_eq!(g.match_slots(6, lookup(&[1, 2, 3, 4, 0, 6])), (vec![0, 0, 3, 4], 2));
    }

    #[test]
    fn sliding_match_with_holes_and_short_runs() {
        // needed = 2. Alternating misses: the boundary walks down to 1; the run of slot 0
        // reaches the begin bound and is accepted although shorter.
        let g = sliding(4, 9);
        assert_eq!(g.match_slots(4, lookup(&[7, 0, 8, 0])), (vec![7], 1));
        // Every slot a miss: boundary 0, empty result.
        assert_eq!(g.match_slots(3, lookup(&[0, 0, 0])), (vec![], 0));
        // A run reaching the begin bound is accepted even if shorter than needed.
        let wide = sliding(4, 33); // needed 8
        assert_eq!(wide.match_slots(3, lookup(&[1, 2, 3])), (vec![1, 2, 3], 3));
        assert_eq!(wide.match_slots(4, lookup(&[1, 2, 3, 0])), (vec![1, 2, 3], 3));
    }

    #[test]
    fn window_one_makes_every_slot_a_hole() {
        let g = sliding(4, 1);
        let mut calls = 0;
        let (pages, hits) = g.match_slots(3, |_| {
            calls += 1;
            Some(9)
        });
        assert_eq!((pages, hits, calls), (vec![0, 0, 0], 0, 0));
    }

    #[test]
    fn state_match_takes_the_rightmost_cached_snapshot() {
        let g = GroupManager::new(GroupKind::State, 4); // needed = ceil(1/4) = 1
        assert_eq!(g.match_slots(4, lookup(&[1, 2, 0, 0])), (vec![0, 2], 1));
        assert_eq!(g.match_slots(4, lookup(&[1, 2, 3, 4])), (vec![0, 0, 0, 4], 1));
    }

    #[test]
    fn register_skips_holes_hashed_pages_and_a_partial_tail() {
        let mut pool = Pool::new(10, true).unwrap();
        let g = GroupManager::new(GroupKind::Full, 4);
        let mut t = Table::default();
        assert!(g.acquire(&mut pool, &mut t, 14)); // 4 pages, tail 2
        pool.cache_unchecked(t.pages()[1], 100);
        t.pages[0] = 0; // a hole (the test owns the page; counts do not matter here)
        let mut asked = Vec::new();
        g.register(&mut pool, &t, 0, 4, |j| {
            asked.push(j);
            u32::try_from(j).unwrap()
        });
        // Slot 0 hole, slot 1 already hashed, slot 3 partial tail: only slot 2 registers.
        assert_eq!(asked, vec![2]);
        assert_eq!(pool.lookup(&2), Some(t.pages()[2]));
        assert_eq!(pool.lookup(&100), Some(t.pages()[1]));
    }

    #[test]
    fn reclaim_frees_every_slid_out_page_even_past_a_middle_hole() {
        let mut pool = Pool::new(10, true).unwrap();
        let g = sliding(4, 5); // W = 5
        let mut t = Table::default();
        assert!(g.acquire(&mut pool, &mut t, 20)); // pages 1..=5
        let hole_page = t.pages[2];
        pool.release(hole_page); // a hole in the middle (host tier)
        t.pages[2] = 0;
        // n = 16: k = (16 - 5 + 1) // 4 = 3 -> slots 0, 1 (2 is already a hole).
        assert_eq!(g.reclaim_bound(&t, 16), 3);
        assert_eq!(g.reclaimable(&pool, &t, 16, true), 2);
        assert_eq!(g.reclaimable(&pool, &t, 16, false), 0);
        let free_before: Vec<u32> = pool.free_list().collect();
        assert_eq!(g.reclaim(&mut pool, &mut t, 16), 2);
        assert_eq!(t.pages(), &[0, 0, 0, 4, 5]);
        let free_after: Vec<u32> = pool.free_list().collect();
        // Lowest slot released first, so it is evicted first.
        assert_eq!(&free_after[free_before.len()..], &[1, 2]);
        // n = 20: k = 4 -> slot 3; a second reclaim at the same n does nothing.
        assert_eq!(g.reclaimable(&pool, &t, 20, true), 1);
        assert_eq!(g.reclaim(&mut pool, &mut t, 20), 1);
        assert_eq!(g.reclaim(&mut pool, &mut t, 20), 0);
        assert_eq!(t.pages(), &[0, 0, 0, 0, 5]);
        pool.check().unwrap();
    }

    #[test]
    fn reclaim_bound_edges() {
        let g = sliding(4, 5);
        let t = Table::from_claim(vec![1, 2]);
        assert_eq!(g.reclaim_bound(&t, 0), 0);
        assert_eq!(g.reclaim_bound(&t, 4), 0); // n - W + 1 = 0
        assert_eq!(g.reclaim_bound(&t, 8), 1);
        assert_eq!(g.reclaim_bound(&t, u64::MAX), 2); // capped at the table length
        let full = GroupManager::new(GroupKind::Full, 4);
        assert_eq!(full.reclaim_bound(&t, u64::MAX), 0);
        let state = GroupManager::new(GroupKind::State, 4); // W = 2: k = (n - 1) // 4
        assert_eq!(state.reclaim_bound(&t, 4), 0);
        assert_eq!(state.reclaim_bound(&t, 5), 1);
        let w1 = sliding(4, 1); // k = n // 4
        assert_eq!(w1.reclaim_bound(&t, 4), 1);
    }

    #[test]
    fn reclaimable_counts_only_last_references() {
        let mut pool = Pool::new(10, true).unwrap();
        let g = sliding(2, 3);
        let mut t = Table::default();
        assert!(g.acquire(&mut pool, &mut t, 6)); // pages 1, 2, 3
        pool.retain(1); // shared with another table
        pool.cache_unchecked(2, 7);
        // n = 6: k = (6 - 2) // 2 = 2 -> slots 0, 1; page 1 is shared.
        assert_eq!(g.reclaimable(&pool, &t, 6, true), 1);
        assert_eq!(g.reclaimable(&pool, &t, 6, false), 1);
        // Page 1 is still referenced elsewhere: only page 2 becomes free.
        assert_eq!(g.reclaim(&mut pool, &mut t, 6), 1);
        assert_eq!(pool.refs_of(1), 1);
        assert_eq!(pool.refs_of(2), 0);
    }

    #[test]
    fn free_releases_tail_first() {
        let mut pool = Pool::new(6, true).unwrap();
        let g = GroupManager::new(GroupKind::Full, 1);
        let mut t = Table::default();
        assert!(g.acquire(&mut pool, &mut t, 3));
        assert_eq!(g.free(&mut pool, &mut t), 3);
        assert!(t.is_empty());
        assert_eq!(pool.free_list().collect::<Vec<_>>(), vec![4, 5, 3, 2, 1]);
    }
}
