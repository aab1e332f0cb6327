//! Full-attention groups (SPEC 6): keep all history, so a match is prefix-closed (left to
//! right, up to the first miss) and no slot ever slides out.

/// Match slots `[0, end)` left to right, stopping at the first miss; returns the matched pages
/// and their count (a full match has no holes).
pub(super) fn match_slots(end: usize, mut hit: impl FnMut(usize) -> Option<u32>) -> (Vec<u32>, usize) {
    let mut pages = Vec::new();
    for i in 0..end {
        match hit(i) {
            Some(page) => pages.push(page),
            None => break,
        }
    }
    let hits = pages.len();
    (pages, hits)
}

/// The reclaim bound of a full group: nothing slides out.
pub(super) fn reclaim_bound() -> usize {
    0
}

#[cfg(test)]
mod tests {
    use super::super::testing::lookup;
    use super::super::{GroupKind, GroupManager};

    #[test]
    fn full_match_stops_at_the_first_miss() {
        let g = GroupManager::new(GroupKind::Full, 4);
        assert_eq!(g.match_slots(5, lookup(&[3, 4, 0, 6, 7])), (vec![3, 4], 2));
        assert_eq!(g.match_slots(2, lookup(&[3, 4, 5])), (vec![3, 4], 2));
        assert_eq!(g.match_slots(0, lookup(&[3])), (vec![], 0));
    }
}
