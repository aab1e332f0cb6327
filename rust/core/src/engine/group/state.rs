//! State groups (linear attention / mamba, SPEC 6 and 7): a sliding window with `W = 2` (a
//! request resumes from its latest state snapshot) that registers only the final page of a
//! range ending exactly on a page boundary (a snapshot exists only there).

use super::{sliding, RegisterPlan, RegisterRange};
use crate::engine::table::Table;
use crate::num::Divisor;

/// The effective window of a state group, in tokens.
pub(super) const WINDOW: u64 = 2;

/// Match slots `[0, end)` as a sliding window of [`WINDOW`]: the rightmost cached snapshot.
pub(super) fn match_slots(needed: u64, end: usize, hit: impl FnMut(usize) -> Option<u32>) -> (Vec<u32>, usize) {
    sliding::match_slots(needed, end, hit)
}

/// The reclaim bound of a sliding window of [`WINDOW`].
pub(super) fn reclaim_bound(page: Divisor, table: &Table, n: u64) -> usize {
    sliding::reclaim_bound(page, WINDOW, table, n)
}

/// Narrow `plan` (the complete aligned runs of `range`, `mult` base pages each) to the final
/// page, and only when the range ends exactly at `range.end_tokens` on a page boundary of
/// `page` tokens; `None` otherwise (or when there is no complete run).
pub(super) fn register_plan(
    page: Divisor,
    mult: Divisor,
    range: RegisterRange,
    plan: RegisterPlan,
) -> Option<RegisterPlan> {
    let runs = plan.count;
    let ends_here = range.end_tokens.is_some_and(|end| {
        page.remainder(end) == 0
            && u64::try_from(range.len)
                .ok()
                .and_then(|len| range.first_slot.checked_add(len))
                .and_then(|n| n.checked_mul(range.base))
                == Some(end)
    });
    if !ends_here || runs == 0 {
        return None;
    }
    Some(RegisterPlan {
        start: plan.start.saturating_add(runs - 1),
        count: 1,
        // runs > 0 implies m <= len, so these products stay within len.
        skip: plan.skip + (runs - 1) * usize::try_from(mult.get()).unwrap_or(usize::MAX),
    })
}

#[cfg(test)]
mod tests {
    use super::super::testing::lookup;
    use super::super::{GroupKind, GroupManager, RegisterRange};
    use crate::num::Divisor;

    #[test]
    fn state_match_takes_the_rightmost_cached_snapshot() {
        let g = GroupManager::new(GroupKind::State, 4); // needed = ceil(1/4) = 1
        assert_eq!(g.match_slots(4, lookup(&[1, 2, 0, 0])), (vec![0, 2], 1));
        assert_eq!(g.match_slots(4, lookup(&[1, 2, 3, 4])), (vec![0, 0, 0, 4], 1));
    }

    #[test]
    fn state_registers_only_the_final_page_of_a_range_ending_on_a_page_boundary() {
        // P = 8 over base pages of 4 (m = 2): hashes of base pages 0..6 cover tokens 0..24.
        let g = GroupManager::new(GroupKind::State, 8);
        let m = Divisor::new(2);
        let range = |end_tokens| RegisterRange {
            first_slot: 0,
            len: 6,
            base: 4,
            end_tokens,
        };
        // Ends at 24 on a page boundary: only slot 2, folding base pages 4 and 5.
        let plan = g.register_plan(m, range(Some(24))).unwrap();
        assert_eq!((plan.start, plan.count, plan.skip), (2, 1, 4));
        // The range does not end at the position, the position is mid-page, or it is unknown.
        assert!(g.register_plan(m, range(Some(32))).is_none());
        assert!(g.register_plan(m, range(Some(20))).is_none());
        assert!(g.register_plan(m, range(None)).is_none());
        // A full group registers every complete run.
        let full = GroupManager::new(GroupKind::Full, 8)
            .register_plan(m, range(None))
            .unwrap();
        assert_eq!((full.start, full.count, full.skip), (0, 3, 0));
    }
}
