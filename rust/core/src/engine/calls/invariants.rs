//! The global invariant check of an engine (SPEC 7 and 8), for tests and debugging.

use crate::engine::pool::NULL_PAGE;
use crate::engine::FlatCache;
use crate::error::{CoreError, CoreResult};

impl FlatCache {
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
        // Host tier: every transfer in flight holds one reference on its device page (of its
        // group), and each request counts exactly its own loads in flight.
        if let Some(host) = self.coord.host() {
            host.check().map_err(CoreError::Invariant)?;
            let mut loading = vec![0u64; self.entries.len()];
            for (page, group, load_owner) in host.pins() {
                let (p, g) = (page as usize, group as usize);
                if p == 0 || p >= n || g >= specs.len() {
                    return Err(CoreError::Invariant(format!(
                        "a transfer pins page {page} of group {group}, out of range"
                    )));
                }
                if owner[p] != 0 && owner[p] != g + 1 {
                    return Err(CoreError::Invariant(format!(
                        "page {page} is pinned by a transfer of group {:?} but held by group {:?}",
                        specs[g].group_id,
                        specs[owner[p] - 1].group_id
                    )));
                }
                owner[p] = g + 1;
                refs[p] += 1;
                if let Some((at, serial)) = load_owner {
                    if self.entries.get(at).is_some_and(|e| e.live && e.serial == serial) {
                        loading[at] += 1;
                    }
                }
            }
            for (at, entry) in self.entries.iter().enumerate().filter(|(_, e)| e.live) {
                if entry.loading != loading[at] {
                    return Err(CoreError::Invariant(format!(
                        "a request counts {} loads in flight but {} are",
                        entry.loading, loading[at]
                    )));
                }
            }
        }
        for (p, &expected) in refs.iter().enumerate().skip(1) {
            let page = u32::try_from(p).unwrap_or(u32::MAX);
            let count = pool.refs_of(page);
            if u64::from(count) != expected {
                return Err(CoreError::Invariant(format!(
                    "page {page} has count {count} but {expected} table and transfer reference(s)"
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
    use crate::engine::ids::RequestIdRef;
    use crate::engine::table::Table;
    use crate::engine::testing::*;

    #[test]
    fn check_invariants_reports_a_corrupted_table() {
        let mut c = hybrid(16);
        assert!(c.acquire(A, 4).unwrap());
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
}
