//! Sliding-window groups (SPEC 6): keep the last `W - 1` tokens. A match needs a run of
//! `needed = ceil((W - 1) / P)` consecutive cached slots behind its boundary; slots that slid
//! out of the window become holes and their pages are released (reclaim): lowest slot first
//! under the `hybrid` eviction order, as vLLM's sliding-window manager frees them under
//! `group` ([`super::release_newest_first`]).

use std::hash::Hash;

use super::release_newest_first;
use crate::engine::group::EvictionOrder;
use crate::engine::pool::{BlockPool, NULL_PAGE};
use crate::engine::table::Table;
use crate::num::Divisor;

/// Match slots `[0, end)`: scan right to left from `end` for a run of `needed` consecutive
/// hits behind a boundary; a miss moves the boundary just left of it; a run that reaches slot
/// 0 is accepted even if shorter. Slots left of the accepted run are holes. Returns the pages
/// (the length is the matched extent in slots) and the number of real pages.
pub(super) fn match_slots(needed: u64, end: usize, mut hit: impl FnMut(usize) -> Option<u32>) -> (Vec<u32>, usize) {
    let needed = usize::try_from(needed).unwrap_or(usize::MAX);
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

/// The reclaim bound of a window of `window` tokens over pages of `page` tokens at `n`
/// computed tokens: `min((n - W + 1) // P, len)`, 0 when `n - W + 1 <= 0`.
pub(super) fn reclaim_bound(page: Divisor, window: u64, table: &Table, n: u64) -> usize {
    // n - W + 1 > 0  <=>  n >= W, computed without overflow as n - (W - 1).
    match n.checked_sub(window.saturating_sub(1)) {
        Some(past) if past > 0 => {
            usize::try_from(page.quotient(past)).map_or(table.pages.len(), |k| k.min(table.pages.len()))
        }
        _ => 0,
    }
}

/// Replace every real page of the slid-out slots `[0, k)` by a hole and release them: lowest
/// slot first under [`EvictionOrder::Hybrid`], newest first as vLLM frees them under
/// [`EvictionOrder::Group`]. Returns how many released pages became free (count 0).
pub(super) fn reclaim<K: Clone + Eq + Hash>(
    pool: &mut BlockPool<K>,
    table: &mut Table,
    k: usize,
    order: EvictionOrder,
) -> usize {
    if k <= table.holes_below {
        return 0;
    }
    let slid_out = &mut table.pages[table.holes_below..k];
    let freed = match order {
        EvictionOrder::Group => release_newest_first(pool, slid_out),
        EvictionOrder::Hybrid => {
            let mut freed = 0;
            for slot in slid_out {
                if *slot != NULL_PAGE {
                    freed += usize::from(pool.release(*slot));
                    *slot = NULL_PAGE;
                }
            }
            freed
        }
    };
    table.holes_below = k;
    freed
}

/// The dry run of [`reclaim`] below `k`: real slid-out pages whose last reference is this
/// table (and, unless `count_uncached`, that hold a key).
pub(super) fn reclaimable<K: Clone + Eq + Hash>(
    pool: &BlockPool<K>,
    table: &Table,
    k: usize,
    count_uncached: bool,
) -> usize {
    if k <= table.holes_below {
        return 0;
    }
    table.pages[table.holes_below..k]
        .iter()
        .filter(|&&p| p != NULL_PAGE && pool.refs_of(p) == 1 && (count_uncached || pool.key_of(p).is_some()))
        .count()
}

#[cfg(test)]
mod tests {
    use super::super::testing::{lookup, sliding, Pool};
    use super::super::{GroupKind, GroupManager};
    use crate::engine::group::EvictionOrder::{Group, Hybrid};
    use crate::engine::table::Table;

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
    fn reclaim_frees_every_slid_out_page_even_past_a_middle_hole() {
        let mut pool = Pool::new(10, true).unwrap();
        pool.set_reuse_uncached_first(false); // SPEC 5's order: released pages join the back
        let g = sliding(4, 5); // W = 5
        let mut t = Table::default();
        assert!(g.acquire(&mut pool, 0, &mut t, 20)); // pages 1..=5
        let hole_page = t.pages[2];
        pool.release(hole_page); // a hole in the middle (host tier)
        t.pages[2] = 0;
        // n = 16: k = (16 - 5 + 1) // 4 = 3 -> slots 0, 1 (2 is already a hole).
        assert_eq!(g.reclaim_bound(&t, 16), 3);
        assert_eq!(g.reclaimable(&pool, &t, 16, true), 2);
        assert_eq!(g.reclaimable(&pool, &t, 16, false), 0);
        let free_before: Vec<u32> = pool.free_list().collect();
        assert_eq!(g.reclaim(&mut pool, &mut t, 16, Hybrid), 2);
        assert_eq!(t.pages(), &[0, 0, 0, 4, 5]);
        let free_after: Vec<u32> = pool.free_list().collect();
        // Lowest slot released first, so it is evicted first.
        assert_eq!(&free_after[free_before.len()..], &[1, 2]);
        // n = 20: k = 4 -> slot 3; a second reclaim at the same n does nothing.
        assert_eq!(g.reclaimable(&pool, &t, 20, true), 1);
        assert_eq!(g.reclaim(&mut pool, &mut t, 20, Hybrid), 1);
        assert_eq!(g.reclaim(&mut pool, &mut t, 20, Hybrid), 0);
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
        assert!(g.acquire(&mut pool, 0, &mut t, 6)); // pages 1, 2, 3
        pool.retain(1); // shared with another table
        pool.cache_unchecked(2, 7);
        // n = 6: k = (6 - 2) // 2 = 2 -> slots 0, 1; page 1 is shared.
        assert_eq!(g.reclaimable(&pool, &t, 6, true), 1);
        assert_eq!(g.reclaimable(&pool, &t, 6, false), 1);
        // Page 1 is still referenced elsewhere: only page 2 becomes free.
        assert_eq!(g.reclaim(&mut pool, &mut t, 6, Group), 1);
        assert_eq!(pool.refs_of(1), 1);
        assert_eq!(pool.refs_of(2), 0);
    }

    #[test]
    fn group_order_reclaims_as_vllm_frees_newest_first() {
        // vLLM's SlidingWindowManager frees slid-out blocks highest slot first: cached ones join
        // the back in that order, uncached ones the front as one run in that order.
        let mut pool = Pool::new(12, true).unwrap();
        let g = sliding(2, 3); // W = 3: k = (n - 2) // 2
        let mut t = Table::default();
        assert!(g.acquire(&mut pool, 0, &mut t, 12)); // pages 1..=6
        for page in [2, 3] {
            pool.cache_unchecked(page, page + 100);
        }
        // n = 10: k = 4 -> slots 0..4 = pages 1, 2 (cached), 3 (cached), 4.
        assert_eq!(g.reclaim(&mut pool, &mut t, 10, Group), 4);
        assert_eq!(t.pages(), &[0, 0, 0, 0, 5, 6]);
        let free: Vec<u32> = pool.free_list().collect();
        // Uncached 4 then 1 at the front; cached 3 then 2 at the back.
        assert_eq!(free, vec![4, 1, 7, 8, 9, 10, 11, 3, 2]);
        // Without reuse_uncached_first every page joins the back, highest slot first.
        let mut pool = Pool::new(8, true).unwrap();
        pool.set_reuse_uncached_first(false);
        let mut t = Table::default();
        assert!(g.acquire(&mut pool, 0, &mut t, 8)); // pages 1..=4
        pool.cache_unchecked(2, 102);
        assert_eq!(g.reclaim(&mut pool, &mut t, 8, Group), 3);
        assert_eq!(pool.free_list().collect::<Vec<u32>>(), vec![5, 6, 7, 3, 2, 1]);
        pool.check().unwrap();
    }
}
