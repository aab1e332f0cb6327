//! Group kinds and their rules (SPEC 6): [`GroupKind`] names a group's retention rule and a
//! [`GroupManager`] applies it to tables (acquire, register, prefix match, reclaim and their
//! dry runs).
//!
//! Rules every kind shares live here; each kind's own rules live in its file and the manager
//! dispatches on the kind:
//! - [`full`]: full attention (prefix-closed match, nothing slides out).
//! - [`sliding`]: sliding window (match a run behind a boundary, reclaim slid-out slots).
//! - [`state`]: linear attention / mamba state (a window of 2; registers only the final page
//!   of a range that ends on a page boundary).
//! - [`chunked`]: chunked local attention (a token attends its own chunk of `C` tokens; the
//!   pages of finished chunks are released).

use std::hash::Hash;

use crate::engine::pool::{BlockPool, NULL_PAGE};
use crate::engine::table::Table;
use crate::num::Divisor;

pub mod chunked;
pub mod full;
pub mod sliding;
pub mod state;

/// How freeing a request orders its pages on the free list (docs/requests-api.md, SPEC 12.3).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EvictionOrder {
    /// All groups' real pages by the end token of their slot, descending (ties: lower group
    /// index first): a request's chain tail is evicted first across every group together,
    /// so each group's half of a hybrid prefix stays equally long.
    #[default]
    Hybrid,
    /// The reference design's order: group 0's table tail first, then group 1's, and so on,
    /// released as vLLM's block pool frees them; reclaim releases newest slot first the same
    /// way ([`release_newest_first`]).
    Group,
}

impl EvictionOrder {
    /// The order named `name` (`"hybrid"` or `"group"`).
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "hybrid" => Some(Self::Hybrid),
            "group" => Some(Self::Group),
            _ => None,
        }
    }

    /// The order's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Hybrid => "hybrid",
            Self::Group => "group",
        }
    }
}

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
    /// Chunked local attention: the token at position `t` attends `[t - t % chunk, t]`.
    ChunkedLocal {
        /// The chunk `C >= 1` in tokens (a multiple of the page size, checked by the
        /// coordinator).
        chunk: u64,
    },
}

/// Why a (kind name, window) pair names no [`GroupKind`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KindError {
    /// The name is none of [`GroupKind::NAMES`].
    UnknownName,
    /// `sliding_window` needs a window `>= 1`.
    WindowRequired,
    /// `full`, `state` and `chunked_local` take no window.
    WindowNotAllowed,
    /// `chunked_local` needs a chunk `>= 1`.
    ChunkRequired,
    /// Only `chunked_local` takes a chunk.
    ChunkNotAllowed,
}

impl GroupKind {
    /// The kind names the public API uses, in the order messages list them.
    pub const NAMES: [&'static str; 4] = ["full", "sliding_window", "state", "chunked_local"];

    /// The public name of this kind (one of [`Self::NAMES`]).
    pub fn name(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::SlidingWindow { .. } => "sliding_window",
            Self::State => "state",
            Self::ChunkedLocal { .. } => "chunked_local",
        }
    }

    /// The kind a public name, window and chunk describe; the one place kind names are parsed.
    pub fn from_name(name: &str, window: Option<u64>, chunk: Option<u64>) -> Result<Self, KindError> {
        if !Self::NAMES.contains(&name) {
            return Err(KindError::UnknownName);
        }
        match (name, window, chunk) {
            ("chunked_local", _, None | Some(0)) => Err(KindError::ChunkRequired),
            ("chunked_local", Some(_), _) => Err(KindError::WindowNotAllowed),
            ("chunked_local", None, Some(chunk)) => Ok(Self::ChunkedLocal { chunk }),
            (_, _, Some(_)) => Err(KindError::ChunkNotAllowed),
            ("full", None, None) => Ok(Self::Full),
            ("state", None, None) => Ok(Self::State),
            ("sliding_window", Some(window), None) if window >= 1 => Ok(Self::SlidingWindow { window }),
            ("sliding_window", _, None) => Err(KindError::WindowRequired),
            _ => Err(KindError::WindowNotAllowed),
        }
    }

    /// The configured chunk of a chunked-local group (`None` for the other kinds).
    pub fn chunk(self) -> Option<u64> {
        match self {
            Self::ChunkedLocal { chunk } => Some(chunk),
            Self::Full | Self::SlidingWindow { .. } | Self::State => None,
        }
    }

    /// The configured sliding window (`None` for full attention and state groups).
    pub fn sliding_window(self) -> Option<u64> {
        match self {
            Self::SlidingWindow { window } => Some(window),
            Self::Full | Self::State | Self::ChunkedLocal { .. } => None,
        }
    }

    /// The effective window in tokens: the most history a token attends (`None` for full
    /// attention; a chunked group's chunk).
    pub fn window(self) -> Option<u64> {
        match self {
            Self::Full => None,
            Self::SlidingWindow { window } => Some(window),
            Self::State => Some(state::WINDOW),
            Self::ChunkedLocal { chunk } => Some(chunk),
        }
    }

    /// Whether a match of this group is prefix-closed (full attention only).
    pub fn is_prefix_closed(self) -> bool {
        matches!(self, Self::Full)
    }
}

/// A group's rule applied to tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupManager {
    kind: GroupKind,
    page: Divisor,
    /// Consecutive cached pages a resumable boundary needs: `ceil((W-1)/P)` (0 for full).
    needed: u64,
    /// A state group's working page that holds no key moves to the new last slot on acquire
    /// (the default); when false a fresh page is always taken there and the previous one stays
    /// in its slot until reclaim releases it ([`Self::set_moves_working_page`]).
    moves: bool,
}

impl GroupManager {
    /// A manager for pages of `page_size > 0` tokens (validated by the coordinator).
    pub fn new(kind: GroupKind, page_size: u64) -> Self {
        let page = Divisor::new(page_size);
        let needed = match kind {
            // Pages per chunk: a boundary needs the pages from its chunk's start.
            GroupKind::ChunkedLocal { chunk } => page.quotient(chunk),
            _ => kind.window().map_or(0, |w| page.ceil_div(w.saturating_sub(1))),
        };
        Self {
            kind,
            page,
            needed,
            moves: true,
        }
    }

    /// Whether a state group moves its unkeyed working page to the slot an acquire adds
    /// (`true`, the default, SPEC 13.4) or always allocates a fresh page there, leaving the
    /// previous page in its slot until reclaim releases it (`false`: vLLM's mamba "align"
    /// tables; the cache option `move_state_pages`). No effect on the other kinds.
    pub fn set_moves_working_page(&mut self, on: bool) {
        self.moves = on;
    }

    /// Whether a state group moves its unkeyed working page ([`Self::set_moves_working_page`]).
    pub fn moves_working_page(&self) -> bool {
        self.moves
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
    pub fn blocks_needed(&self, table: &Table, n: u64, movable: bool) -> u64 {
        if n <= table.tail_avail {
            0
        } else if self.kind == GroupKind::State {
            // Sparse state (SPEC 13.4): one page, for the last token, however many slots; none
            // when the working page moves there.
            u64::from(!movable)
        } else {
            self.page.ceil_div(n - table.tail_avail)
        }
    }

    /// Whether a state table's working page moves to a later slot when the request passes
    /// into it, instead of a page being allocated there: its last page is real and holds no
    /// key (it is no checkpoint, and only this request references it), and the group moves
    /// working pages at all ([`Self::set_moves_working_page`]). Always false for the other
    /// kinds.
    pub fn state_movable<K: Clone + Eq + Hash>(&self, pool: &BlockPool<K>, table: &Table) -> bool {
        self.kind == GroupKind::State
            && self.moves
            && table
                .pages
                .last()
                .is_some_and(|&p| p != NULL_PAGE && pool.key_of(p).is_none())
    }

    /// Make room for `n` more tokens: use the tail, then allocate whole pages all or nothing
    /// from group `g`'s pages. A state group puts only a page in the last new slot (the state
    /// after the range's last token) and leaves the slots before it holes (SPEC 13.4): its
    /// working page, moved there when [`Self::state_movable`] (the slot it leaves becomes a
    /// hole), else a new one. Returns false (and changes nothing) when the pool has too few
    /// free pages.
    pub fn acquire<K: Clone + Eq + Hash>(&self, pool: &mut BlockPool<K>, g: usize, table: &mut Table, n: u64) -> bool {
        if n <= table.tail_avail {
            table.tail_avail -= n;
            return true;
        }
        let over = n - table.tail_avail;
        let Ok(count) = usize::try_from(self.page.ceil_div(over)) else {
            return false;
        };
        if self.kind == GroupKind::State {
            let page = if self.state_movable(pool, table) {
                let last = table.pages.len() - 1;
                std::mem::replace(&mut table.pages[last], NULL_PAGE)
            } else {
                let mut page = Vec::with_capacity(1);
                if !pool.allocate_group_into(&mut page, g, 1) {
                    return false;
                }
                page[0]
            };
            table.pages.resize(table.pages.len() + count - 1, NULL_PAGE);
            table.pages.push(page);
        } else if !pool.allocate_group_into(&mut table.pages, g, count) {
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
    pub fn match_slots(&self, end: usize, hit: impl FnMut(usize) -> Option<u32>) -> (Vec<u32>, usize) {
        match self.kind {
            GroupKind::Full => full::match_slots(end, hit),
            GroupKind::SlidingWindow { .. } => sliding::match_slots(self.needed, end, hit),
            GroupKind::State => state::match_slots(self.needed, end, hit),
            GroupKind::ChunkedLocal { .. } => chunked::match_slots(self.needed, end, hit),
        }
    }

    /// The reclaim bound at `n` computed tokens: slots `[0, k)` have fully slid out of the
    /// window (`k = min((n - W + 1) // P, len)`, 0 when `n - W + 1 <= 0`; 0 for full groups).
    pub fn reclaim_bound(&self, table: &Table, n: u64) -> usize {
        match self.kind {
            GroupKind::Full => full::reclaim_bound(),
            GroupKind::SlidingWindow { window } => sliding::reclaim_bound(self.page, window, table, n),
            GroupKind::State => state::reclaim_bound(self.page, table, n),
            GroupKind::ChunkedLocal { chunk } => chunked::reclaim_bound(self.page, chunk, table, n),
        }
    }

    /// The smallest position `n` at which [`Self::reclaim`] would change `table` (its bound
    /// passes the known holes), or `None` if no position would until the table grows.
    pub fn reclaim_due(&self, table: &Table) -> Option<u64> {
        let window = match self.kind {
            GroupKind::Full => return None,
            GroupKind::SlidingWindow { window } => window,
            GroupKind::State => state::WINDOW,
            GroupKind::ChunkedLocal { chunk } => return chunked::reclaim_due(self.page, chunk, table),
        };
        if table.holes_below() >= table.len() {
            return None;
        }
        // bound(n) = (n - (W - 1)) // P > holes  <=>  n >= (holes + 1) * P + W - 1.
        let slots = u64::try_from(table.holes_below()).ok()?.checked_add(1)?;
        slots
            .checked_mul(self.page.get())?
            .checked_add(window.saturating_sub(1))
    }

    /// Replace every real page of the slid-out slots `[0, k)` by a hole and release them in
    /// `order`: under [`EvictionOrder::Hybrid`] lowest slot first (so the lowest slot is
    /// evicted first), under [`EvictionOrder::Group`] as vLLM does
    /// ([`release_newest_first`]). Holes in the middle do not stop it (SPEC 12.2). Returns
    /// how many released pages became free (count 0).
    pub fn reclaim<K: Clone + Eq + Hash>(
        &self,
        pool: &mut BlockPool<K>,
        table: &mut Table,
        n: u64,
        order: EvictionOrder,
    ) -> usize {
        match self.kind {
            GroupKind::Full => 0,
            GroupKind::SlidingWindow { .. } | GroupKind::State | GroupKind::ChunkedLocal { .. } => {
                sliding::reclaim(pool, table, self.reclaim_bound(table, n), order)
            }
        }
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
        match self.kind {
            GroupKind::Full => 0,
            GroupKind::SlidingWindow { .. } | GroupKind::State | GroupKind::ChunkedLocal { .. } => {
                sliding::reclaimable(pool, table, self.reclaim_bound(table, n), count_uncached)
            }
        }
    }

    /// Release every page of `table` tail first as vLLM frees a request's table
    /// ([`release_newest_first`]; the [`EvictionOrder::Group`] order) and empty it. Returns
    /// how many released pages became free (count 0).
    pub fn free<K: Clone + Eq + Hash>(&self, pool: &mut BlockPool<K>, table: &mut Table) -> usize {
        release_newest_first(pool, &mut table.take_pages())
    }
}

/// Release the real pages of `pages` (in slot order) the way vLLM's `BlockPool.free_blocks`
/// frees them newest (highest slot) first, and make every entry a hole. vLLM appends the
/// cached pages to the free list in that order and puts the uncached ones at its front as one
/// run in that same order (the highest slot handed out first). A released page here joins
/// the back when it holds a key and the front when it holds none (with
/// `reuse_uncached_first`), one at a time, so: the pages holding a key are released highest
/// slot first, then those holding none lowest slot first. Without `reuse_uncached_first`
/// every page joins the back, and all are released highest slot first. This is the
/// [`EvictionOrder::Group`] order of `free` and `reclaim`. Returns how many pages became free.
pub fn release_newest_first<K: Clone + Eq + Hash>(pool: &mut BlockPool<K>, pages: &mut [u32]) -> usize {
    let uncached_to_front = pool.reuse_uncached_first();
    let mut freed = 0;
    for slot in pages.iter_mut().rev() {
        if *slot != NULL_PAGE && !(uncached_to_front && pool.key_of(*slot).is_none()) {
            freed += usize::from(pool.release(*slot));
            *slot = NULL_PAGE;
        }
    }
    // Only pages holding no key are left (releasing never changes a page's key).
    for slot in pages.iter_mut() {
        if *slot != NULL_PAGE {
            freed += usize::from(pool.release(*slot));
            *slot = NULL_PAGE;
        }
    }
    freed
}

/// A registration as the coordinator asks it of every group: the base-page hashes
/// `[first_slot, first_slot + len)`, base pages of `base` tokens, and the position the range
/// should end at (`end_tokens`, when the caller knows it).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RegisterRange {
    pub(crate) first_slot: u64,
    pub(crate) len: usize,
    pub(crate) base: u64,
    pub(crate) end_tokens: Option<u64>,
}

/// Where one group's `register` writes: slots `[start, start + count)` of its table, whose
/// keys fold base hashes starting at `skip`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RegisterPlan {
    pub(crate) start: usize,
    pub(crate) count: usize,
    pub(crate) skip: usize,
}

impl GroupManager {
    /// Where this group registers `range` when each of its pages holds `mult` base pages: the
    /// complete aligned runs of `mult` hashes, narrowed by the kind's rule (state groups:
    /// [`state::register_plan`]); `None` when the group registers nothing.
    pub(crate) fn register_plan(&self, mult: Divisor, range: RegisterRange) -> Option<RegisterPlan> {
        let (m, len, first_slot) = (mult, range.len, range.first_slot);
        // The fold starts at the first base page at or after `first_slot` that is a multiple
        // of m, i.e. at slot ceil(first_slot / m), after skipping `skip` hashes.
        let rem = m.remainder(first_slot);
        let start = m.quotient(first_slot) + u64::from(rem > 0);
        let skip = usize::try_from(if rem == 0 { 0 } else { m.get() - rem }).map_or(len, |s| s.min(len));
        let runs = usize::try_from(m.quotient(u64::try_from(len - skip).unwrap_or(u64::MAX))).unwrap_or(usize::MAX);
        let plan = RegisterPlan {
            start: usize::try_from(start).unwrap_or(usize::MAX),
            count: runs,
            skip,
        };
        match self.kind {
            GroupKind::State => state::register_plan(self.page, mult, range, plan),
            GroupKind::Full | GroupKind::SlidingWindow { .. } | GroupKind::ChunkedLocal { .. } => Some(plan),
        }
    }
}

#[cfg(test)]
mod testing {
    use super::{GroupKind, GroupManager};
    use crate::engine::pool::BlockPool;

    pub(super) type Pool = BlockPool<u32>;

    pub(super) fn sliding(p: u64, w: u64) -> GroupManager {
        GroupManager::new(GroupKind::SlidingWindow { window: w }, p)
    }

    /// `hit` for a match from a slot -> page map where `0` is a miss.
    pub(super) fn lookup(cached: &[u32]) -> impl FnMut(usize) -> Option<u32> + '_ {
        |i| cached.get(i).copied().filter(|&p| p != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::testing::Pool;
    use super::*;

    #[test]
    fn kind_names_round_trip() {
        for kind in [
            GroupKind::Full,
            GroupKind::SlidingWindow { window: 7 },
            GroupKind::State,
        ] {
            assert_eq!(
                GroupKind::from_name(kind.name(), kind.sliding_window(), kind.chunk()),
                Ok(kind)
            );
            assert!(GroupKind::NAMES.contains(&kind.name()));
        }
        assert_eq!(
            GroupKind::from_name("sliding_window", Some(0), None),
            Err(KindError::WindowRequired)
        );
        assert_eq!(
            GroupKind::from_name("sliding_window", None, None),
            Err(KindError::WindowRequired)
        );
        assert_eq!(
            GroupKind::from_name("full", Some(4), None),
            Err(KindError::WindowNotAllowed)
        );
        assert_eq!(GroupKind::from_name("Full", None, None), Err(KindError::UnknownName));
        assert_eq!(GroupKind::from_name("Full", None, Some(4)), Err(KindError::UnknownName));
        assert_eq!(
            GroupKind::from_name("full", None, Some(4)),
            Err(KindError::ChunkNotAllowed)
        );
        assert_eq!(
            GroupKind::from_name("chunked_local", None, None),
            Err(KindError::ChunkRequired)
        );
        assert_eq!(
            GroupKind::from_name("chunked_local", None, Some(0)),
            Err(KindError::ChunkRequired)
        );
        assert_eq!(
            GroupKind::from_name("chunked_local", Some(8), Some(8)),
            Err(KindError::WindowNotAllowed)
        );
        assert_eq!(
            GroupKind::from_name("chunked_local", None, Some(8)),
            Ok(GroupKind::ChunkedLocal { chunk: 8 })
        );
    }

    #[test]
    fn acquire_uses_the_tail_then_whole_pages() {
        let mut pool = Pool::new(10, true).unwrap();
        let g = GroupManager::new(GroupKind::Full, 4);
        let mut t = Table::default();
        assert_eq!(g.blocks_needed(&t, 0, false), 0);
        assert!(g.acquire(&mut pool, 0, &mut t, 0));
        assert_eq!(g.blocks_needed(&t, 5, false), 2);
        assert!(g.acquire(&mut pool, 0, &mut t, 5));
        assert_eq!((t.pages(), t.tail_avail()), (&[1, 2][..], 3));
        assert_eq!(g.blocks_needed(&t, 3, false), 0);
        assert!(g.acquire(&mut pool, 0, &mut t, 3));
        assert_eq!(t.tail_avail(), 0);
        assert!(g.acquire(&mut pool, 0, &mut t, 8));
        assert_eq!((t.len(), t.tail_avail()), (4, 0));
        // 6 free pages; 7 pages are not available: nothing changes.
        assert_eq!(g.blocks_needed(&t, 25, false), 7);
        assert!(!g.acquire(&mut pool, 0, &mut t, 25));
        assert_eq!((t.len(), t.tail_avail(), pool.num_free()), (4, 0, 5));
        assert!(!g.acquire(&mut pool, 0, &mut t, u64::MAX));
    }

    #[test]
    fn register_skips_holes_hashed_pages_and_a_partial_tail() {
        let mut pool = Pool::new(10, true).unwrap();
        let g = GroupManager::new(GroupKind::Full, 4);
        let mut t = Table::default();
        assert!(g.acquire(&mut pool, 0, &mut t, 14)); // 4 pages, tail 2
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
    fn free_releases_tail_first() {
        let mut pool = Pool::new(6, true).unwrap();
        pool.set_reuse_uncached_first(false); // SPEC 5's order: released pages join the back
        let g = GroupManager::new(GroupKind::Full, 1);
        let mut t = Table::default();
        assert!(g.acquire(&mut pool, 0, &mut t, 3));
        assert_eq!(g.free(&mut pool, &mut t), 3);
        assert!(t.is_empty());
        assert_eq!(pool.free_list().collect::<Vec<_>>(), vec![4, 5, 3, 2, 1]);
    }
}
