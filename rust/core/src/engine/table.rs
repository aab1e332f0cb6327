//! Per-request block tables (SPEC 6).
//!
//! A [`Table`] is one request's pages in one group: slot `i` covers tokens `[i*P, (i+1)*P)`,
//! holes (slid-out or never-matched slots) are the null page 0, and tables never shrink. The
//! group rules ([`crate::engine::group`]) grow, reclaim and free them.

/// One request's pages in one group.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Table {
    /// Page per slot; `0` is a hole.
    pub(super) pages: Vec<u32>,
    /// Free token slots in the last page.
    pub(super) tail_avail: u64,
    /// Slots below this are known holes (everything under a previous reclaim bound), so a
    /// reclaim scans only new ground. Nothing ever puts a real page below it again: claims
    /// only fill empty tables and acquires append.
    pub(super) holes_below: usize,
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
