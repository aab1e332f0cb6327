//! Arena mode of the pool (SPEC 13.2; docs/architecture.md, "Hybrid storage").
//!
//! Device memory is `num_units` equal units of `unit_bytes` (unit 0 is null). A unit is free
//! or bound to one group until it is free again; group `g`'s pages are its view indices
//! (`page p` lies at byte `p * page_bytes[g]` of the arena), so a unit `u` holds the pages
//! `ceil(u U / s) .. floor((u + 1) U / s) - 1` of a group with pages of `s` bytes, and a page
//! that straddles two units is never handed out. In the pool's one id space group `g`'s page
//! `p` is id `base[g] + p` (`base[0] = 0`; the null page is id 0 of every group).
//!
//! Lists, every operation O(1) except binding and unbinding a unit (O(pages per unit)):
//! - `free_units`: unbound units, front first;
//! - `idle_units`: bound units none of whose pages is referenced but some hold a key, least
//!   recently idle first; their pages are on no list;
//! - `free_pages[g]` and `cached_pages[g]`: the pages of count 0 in group `g`'s *busy* units
//!   (units with a referenced page), those without a key (front first: released ones at the
//!   front, a newly bound unit's in id order) and those with one (least recently released
//!   first).
//!
//! Taking a page for group `g` (all or nothing over a call, checked first) spends what holds
//! no data before what holds a cached prefix: the front of `free_pages[g]`; else the front
//! free unit, bound to `g`; else the older of the front of `cached_pages[g]` (its key is
//! evicted) and the least recently idle unit (its keys are all evicted; bound to `g`), by the
//! time each joined its list (a page released cached, a unit gone idle: one clock for both). A unit whose last
//! referenced page is released leaves the page lists: to `free_units` (front) when it holds no
//! key, else to the back of `idle_units`; a prefix hit on a page of an idle unit makes it busy
//! again (its other pages join `free_pages[g]` at the front in id order, or the back of
//! `cached_pages[g]`). A page that gains a key moves to the back of `cached_pages[g]`; one whose
//! key is cleared, to the back of `free_pages[g]`.
//!
//! Accounting: a page of group `g` costs `L / kmin[g]` credits, where `kmin[g]` is the fewest
//! pages of `g` a unit holds and `L` the lcm of the `kmin`s; the free credit is `L` per free or
//! idle unit plus each group's listed pages. The credit is what `num_free`,
//! `pages_needed` and `budget` count in arena mode (an estimate that ignores rounding to whole
//! units); whether an allocation fits is decided exactly by [`Arena::units_suffice`], which
//! walks the units the greedy taking would bind when the `kmin` count alone cannot tell.

use crate::engine::lru::{LruList, LruLists};
use crate::error::{CoreError, CoreResult};

/// A unit bound to no group.
pub(super) const UNBOUND: u32 = u32::MAX;

/// Where a free cached page sits in the arena's eviction order (the pool's `place`):
/// the entry before it (0 at the front), on the idle units or on its group's cached pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    /// Whether the entry is a unit (its page's unit was idle) or a page.
    unit: bool,
    /// The unit or page before it; 0 when it was at the front.
    before: u32,
}

/// The list of group `g`'s free pages that hold no key, in [`Arena::pages`].
#[inline]
pub(super) const fn fresh_list(g: usize) -> usize {
    2 * g
}

/// The list of group `g`'s free pages that hold a key, in [`Arena::pages`].
#[inline]
pub(super) const fn cached_list(g: usize) -> usize {
    2 * g + 1
}

/// Largest credit scale `L` (the lcm of the groups' fewest pages per unit).
const MAX_SCALE: u64 = 1 << 24;

/// The geometry of an arena: unit size, unit count and each group's page size in bytes (a
/// state group's page is its slot: pass `unit_bytes`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaGeometry {
    /// Bytes per unit (> 0).
    pub unit_bytes: u64,
    /// Units, unit 0 (null) included (>= 2).
    pub num_units: u64,
    /// Per group, bytes per page (`1 ..= unit_bytes`).
    pub page_bytes: Vec<u64>,
}

/// The pages of group `g` in unit `u`: ids `lo .. hi` of the group's own view.
fn unit_pages(unit_bytes: u64, page_bytes: u64, u: u64) -> (u64, u64) {
    let (big_u, s) = (u128::from(unit_bytes), u128::from(page_bytes));
    let start = u128::from(u) * big_u;
    let lo = start.div_ceil(s);
    let hi = (start + big_u) / s;
    // Both are <= num_ids of the group, which fits u32 (checked in `Arena::new`).
    (
        u64::try_from(lo).unwrap_or(u64::MAX),
        u64::try_from(hi).unwrap_or(u64::MAX),
    )
}

/// Per pool id (`n` of them), the unit that holds it wholly (0 for a straddling page and the
/// null id) and its group.
fn id_tables(
    unit_bytes: u64,
    page_bytes: &[u64],
    base: &[u32],
    num_ids: &[u32],
    n: usize,
) -> CoreResult<(Vec<u32>, Vec<u32>)> {
    let oom = |_| CoreError::OutOfMemory(format!("arena: {n} page ids do not fit in memory"));
    let mut unit_of = Vec::new();
    unit_of.try_reserve_exact(n).map_err(oom)?;
    unit_of.resize(n, 0u32);
    let mut group_of = Vec::new();
    group_of.try_reserve_exact(n).map_err(oom)?;
    group_of.resize(n, 0u32);
    for (g, &s) in page_bytes.iter().enumerate() {
        let g32 = u32::try_from(g).unwrap_or(u32::MAX);
        for p in 1..num_ids[g] {
            let id = (base[g] + p) as usize;
            group_of[id] = g32;
            // The unit that holds page p wholly, if any (a straddling page keeps 0).
            let u = u128::from(p) * u128::from(s) / u128::from(unit_bytes);
            let u = u64::try_from(u).unwrap_or(0);
            let (lo, hi) = unit_pages(unit_bytes, s, u);
            if u > 0 && (lo..hi).contains(&u64::from(p)) {
                unit_of[id] = u32::try_from(u).unwrap_or(0);
            }
        }
    }
    Ok((unit_of, group_of))
}

/// The error of an arena whose groups' page ids overflow the int32 id space.
fn too_many_ids() -> CoreError {
    CoreError::invalid(format!(
        "arena: the page ids of every group must number <= {} in all (ids are int32)",
        super::MAX_BLOCKS
    ))
}

/// Group `g`'s view size (ids, the null one included) and the fewest pages a unit holds, for
/// pages of `s` bytes; checked: `s` in `1 ..= unit_bytes`, the ids within the int32 id space
/// (before the units are scanned), every unit holding a page.
fn group_layout(unit_bytes: u64, num_units: u64, g: usize, s: u64) -> CoreResult<(u64, u64)> {
    if s == 0 || s > unit_bytes {
        return Err(CoreError::invalid(format!(
            "arena: page_bytes[{g}] must be in [1, unit_bytes = {unit_bytes}], got {s}"
        )));
    }
    let ids = u128::from(num_units) * u128::from(unit_bytes) / u128::from(s);
    let ids = u64::try_from(ids)
        .ok()
        .filter(|&n| n <= super::MAX_BLOCKS)
        .ok_or_else(too_many_ids)?;
    // Unit u starts (u * unit_bytes) mod s bytes into a page, which decides how many pages it
    // holds; that offset repeats with period s / gcd(unit_bytes mod s, s), so scanning one
    // period of units sees every count.
    let r = unit_bytes % s;
    let period = if r == 0 { 1 } else { s / gcd(r, s) };
    let fewest = (1..num_units.min(period.saturating_add(1)))
        .map(|u| {
            let (lo, hi) = unit_pages(unit_bytes, s, u);
            hi - lo
        })
        .min()
        .unwrap_or(0);
    if fewest == 0 {
        return Err(CoreError::invalid(format!(
            "arena: some unit holds no page of group {g} (unit_bytes = {unit_bytes}, page_bytes = {s})"
        )));
    }
    Ok((ids, fewest))
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// What a claim does to the arena before an allocation that follows it (see
/// `BlockPool::fits_after_claim`): per group, listed pages it takes and adds (without a key,
/// with one), the cached pages it takes (sorted), and the idle units it wakes (sorted).
#[derive(Clone, Debug, Default)]
pub(super) struct ClaimEffect {
    pub(super) taken: Vec<(u64, u64)>,
    pub(super) added: Vec<(u64, u64)>,
    pub(super) taken_cached: Vec<u32>,
    pub(super) woken: Vec<u32>,
}

impl ClaimEffect {
    /// Group `g`'s listed pages (without a key, with one) once the claim is made.
    fn listed(&self, arena: &Arena, g: usize) -> (u64, u64) {
        let (fresh, cached) = arena.listed(g);
        let (taken, added) = (
            self.taken.get(g).copied().unwrap_or_default(),
            self.added.get(g).copied().unwrap_or_default(),
        );
        // Taken pages were listed, so the differences are >= 0.
        (
            (fresh + added.0).saturating_sub(taken.0),
            (cached + added.1).saturating_sub(taken.1),
        )
    }
}

/// The arena bookkeeping of a [`super::BlockPool`] in arena mode.
#[derive(Clone, Debug)]
pub(super) struct Arena {
    pub(super) unit_bytes: u64,
    pub(super) page_bytes: Vec<u64>,
    /// Per group, the pool id of its view index 0 (`id = base + page`).
    pub(super) base: Vec<u32>,
    /// Per group, its view's ids `0 .. num_ids`.
    pub(super) num_ids: Vec<u32>,
    /// Per group, the fewest pages a unit holds.
    pub(super) kmin: Vec<u64>,
    /// Per group, the credit of one page (`scale / kmin`).
    pub(super) cost: Vec<u64>,
    /// Credits per unit.
    pub(super) scale: u64,
    /// Per pool id, its unit (0 for ids never handed out).
    pub(super) unit_of: Vec<u32>,
    /// Per pool id, its group.
    pub(super) group_of: Vec<u32>,
    /// Per unit, the group it is bound to or [`UNBOUND`].
    pub(super) class: Vec<u32>,
    /// Per unit, its pages with count > 0.
    pub(super) live: Vec<u32>,
    /// Per unit, its pages holding a key.
    pub(super) cached: Vec<u32>,
    pub(super) free_units: LruList,
    pub(super) idle_units: LruList,
    /// The page lists, pool ids as nodes, two per group sharing one link per id (a page is on
    /// one or none): list [`fresh_list`] `g`, group `g`'s free pages of its busy units that hold no
    /// key; list [`cached_list`] `g`, those that hold one, least recently released first.
    pub(super) pages: LruLists,
    /// The clock of `stamp` and `unit_stamp`: one tick per page joining a cached list or unit
    /// joining `idle_units`.
    pub(super) clock: u64,
    /// Per pool id, when it joined its group's cached list (meaningful while it is there).
    pub(super) stamp: Vec<u64>,
    /// Per unit, when it joined `idle_units` (meaningful while it is there).
    pub(super) unit_stamp: Vec<u64>,
}

impl Arena {
    /// The arena of `geometry`, all units free; returns it and the size of the pool's id
    /// space.
    pub(super) fn new(geometry: &ArenaGeometry) -> CoreResult<(Self, usize)> {
        let ArenaGeometry {
            unit_bytes,
            num_units,
            page_bytes,
        } = geometry;
        let (unit_bytes, num_units) = (*unit_bytes, *num_units);
        if unit_bytes == 0 {
            return Err(CoreError::invalid("arena: unit_bytes must be > 0, got 0"));
        }
        if num_units < 2 {
            return Err(CoreError::invalid(format!(
                "arena: num_units must be >= 2 (unit 0 is null), got {num_units}"
            )));
        }
        if page_bytes.is_empty() {
            return Err(CoreError::invalid("arena: page_bytes must name one size per group"));
        }
        let units = u32::try_from(num_units)
            .ok()
            .filter(|&n| u64::from(n) <= super::MAX_BLOCKS)
            .ok_or_else(|| {
                CoreError::invalid(format!(
                    "arena: num_units must be <= {} (ids are int32), got {num_units}",
                    super::MAX_BLOCKS
                ))
            })?;
        let mut base = Vec::with_capacity(page_bytes.len());
        let mut num_ids = Vec::with_capacity(page_bytes.len());
        let mut kmin = Vec::with_capacity(page_bytes.len());
        let mut total: u64 = 1; // the null id
        for (g, &s) in page_bytes.iter().enumerate() {
            let (ids, fewest) = group_layout(unit_bytes, num_units, g, s)?;
            let Some(next) = total.checked_add(ids - 1).filter(|&t| t <= super::MAX_BLOCKS) else {
                return Err(too_many_ids());
            };
            // Both fit u32: they are <= MAX_BLOCKS.
            base.push(u32::try_from(total - 1).unwrap_or(u32::MAX));
            num_ids.push(u32::try_from(ids).unwrap_or(u32::MAX));
            kmin.push(fewest);
            total = next;
        }
        let mut scale = 1u64;
        for &k in &kmin {
            scale = scale / gcd(scale, k) * k;
            if scale > MAX_SCALE {
                return Err(CoreError::invalid(format!(
                    "arena: the pages per unit of the groups ({kmin:?}) have an lcm over {MAX_SCALE}"
                )));
            }
        }
        let cost = kmin.iter().map(|&k| scale / k).collect();
        let n = usize::try_from(total).map_err(|_| CoreError::overflow("arena"))?;
        let (unit_of, group_of) = id_tables(unit_bytes, page_bytes, &base, &num_ids, n)?;
        let last_id = u32::try_from(total - 1).unwrap_or(u32::MAX);
        let oom = |_| CoreError::OutOfMemory("arena lists".to_owned());
        let list = |cap: u32| LruList::empty(cap).map_err(oom);
        let pages = LruLists::empty(last_id, 2 * page_bytes.len()).map_err(oom)?;
        let arena = Self {
            unit_bytes,
            page_bytes: page_bytes.clone(),
            base,
            num_ids,
            kmin,
            cost,
            scale,
            unit_of,
            group_of,
            class: vec![UNBOUND; units as usize],
            live: vec![0; units as usize],
            cached: vec![0; units as usize],
            free_units: LruList::filled(units - 1).map_err(|_| CoreError::OutOfMemory("arena lists".to_owned()))?,
            idle_units: list(units - 1)?,
            pages,
            clock: 0,
            stamp: vec![0; n],
            unit_stamp: vec![0; units as usize],
        };
        Ok((arena, n))
    }

    /// The pool ids of group `g`'s pages in unit `u`, ascending.
    pub(super) fn ids_of_unit(&self, g: usize, u: u32) -> std::ops::Range<u32> {
        let (lo, hi) = unit_pages(self.unit_bytes, self.page_bytes[g], u64::from(u));
        // lo <= hi <= num_ids[g]: pool ids fit u32.
        let b = self.base[g];
        (b + u32::try_from(lo).unwrap_or(0))..(b + u32::try_from(hi).unwrap_or(0))
    }

    /// Whether the taking of `needs[g]` pages per group (in group order, `needs` no longer
    /// than the groups) finds its pages, as `arena_take` takes them, after the changes of a
    /// claim in `claim` (none for a plain allocation).
    ///
    /// Decided at once when every unit counted at its group's fewest pages suffices without
    /// the cached pages, or when even units of `unit_bytes / page_bytes` pages do not with
    /// them; otherwise by following the taking: the pages without a key, the free units front
    /// first, then the cached pages and the idle units older first (the pages a claim adds to
    /// the cached pages are the newest), each unit giving what it holds of the group.
    pub(super) fn units_suffice(&self, needs: &[u64], claim: &ClaimEffect) -> bool {
        let Some(available) = self.units_available().checked_sub(claim.woken.len() as u64) else {
            return false;
        };
        let listed = |g: usize| claim.listed(self, g);
        let (mut surely, mut at_least) = (0u64, 0u64);
        for (g, &need) in needs.iter().enumerate() {
            let (fresh, cached) = listed(g);
            let past_fresh = need.saturating_sub(fresh);
            surely = surely.saturating_add(past_fresh.div_ceil(self.kmin[g]));
            let most = self.unit_bytes / self.page_bytes[g];
            at_least = at_least.saturating_add(past_fresh.saturating_sub(cached).div_ceil(most));
        }
        if surely <= available {
            return true;
        }
        if at_least > available {
            return false;
        }
        let mut free = self.free_units.iter();
        let mut idle = self
            .idle_units
            .iter()
            .filter(|u| claim.woken.binary_search(u).is_err())
            .peekable();
        for (g, &need) in needs.iter().enumerate() {
            let (fresh, _) = listed(g);
            let mut short = need.saturating_sub(fresh);
            while short > 0 {
                let Some(u) = free.next() else {
                    break;
                };
                short = short.saturating_sub(self.ids_of_unit(g, u).len() as u64);
            }
            let mut cached = self
                .pages
                .iter(cached_list(g))
                .filter(|p| claim.taken_cached.binary_search(p).is_err())
                .peekable();
            let mut added = claim.added.get(g).map_or(0, |a| a.1);
            while short > 0 {
                let page_first = match (cached.peek(), idle.peek()) {
                    (Some(&p), Some(&u)) => self.stamp[p as usize] <= self.unit_stamp[u as usize],
                    (Some(_), None) => true,
                    (None, Some(_)) => false,
                    (None, None) => break,
                };
                if page_first {
                    cached.next();
                    short -= 1;
                } else if let Some(u) = idle.next() {
                    short = short.saturating_sub(self.ids_of_unit(g, u).len() as u64);
                }
            }
            // The pages a claim woke are the newest: taken after every older page and unit.
            let from_added = short.min(added);
            short -= from_added;
            added -= from_added;
            if short > 0 {
                return false;
            }
        }
        true
    }

    /// The listed pages of group `g`: (without a key, with one).
    pub(super) fn listed(&self, g: usize) -> (u64, u64) {
        (
            self.pages.len(fresh_list(g)) as u64,
            self.pages.len(cached_list(g)) as u64,
        )
    }

    /// Units that can be bound now: free plus idle.
    pub(super) fn units_available(&self) -> u64 {
        (self.free_units.len() + self.idle_units.len()) as u64
    }

    /// The free credit: `scale` per free or idle unit plus each group's listed pages.
    pub(super) fn credit(&self) -> u64 {
        let pages: u64 = (0..self.cost.len())
            .map(|g| {
                let (fresh, cached) = self.listed(g);
                (fresh + cached).saturating_mul(self.cost[g])
            })
            .fold(0, u64::saturating_add);
        self.units_available().saturating_mul(self.scale).saturating_add(pages)
    }
}

impl<K: Clone + Eq + std::hash::Hash> super::BlockPool<K> {
    /// The arena (arena mode only).
    #[inline]
    fn arena_mut(&mut self) -> &mut Arena {
        self.arena.as_deref_mut().expect("arena mode")
    }

    /// Take `n` pages for group `g` and append them to `out`, all or nothing (arena mode).
    pub(super) fn arena_allocate_into(&mut self, out: &mut Vec<u32>, g: usize, n: usize) -> bool {
        let a = self.arena.as_deref().expect("arena mode");
        let mut needs = vec![0u64; g + 1];
        needs[g] = n as u64;
        if !a.units_suffice(&needs, &ClaimEffect::default()) {
            return false;
        }
        out.reserve(n);
        for _ in 0..n {
            let page = self.arena_take(g);
            out.push(page);
        }
        true
    }

    /// Take one page for group `g` (the caller checked that one can be taken): a page without
    /// a key, a free unit, a cached page, an idle unit, in this order (module doc).
    fn arena_take(&mut self, g: usize) -> u32 {
        let a = self.arena_mut();
        let page = if let Some(page) = a.pages.front(fresh_list(g)) {
            a.pages.unlink(fresh_list(g), page);
            page
        } else if let Some(u) = a.free_units.pop_front() {
            self.arena_take_from_new_unit(u, g)
        } else {
            let page_first = match (a.pages.front(cached_list(g)), a.idle_units.front()) {
                (Some(p), Some(u)) => a.stamp[p as usize] <= a.unit_stamp[u as usize],
                (Some(_), None) => true,
                (None, _) => false,
            };
            if page_first {
                let page = a.pages.front(cached_list(g)).expect("checked above");
                a.pages.unlink(cached_list(g), page);
                page
            } else {
                let u = a.idle_units.pop_front().expect("a unit checked to be available");
                self.arena_evict_unit(u);
                self.arena_take_from_new_unit(u, g)
            }
        };
        let had_key = self.keys[page as usize].is_some();
        self.evict(page);
        self.refs[page as usize] = 1;
        let a = self.arena_mut();
        let u = a.unit_of[page as usize] as usize;
        a.live[u] += 1;
        a.cached[u] -= u32::from(had_key);
        page
    }

    /// Bind unbound unit `u` to group `g` and take its first page off the list.
    fn arena_take_from_new_unit(&mut self, u: u32, g: usize) -> u32 {
        self.arena_bind(u, g);
        let pages = &mut self.arena_mut().pages;
        let page = pages.front(fresh_list(g)).expect("a bound unit holds a page");
        pages.unlink(fresh_list(g), page);
        page
    }

    /// Evict every key of idle unit `u` (in id order) and unbind it.
    fn arena_evict_unit(&mut self, u: u32) {
        let a = self.arena.as_deref().expect("arena mode");
        let g = a.class[u as usize] as usize;
        for page in a.ids_of_unit(g, u) {
            self.evict(page);
        }
        let a = self.arena_mut();
        a.cached[u as usize] = 0;
        a.class[u as usize] = UNBOUND;
    }

    /// Bind free unit `u` to group `g`: its pages join the front of list `fresh_list(g)`, lowest
    /// id first.
    fn arena_bind(&mut self, u: u32, g: usize) {
        let a = self.arena_mut();
        a.class[u as usize] = u32::try_from(g).unwrap_or(UNBOUND);
        for page in a.ids_of_unit(g, u).rev() {
            a.pages.push_front(fresh_list(g), page);
        }
    }

    /// A page of count 0 is taken by a reference (arena bookkeeping of `touch_unchecked`):
    /// off its group's free pages, or its idle unit becomes busy.
    pub(super) fn arena_on_take(&mut self, page: u32) {
        let a = self.arena.as_deref().expect("arena mode");
        let u = a.unit_of[page as usize];
        let g = a.class[u as usize] as usize;
        if a.live[u as usize] == 0 {
            // An idle unit is busy again: its other pages join the free pages.
            let ids = a.ids_of_unit(g, u);
            let (keys, a) = (&self.keys, self.arena.as_deref_mut().expect("arena mode"));
            a.idle_units.unlink(u);
            for p in ids.clone().rev() {
                if p != page && keys[p as usize].is_none() {
                    a.pages.push_front(fresh_list(g), p);
                }
            }
            for p in ids {
                if p != page && keys[p as usize].is_some() {
                    a.clock += 1;
                    a.stamp[p as usize] = a.clock;
                    a.pages.push_back(cached_list(g), p);
                }
            }
        } else if self.keys[page as usize].is_some() {
            self.arena_mut().pages.unlink(cached_list(g), page);
        } else {
            self.arena_mut().pages.unlink(fresh_list(g), page);
        }
        self.arena_mut().live[u as usize] += 1;
    }

    /// A page's count dropped to 0 (arena bookkeeping of `release`).
    pub(super) fn arena_on_free(&mut self, page: u32) {
        let cached = self.keys[page as usize].is_some();
        let a = self.arena.as_deref_mut().expect("arena mode");
        let u = a.unit_of[page as usize];
        let g = a.class[u as usize] as usize;
        a.live[u as usize] -= 1;
        if a.live[u as usize] > 0 {
            if cached {
                a.clock += 1;
                a.stamp[page as usize] = a.clock;
                a.pages.push_back(cached_list(g), page);
            } else {
                a.pages.push_front(fresh_list(g), page);
            }
            return;
        }
        // The unit's last referenced page: its other pages leave the page lists.
        let keys = &self.keys;
        for p in a.ids_of_unit(g, u) {
            if p != page {
                if keys[p as usize].is_some() {
                    a.pages.unlink(cached_list(g), p);
                } else {
                    a.pages.unlink(fresh_list(g), p);
                }
            }
        }
        if a.cached[u as usize] == 0 {
            a.class[u as usize] = UNBOUND;
            a.free_units.push_front(u);
        } else {
            a.clock += 1;
            a.unit_stamp[u as usize] = a.clock;
            a.idle_units.push_back(u);
        }
    }

    /// A page gained a key (arena bookkeeping of `cache_unchecked`): counted in its unit; a
    /// listed free page moves to the back of the cached pages.
    pub(super) fn arena_on_cache(&mut self, page: u32) {
        let free = self.refs[page as usize] == 0;
        let a = self.arena.as_deref_mut().expect("arena mode");
        let u = a.unit_of[page as usize];
        a.cached[u as usize] += 1;
        if free && a.live[u as usize] > 0 {
            let g = a.class[u as usize] as usize;
            a.pages.unlink(fresh_list(g), page);
            a.clock += 1;
            a.stamp[page as usize] = a.clock;
            a.pages.push_back(cached_list(g), page);
        }
    }

    /// A free page's key was cleared (arena bookkeeping of `clear_cached_free`): a listed
    /// page moves to the back of the pages without a key; an idle unit left with no key is
    /// free again.
    pub(super) fn arena_on_uncache(&mut self, page: u32) {
        let a = self.arena.as_deref_mut().expect("arena mode");
        let u = a.unit_of[page as usize];
        a.cached[u as usize] -= 1;
        if a.live[u as usize] > 0 {
            let g = a.class[u as usize] as usize;
            a.pages.unlink(cached_list(g), page);
            a.pages.push_back(fresh_list(g), page);
        }
        if a.cached[u as usize] == 0 && a.live[u as usize] == 0 && a.class[u as usize] != UNBOUND {
            a.idle_units.unlink(u);
            a.class[u as usize] = UNBOUND;
            a.free_units.push_front(u);
        }
    }

    /// The eviction stamp of a cached page of count 0 (its idle unit's, or its own on a busy
    /// unit's cached pages); arena mode.
    pub(super) fn arena_stamp(&self, page: u32) -> u64 {
        let a = self.arena.as_deref().expect("arena mode");
        let u = a.unit_of[page as usize];
        if a.live[u as usize] == 0 {
            a.unit_stamp[u as usize]
        } else {
            a.stamp[page as usize]
        }
    }

    /// Where a cached page of count 0 sits in the eviction order (arena mode): the entry
    /// before it, on the idle units (`true`, a unit) or its group's cached pages (`false`, a
    /// page), 0 at the front. A hint for [`Self::arena_restamp`].
    pub(super) fn arena_place(&self, page: u32) -> Place {
        let a = self.arena.as_deref().expect("arena mode");
        let u = a.unit_of[page as usize];
        if a.live[u as usize] == 0 {
            Place {
                unit: true,
                before: a.idle_units.prev_or_front(u),
            }
        } else {
            let g = a.class[u as usize] as usize;
            Place {
                unit: false,
                before: a.pages.prev_or_front(cached_list(g), page),
            }
        }
    }

    /// A cached page of count 0 takes eviction stamp `stamp` (`None`: the clock's next) and its
    /// place in the order by it: its idle unit among the idle units, or the page among its
    /// group's cached pages (arena mode). Searched forward from `hint` (a place taken by
    /// [`Self::arena_place`]) where it is still on the same list and no newer than `stamp`,
    /// else from the young end: O(entries passed), the same place either way (the lists are
    /// in stamp order).
    pub(super) fn arena_restamp(&mut self, page: u32, stamp: Option<u64>, hint: Option<Place>) {
        let keys = &self.keys;
        let refs = &self.refs;
        let a = self.arena.as_deref_mut().expect("arena mode");
        let stamp = stamp.unwrap_or_else(|| {
            a.clock += 1;
            a.clock
        });
        let u = a.unit_of[page as usize];
        if a.live[u as usize] == 0 {
            a.idle_units.unlink(u);
            a.unit_stamp[u as usize] = stamp;
            let anchor = hint.filter(|h| h.unit).map(|h| h.before).filter(|&v| {
                v == 0
                    || (v != u
                        && a.class[v as usize] != UNBOUND
                        && a.live[v as usize] == 0
                        && a.unit_stamp[v as usize] <= stamp)
            });
            let stamps = &a.unit_stamp;
            match anchor {
                Some(v) => a.idle_units.insert_after_from(v, u, |w| stamps[w as usize] <= stamp),
                None => a.idle_units.insert_behind(u, |w| stamps[w as usize] <= stamp),
            }
        } else {
            let g = a.class[u as usize] as usize;
            a.pages.unlink(cached_list(g), page);
            a.stamp[page as usize] = stamp;
            let anchor = hint.filter(|h| !h.unit).map(|h| h.before).filter(|&p| {
                let i = p as usize;
                p == 0
                    || (p != page
                        && refs[i] == 0
                        && keys[i].is_some()
                        && a.group_of[i] as usize == g
                        && a.live[a.unit_of[i] as usize] > 0
                        && a.stamp[i] <= stamp)
            });
            let stamps = &a.stamp;
            match anchor {
                Some(p) => a
                    .pages
                    .insert_after_from(cached_list(g), p, page, |q| stamps[q as usize] <= stamp),
                None => a
                    .pages
                    .insert_behind(cached_list(g), page, |q| stamps[q as usize] <= stamp),
            }
        }
    }

    /// The keys of every cached page of count 0, in arena order (each group's cached pages,
    /// then the idle units least recently idle first, ids ascending); arena mode.
    pub(super) fn arena_cached_free(&self) -> Vec<u32> {
        let a = self.arena.as_deref().expect("arena mode");
        let groups = a.page_bytes.len();
        let mut pages: Vec<u32> = (0..groups).flat_map(|g| a.pages.iter(cached_list(g))).collect();
        for u in &a.idle_units {
            let g = a.class[u as usize] as usize;
            pages.extend(a.ids_of_unit(g, u).filter(|&p| self.keys[p as usize].is_some()));
        }
        pages
    }

    /// Check the arena's invariants (arena mode).
    pub(super) fn arena_check(&self) -> Result<(), String> {
        let a = self.arena.as_deref().expect("arena mode");
        let free_units = a.free_units.check("free units")?;
        let idle_units = a.idle_units.check("idle units")?;
        let (mut listed, mut listed_cached) = (Vec::new(), Vec::new());
        for g in 0..a.page_bytes.len() {
            listed.push(a.pages.check(fresh_list(g), &format!("free pages of group {g}"))?);
            listed_cached.push(a.pages.check(cached_list(g), &format!("cached pages of group {g}"))?);
        }
        for u in 1..a.class.len() {
            let u32_ = u32::try_from(u).unwrap_or(u32::MAX);
            let class = a.class[u];
            if class == UNBOUND {
                if !free_units[u] || idle_units[u] || a.live[u] != 0 || a.cached[u] != 0 {
                    return Err(format!("unbound unit {u} is not exactly on the free units"));
                }
                continue;
            }
            let g = class as usize;
            let (mut live, mut cached) = (0u32, 0u32);
            for p in a.ids_of_unit(g, u32_) {
                let i = p as usize;
                let refd = self.refs[i] > 0;
                live += u32::from(refd);
                cached += u32::from(self.keys[i].is_some());
                if a.unit_of[i] != u32_ || a.group_of[i] as usize != g {
                    return Err(format!("page {p} is not mapped to unit {u} of group {g}"));
                }
                let want = !refd && a.live[u] > 0;
                let has_key = self.keys[i].is_some();
                let (on_fresh, on_cached) = (listed[g][i], listed_cached[g][i]);
                if on_fresh != (want && !has_key) || on_cached != (want && has_key) {
                    return Err(format!(
                        "page {p} of unit {u} (key: {has_key}): on the free pages {on_fresh}, on the \
                         cached pages {on_cached}, but listed should be {want}"
                    ));
                }
            }
            if live != a.live[u] || cached != a.cached[u] {
                return Err(format!(
                    "unit {u}: counts live {}/{live}, cached {}/{cached} disagree",
                    a.live[u], a.cached[u]
                ));
            }
            if free_units[u] || idle_units[u] != (live == 0) || (live == 0 && cached == 0) {
                return Err(format!(
                    "bound unit {u} (live {live}, cached {cached}) is on the wrong unit list"
                ));
            }
        }
        for (g, (fresh, cached)) in listed.iter().zip(&listed_cached).enumerate() {
            let on = fresh.iter().zip(cached).map(|(&x, &y)| x || y);
            let stray = on.enumerate().find(|&(p, on)| on && a.group_of[p] as usize != g);
            if let Some((p, _)) = stray {
                return Err(format!("page {p} is on the page lists of group {g} but not its page"));
            }
        }
        let referenced = self.refs.iter().filter(|&&c| c > 0).count();
        let bound_live: u32 = a.live.iter().sum();
        if referenced != bound_live as usize {
            return Err(format!(
                "{referenced} pages referenced but units count {bound_live} live"
            ));
        }
        Ok(())
    }
}
