//! Chunked local attention groups (SPEC 6): the token at position `t` attends the tokens of its
//! own chunk of `C` tokens, `[t - t % C, t]` (Llama 4's local layers). The chunk is a multiple
//! of the page size, so chunks start on page boundaries and a chunk is `K = C / P` slots.
//!
//! - Reclaim at `n` computed tokens: the next token attends from `n - n % C`, so every slot
//!   before `floor(n / C) * K` is released.
//! - Match: a boundary `b` can be resumed from only if every page of its chunk before it is
//!   cached, slots `[floor(b / K) * K, b)`; a boundary on a chunk start needs none. Scanning from
//!   the end bound, a miss moves the boundary just left of it and the check starts again from
//!   that boundary's own chunk start. Every slot before the accepted run is a hole.
//! - Registration: every complete page, as full attention.

use crate::engine::pool::NULL_PAGE;
use crate::engine::table::Table;
use crate::num::Divisor;

/// Match slots `[0, end)` with `per_chunk = C / P` slots per chunk; returns the pages (holes
/// 0; the length is the matched extent in slots) and the number of real pages.
pub(super) fn match_slots(per_chunk: u64, end: usize, mut hit: impl FnMut(usize) -> Option<u32>) -> (Vec<u32>, usize) {
    let per_chunk = usize::try_from(per_chunk).unwrap_or(usize::MAX).max(1);
    let mut boundary = end;
    let mut run: Vec<u32> = Vec::new(); // hits behind `boundary`, right to left
    loop {
        let start = boundary - boundary % per_chunk;
        run.clear();
        let mut missed = None;
        for i in (start..boundary).rev() {
            let Some(page) = hit(i) else {
                missed = Some(i);
                break;
            };
            run.push(page);
        }
        match missed {
            None => break,
            Some(i) => boundary = i,
        }
    }
    let hits = run.len();
    let mut pages = vec![NULL_PAGE; boundary - hits];
    pages.extend(run.iter().rev());
    (pages, hits)
}

/// The reclaim bound at `n` computed tokens: `min(floor(n / C) * (C / P), len)`.
pub(super) fn reclaim_bound(page: Divisor, chunk: u64, table: &Table, n: u64) -> usize {
    let started = n - n % chunk.max(1); // the current chunk's first token
    usize::try_from(page.quotient(started)).map_or(table.pages.len(), |k| k.min(table.pages.len()))
}

/// The smallest position at which [`reclaim_bound`] passes the known holes, or `None` when no
/// position would until the table grows.
pub(super) fn reclaim_due(page: Divisor, chunk: u64, table: &Table) -> Option<u64> {
    if table.holes_below() >= table.len() {
        return None;
    }
    // bound(n) = floor(n / C) * K > h  <=>  floor(n / C) >= floor(h / K) + 1.
    let per_chunk = page.quotient(chunk).max(1);
    let chunks = u64::try_from(table.holes_below()).ok()? / per_chunk + 1;
    chunks.checked_mul(chunk)
}

#[cfg(test)]
mod tests {
    use super::super::testing::lookup;
    use super::super::{GroupKind, GroupManager};
    use crate::engine::table::Table;

    fn chunked(p: u64, c: u64) -> GroupManager {
        GroupManager::new(GroupKind::ChunkedLocal { chunk: c }, p)
    }

    #[test]
    fn match_needs_every_page_of_the_boundarys_chunk_before_it() {
        // P = 4, C = 12: three slots per chunk; chunks are slots [0, 3), [3, 6), [6, 9).
        let g = chunked(4, 12);
        // Boundary 8 (token 32): its chunk starts at slot 6; slots 6, 7 cached: accepted, and
        // slots 0..6 are holes.
        assert_eq!(
            g.match_slots(8, lookup(&[1, 2, 3, 4, 5, 6, 7, 8])),
            (vec![0, 0, 0, 0, 0, 0, 7, 8], 2)
        );
        // A miss at slot 7 moves the boundary to 7, whose chunk start is 6: slot 6 is enough.
        assert_eq!(
            g.match_slots(8, lookup(&[1, 2, 3, 4, 5, 6, 7, 0])),
            (vec![0, 0, 0, 0, 0, 0, 7], 1)
        );
        // A miss at slot 6 moves the boundary to 6, a chunk start: accepted with no page.
        assert_eq!(g.match_slots(8, lookup(&[1, 2, 3, 4, 5, 6, 0, 8])), (vec![0; 6], 0));
        // Everything missing: boundary 6 still resumes (a chunk start needs nothing).
        assert_eq!(g.match_slots(7, lookup(&[0; 7])), (vec![0; 6], 0));
        // Inside the first chunk a miss walks the boundary down to 0.
        assert_eq!(g.match_slots(2, lookup(&[0, 5])), (vec![], 0));
    }

    #[test]
    fn reclaim_releases_the_slots_of_finished_chunks() {
        let g = chunked(4, 12);
        let table = Table::from_claim(vec![1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(g.reclaim_bound(&table, 11), 0); // token 11 is in chunk 0
        assert_eq!(g.reclaim_bound(&table, 12), 3); // token 12 starts chunk 1
        assert_eq!(g.reclaim_bound(&table, 23), 3);
        assert_eq!(g.reclaim_bound(&table, 24), 6);
        assert_eq!(g.reclaim_bound(&table, 1000), 7); // never past the table
        assert_eq!(g.reclaim_due(&table), Some(12));
    }
}
