//! Persistent block-table rows (docs/requests-api.md "Persistent rows"): row `s` of the
//! caller's buffers (one `max_rows x cols` int32 table per group) shows the request in slot
//! `s`, and [`FlatCache::update_rows`] writes only the cells that changed since the last update,
//! returning them per group as `(row, col, value)` triples so an engine can apply the same
//! delta to its device copy.
//!
//! A row shows its request's table the way [`FlatCache::block_tables`] does (holes 0, padding
//! -1). A *windowed* group's row shows `cols` slots of the table from a per-row page offset
//! (the slot of column 0, written to an offsets buffer), the layout of
//! `CaptureBuffers(sliding_offsets=True)`: every real page lies at or after the offset and the
//! table ends within the row (for a sliding group, `cols >= ceil((W + tokens per step) / P) +
//! 1` guarantees one exists once slid-out pages are reclaimed). The offset stays while it
//! fits and then moves to the first real page, so rows wider than that minimum are rewritten
//! once every few pages instead of at every page.
//!
//! Cost: the scheduler calls mark a bound request's row dirty only when its tables changed
//! (pages appended, pages slid out, the request finished), so an update visits only those
//! rows, and each visit writes only new cells: new pages, new holes, a cleared row; a
//! windowed row is rewritten when its offset moves (once per page). Nothing is proportional to
//! context length or to the number of bound rows.
//!
//! What a row's cells hold is recorded per row and group as a `Mark` (`len`, `holes_below`,
//! `offset`), so the next update knows which cells can differ; a row bound anew is compared
//! cell by cell. Rows are bound on token-level caches only, whose tables change only through
//! `schedule` (appends and slid-out holes) and release.

use crate::engine::calls::tables::TableOut;
use crate::engine::table::Table;
use crate::engine::FlatCache;
use crate::error::{CoreError, CoreResult};

/// The cell value of padding past a row's end.
const PAD: i32 = -1;

/// How one group's rows are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowLayout {
    /// Columns of the group's buffer.
    pub cols: usize,
    /// Whether the row holds only `cols` slots of the table, from a per-row offset.
    pub windowed: bool,
}

/// The cells one update changed in one group, as three parallel arrays.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RowDelta {
    /// Row of each changed cell.
    pub rows: Vec<i32>,
    /// Column of each changed cell.
    pub cols: Vec<i32>,
    /// New value of each changed cell.
    pub values: Vec<i32>,
    /// Rows whose page offset changed (windowed groups only).
    pub offset_rows: Vec<i32>,
    /// New page offset of each of those rows.
    pub offsets: Vec<i32>,
}

impl RowDelta {
    /// Number of changed cells.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether no cell changed.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    fn clear(&mut self) {
        self.rows.clear();
        self.cols.clear();
        self.values.clear();
        self.offset_rows.clear();
        self.offsets.clear();
    }

    #[inline]
    fn push(&mut self, row: i32, col: usize, value: i32) {
        self.rows.push(row);
        // Columns are < cols <= i32::MAX (checked when binding).
        self.cols.push(i32::try_from(col).unwrap_or(i32::MAX));
        self.values.push(value);
    }
}

/// What one row's cells in one group show: slots `[offset, len)` of a table whose slots below
/// `holes_below` are holes (everything else in the row is padding).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Mark {
    len: usize,
    holes_below: usize,
    offset: usize,
}

/// One row of the binding (its request, if any, is the one in the same slot).
#[derive(Clone, Copy, Debug, Default)]
struct RowState {
    /// On the dirty list.
    dirty: bool,
    /// Compare every cell on the next update (bound anew, or a full update asked for).
    full: bool,
}

/// The rows of a cache's bound buffers and what their cells hold.
#[derive(Clone, Debug)]
pub(in crate::engine) struct RowBinding {
    layouts: Vec<RowLayout>,
    rows: Vec<RowState>,
    /// `rows x groups`, row-major.
    marks: Vec<Mark>,
    /// Rows to visit on the next update.
    dirty: Vec<usize>,
    /// The last update's changes, per group.
    deltas: Vec<RowDelta>,
}

impl RowBinding {
    /// Mark `row` for the next update (`full`: compare every cell).
    #[inline]
    pub(in crate::engine) fn touch(&mut self, row: usize, full: bool) {
        let state = &mut self.rows[row];
        state.full |= full;
        if !state.dirty {
            state.dirty = true;
            self.dirty.push(row);
        }
    }

    /// Number of rows.
    pub(in crate::engine) fn max_rows(&self) -> usize {
        self.rows.len()
    }

    /// A new request took slot `row`: compare the whole row on the next update (it may still
    /// show the previous request's pages).
    pub(in crate::engine) fn claim(&mut self, row: usize) {
        if row < self.rows.len() {
            self.touch(row, true);
        }
    }

    /// The row's request is gone: its cells go back to padding on the next update.
    pub(in crate::engine) fn vacate(&mut self, row: usize) {
        if row < self.rows.len() {
            self.touch(row, false);
        }
    }
}

/// The first slot of `table` holding a real page (its length if none); slots below the hole
/// bound are holes, so the scan starts there (and usually stops at once).
#[inline]
fn first_real(table: &Table) -> usize {
    let start = table.holes_below().min(table.len());
    table.pages()[start..]
        .iter()
        .position(|&p| p != 0)
        .map_or(table.len(), |i| start + i)
}

/// The slot a row of `layout` shows in column 0 for `table`, given the slot `shown` it shows
/// now. A windowed row keeps its offset while every real page is at or after it and the table
/// ends within the row; otherwise it shows the table from slot 0 if that fits, else from its
/// first real page (as far right as the pages allow), so a row `k` slots wider than the live
/// pages moves once every `k + 1` pages. `None` when no offset fits (the real pages span more
/// than the row). Not windowed: 0 (widths are checked elsewhere).
#[inline]
fn choose_offset(layout: RowLayout, table: &Table, shown: usize) -> Option<usize> {
    if !layout.windowed {
        return Some(0);
    }
    let len = table.len();
    let first = first_real(table);
    // o <= first <= len, so len - o cannot underflow.
    let fits = |o: usize| o <= first && len - o <= layout.cols;
    [shown, 0, first].into_iter().find(|&o| fits(o))
}

/// A page id (or hole) as a cell value: pools hold at most `i32::MAX` pages.
#[inline]
fn cell(page: u32) -> i32 {
    i32::try_from(page).unwrap_or(i32::MAX)
}

/// Write `value` into `buf[col]` and record it, if the cell holds something else.
#[inline]
fn put(buf: &mut [i32], delta: &mut RowDelta, row: i32, col: usize, value: i32) {
    put_one(&mut buf[col], delta, row, col, value);
}

/// Write `value` into the cell `dst` (column `col`) and record it, if it holds something else.
#[inline]
fn put_one(dst: &mut i32, delta: &mut RowDelta, row: i32, col: usize, value: i32) {
    if *dst != value {
        *dst = value;
        delta.push(row, col, value);
    }
}

/// One row of one group's buffer, and where its changes are recorded.
struct Cell<'a> {
    row: i32,
    /// The group's first pool id (see `tables::write_row`).
    base: u32,
    buf: &'a mut [i32],
    delta: &'a mut RowDelta,
}

/// Bring one row of one group up to date with `table` (`None`: the row is vacant) and move
/// its mark; returns the row's page offset. Only the cells the mark says can differ are
/// visited (all of them with `full`).
fn write_row(at: Cell<'_>, layout: RowLayout, table: Option<&Table>, mark: &mut Mark, full: bool) -> usize {
    let Cell { row, base, buf, delta } = at;
    let cell = |page: u32| cell(page.saturating_sub(base));
    let (len, holes_below) = table.map_or((0, 0), |t| (t.len(), t.holes_below()));
    // Checked by `check_rows` before anything is written.
    let offset = table.and_then(|t| choose_offset(layout, t, mark.offset)).unwrap_or(0);
    let whole = full || table.is_none() || offset != mark.offset || len < mark.len || holes_below < mark.holes_below;
    if whole {
        // Cells that can differ: what the row showed and what it will show.
        let span = if full {
            layout.cols
        } else {
            (mark.len - mark.offset).max(len - offset).min(layout.cols)
        };
        // The slots the row shows, then padding; one pass over the buffer's cells.
        let shown: &[u32] = table.map_or(&[], |t| &t.pages()[offset.min(t.len())..]);
        let (head, tail) = buf[..span].split_at_mut(shown.len().min(span));
        // (The delta's vectors keep their capacity from update to update.)
        for (col, (dst, &page)) in head.iter_mut().zip(shown).enumerate() {
            put_one(dst, delta, row, col, cell(page));
        }
        let first_pad = head.len();
        for (col, dst) in tail.iter_mut().enumerate() {
            put_one(dst, delta, row, first_pad + col, PAD);
        }
    } else if let Some(t) = table {
        // New holes among the slots already shown, the slot that was last (a state group's
        // working page moves on from it, leaving a hole), then new slots.
        for slot in mark.holes_below.max(offset)..holes_below.min(mark.len) {
            put(buf, delta, row, slot - offset, 0);
        }
        if let Some(last) = mark.len.checked_sub(1).filter(|&s| s >= offset) {
            put(buf, delta, row, last - offset, cell(t.pages()[last]));
        }
        for (slot, &page) in t.pages().iter().enumerate().skip(mark.len) {
            put(buf, delta, row, slot - offset, cell(page));
        }
    }
    *mark = Mark {
        len,
        holes_below,
        offset,
    };
    offset
}

impl FlatCache {
    /// Bind persistent rows: `max_rows` rows with one layout per group (in group order). Every
    /// request that holds a row keeps it; all rows are compared cell by cell on the next
    /// update (the caller's new buffers are assumed to hold padding, -1, everywhere). Fails
    /// if a request holds a row at or past `max_rows`, if a count does not fit `i32`, or if the
    /// number of layouts is not the number of groups.
    pub fn bind_rows(&mut self, max_rows: usize, layouts: Vec<RowLayout>) -> CoreResult<()> {
        if !crate::FLAT_KVCACHE {
            return Err(CoreError::FlatUnavailable);
        }
        let groups = self.coord.num_groups();
        if layouts.len() != groups {
            return Err(CoreError::invalid(format!(
                "bind_rows: {} tables given but the cache has {groups} groups",
                layouts.len()
            )));
        }
        if i32::try_from(max_rows).is_err() {
            return Err(CoreError::invalid(format!(
                "bind_rows: {max_rows} rows do not fit int32 row indices"
            )));
        }
        let specs = self.coord.specs();
        for (layout, spec) in layouts.iter().zip(specs) {
            if i32::try_from(layout.cols).is_err() {
                return Err(CoreError::invalid(format!(
                    "bind_rows: tables['{}'] has {} columns, more than int32 column indices hold",
                    spec.group_id.escape_debug(),
                    layout.cols
                )));
            }
        }
        if let Some(at) = self.live_slots().find(|&at| at >= max_rows) {
            return Err(CoreError::invalid(format!(
                "bind_rows: request {} holds slot {at}, but the new tables have {max_rows} rows",
                self.id_ref_at(at)
            )));
        }
        let size = max_rows
            .checked_mul(groups)
            .ok_or_else(|| CoreError::overflow("max_rows"))?;
        let mut marks = Vec::new();
        marks
            .try_reserve_exact(size)
            .map_err(|_| CoreError::OutOfMemory(format!("bind_rows: {max_rows} rows")))?;
        marks.resize(size, Mark::default());
        let mut binding = RowBinding {
            layouts,
            rows: vec![RowState::default(); max_rows],
            marks,
            dirty: Vec::new(),
            deltas: vec![RowDelta::default(); groups],
        };
        let live: Vec<usize> = self.live_slots().collect();
        for at in live {
            binding.touch(at, true);
        }
        self.rows = Some(binding);
        Ok(())
    }

    /// Drop the row binding; requests keep their slots.
    pub fn unbind_rows(&mut self) {
        self.rows = None;
    }

    /// The slots that hold a live request, lowest first.
    fn live_slots(&self) -> impl Iterator<Item = usize> + '_ {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.live)
            .map(|(at, _)| at)
    }

    /// Check that a new request can take the next slot: with rows bound, it must be a row.
    pub(in crate::engine) fn check_slot_free(&self, method: &str) -> CoreResult<()> {
        if self.slot_available() {
            return Ok(());
        }
        let max_rows = self.rows.as_ref().map_or(0, RowBinding::max_rows);
        Err(CoreError::invalid(format!(
            "{method}: all {max_rows} slots of the bound rows are held (finish a request or bind more rows)"
        )))
    }

    /// Whether a new request can take the next slot (with rows bound: a slot below
    /// `max_rows`).
    pub(in crate::engine) fn slot_available(&self) -> bool {
        self.rows.as_ref().is_none_or(|b| self.next_slot() < b.max_rows())
    }

    /// The tables of the request in slot `at` changed: visit its row on the next update.
    #[inline]
    pub(in crate::engine) fn touch_row(&mut self, at: usize) {
        if let Some(binding) = self.rows.as_mut() {
            binding.touch(at, false);
        }
    }

    /// Whether an update (not `full`) would visit any row: false when no bound request's
    /// tables changed since the last update.
    pub fn rows_pending(&self) -> bool {
        self.rows.as_ref().is_some_and(|b| !b.dirty.is_empty())
    }

    /// The changes of the last [`Self::update_rows`], per group (empty before any update).
    pub fn row_deltas(&self) -> &[RowDelta] {
        self.rows.as_ref().map_or(&[], |b| b.deltas.as_slice())
    }

    /// Bring the bound buffers up to date: write every cell that changed since the last update
    /// into `outs` (one per group, `max_rows x cols` as bound), each windowed group's row
    /// offsets into `offsets[g]` (`max_rows` values; `None` for other groups), and keep the
    /// changes for [`Self::row_deltas`], sorted by row then column. With `full`, every row is
    /// compared cell by cell (a repair after the buffers were changed by someone else).
    ///
    /// Everything is checked before anything is written: buffers of the wrong shape, or a
    /// table wider than its row (a windowed row: a real page before the row's first slot),
    /// is an error naming the group, row and request, and leaves the buffers and the pending
    /// changes as they were.
    pub fn update_rows(
        &mut self,
        outs: &mut [TableOut<'_>],
        offsets: &mut [Option<&mut [i32]>],
        full: bool,
    ) -> CoreResult<()> {
        if !crate::FLAT_KVCACHE {
            return Err(CoreError::FlatUnavailable);
        }
        let Some(mut binding) = self.rows.take() else {
            return Err(CoreError::invalid(
                "update_rows: no rows are bound (call bind_rows first)",
            ));
        };
        let result = self.update_bound(&mut binding, outs, offsets, full);
        self.rows = Some(binding);
        result
    }

    /// Check that every owned row among `rows` fits its buffers: a table no wider than its
    /// row, a windowed row with no real page before its first slot.
    fn check_rows(&self, b: &RowBinding, rows: impl Iterator<Item = usize>) -> CoreResult<()> {
        let specs = self.coord.specs();
        for row in rows {
            let at = row;
            let Some(entry) = self.entries.get(at).filter(|e| e.live) else {
                continue;
            };
            let tables = &entry.tables;
            let groups = tables.len();
            for (g, (table, &layout)) in tables.iter().zip(&b.layouts).enumerate() {
                if layout.windowed {
                    let shown = b.marks[row * groups + g].offset;
                    if choose_offset(layout, table, shown).is_none() {
                        let (first, last) = (first_real(table), table.len() - layout.cols);
                        return Err(CoreError::invalid(format!(
                            "update_rows: row {row} (request {}) of windowed group '{}' shows slots from {last}, \
                             but slot {first} still holds page {} (reclaim slid-out pages first, or bind wider rows)",
                            self.id_ref_at(at),
                            specs[g].group_id.escape_debug(),
                            table.pages()[first]
                        )));
                    }
                } else if table.len() > layout.cols {
                    return Err(CoreError::invalid(format!(
                        "update_rows: tables['{}'] has {} columns but request {} (row {row}) has {} pages in that group",
                        specs[g].group_id.escape_debug(),
                        layout.cols,
                        self.id_ref_at(at),
                        table.len()
                    )));
                }
            }
        }
        Ok(())
    }

    fn update_bound(
        &self,
        b: &mut RowBinding,
        outs: &mut [TableOut<'_>],
        offsets: &mut [Option<&mut [i32]>],
        full: bool,
    ) -> CoreResult<()> {
        let specs = self.coord.specs();
        let groups = specs.len();
        let max_rows = b.rows.len();
        if outs.len() != groups || offsets.len() != groups {
            return Err(CoreError::invalid(format!(
                "update_rows: {} tables and {} offset buffers given but the cache has {groups} groups",
                outs.len(),
                offsets.len()
            )));
        }
        for (g, ((out, off), layout)) in outs.iter().zip(offsets.iter()).zip(&b.layouts).enumerate() {
            let gid = specs[g].group_id.escape_debug();
            if out.rows != max_rows || out.cols != layout.cols || out.data.len() != max_rows * layout.cols {
                return Err(CoreError::invalid(format!(
                    "update_rows: tables['{gid}'] is {} x {}, not the bound {max_rows} x {}",
                    out.rows, out.cols, layout.cols
                )));
            }
            match off {
                Some(o) if !layout.windowed || o.len() != max_rows => {
                    return Err(CoreError::invalid(format!(
                        "update_rows: offsets['{gid}'] does not match the binding"
                    )))
                }
                None if layout.windowed => {
                    return Err(CoreError::invalid(format!(
                        "update_rows: windowed group '{gid}' needs its offsets buffer"
                    )))
                }
                _ => {}
            }
        }
        b.dirty.sort_unstable();
        // Check every row to be visited before writing anything (a full update touches every
        // row only once the check passed, so a refused one leaves no full comparison behind).
        if full {
            self.check_rows(b, 0..max_rows)?;
            for row in 0..max_rows {
                b.touch(row, true);
            }
            b.dirty.sort_unstable();
        } else {
            self.check_rows(b, b.dirty.iter().copied())?;
        }
        for d in &mut b.deltas {
            d.clear();
        }
        let dirty = std::mem::take(&mut b.dirty);
        for &row in &dirty {
            let state = std::mem::take(&mut b.rows[row]);
            let tables = self.entries.get(row).filter(|e| e.live).map(|e| e.tables.as_slice());
            // Row indices fit i32 (checked when binding).
            let r = i32::try_from(row).unwrap_or(i32::MAX);
            for g in 0..groups {
                let layout = b.layouts[g];
                let cols = layout.cols;
                let at = Cell {
                    row: r,
                    base: self.coord.pool().group_base(g),
                    buf: &mut outs[g].data[row * cols..(row + 1) * cols],
                    delta: &mut b.deltas[g],
                };
                let mark = &mut b.marks[row * groups + g];
                let offset = write_row(at, layout, tables.map(|ts| &ts[g]), mark, state.full);
                if let Some(off) = offsets[g].as_deref_mut() {
                    // Offsets are < len <= i32::MAX pages.
                    let value = i32::try_from(offset).unwrap_or(i32::MAX);
                    if off[row] != value {
                        off[row] = value;
                        let delta = &mut b.deltas[g];
                        delta.offset_rows.push(r);
                        delta.offsets.push(value);
                    }
                }
            }
        }
        b.dirty = dirty;
        b.dirty.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::ids::RequestIdRef;
    use crate::engine::testing::*;

    /// Caller-side state: the bound buffers and a shadow copy kept only through the deltas.
    struct Caller {
        max_rows: usize,
        layouts: Vec<RowLayout>,
        bufs: Vec<Vec<i32>>,
        offs: Vec<Vec<i32>>,
        shadow: Vec<Vec<i32>>,
        shadow_offs: Vec<Vec<i32>>,
    }

    impl Caller {
        fn bind(c: &mut FlatCache, max_rows: usize, layouts: Vec<RowLayout>) -> Self {
            c.bind_rows(max_rows, layouts.clone()).unwrap();
            let bufs: Vec<Vec<i32>> = layouts.iter().map(|l| vec![PAD; max_rows * l.cols]).collect();
            let offs = vec![vec![0; max_rows]; layouts.len()];
            Self {
                max_rows,
                shadow: bufs.clone(),
                shadow_offs: offs.clone(),
                layouts,
                bufs,
                offs,
            }
        }

        fn update(&mut self, c: &mut FlatCache, full: bool) -> CoreResult<usize> {
            let mut outs: Vec<TableOut<'_>> = self
                .bufs
                .iter_mut()
                .zip(&self.layouts)
                .map(|(b, l)| TableOut {
                    data: b.as_mut_slice(),
                    rows: self.max_rows,
                    cols: l.cols,
                })
                .collect();
            let mut offs: Vec<Option<&mut [i32]>> = self
                .offs
                .iter_mut()
                .zip(&self.layouts)
                .map(|(o, l)| l.windowed.then_some(o.as_mut_slice()))
                .collect();
            c.update_rows(&mut outs, &mut offs, full)?;
            let mut cells = 0;
            for (g, d) in c.row_deltas().iter().enumerate() {
                let cols = self.layouts[g].cols;
                let mut last = None;
                for i in 0..d.len() {
                    let key = (d.rows[i], d.cols[i]);
                    assert!(last < Some(key), "deltas sorted by row, then column, no repeats");
                    last = Some(key);
                    let (r, col) = (usize::try_from(d.rows[i]).unwrap(), usize::try_from(d.cols[i]).unwrap());
                    assert_ne!(self.shadow[g][r * cols + col], d.values[i], "a delta changes its cell");
                    self.shadow[g][r * cols + col] = d.values[i];
                }
                for (&r, &o) in d.offset_rows.iter().zip(&d.offsets) {
                    self.shadow_offs[g][usize::try_from(r).unwrap()] = o;
                }
                cells += d.len();
            }
            assert_eq!(self.shadow, self.bufs, "deltas applied to a copy give the buffers");
            assert_eq!(self.shadow_offs, self.offs);
            Ok(cells)
        }

        /// Row `row` of group `g` is what `block_tables` gives for `req`, the request in slot
        /// `row` (or padding).
        fn expect_row(&self, c: &FlatCache, g: usize, row: usize, req: Option<RequestIdRef<'_>>) {
            let l = self.layouts[g];
            if let Some(r) = req {
                assert_eq!(c.slot_of(r), Some(row), "row s shows the request in slot s");
            }
            let table: Vec<i32> = req.map_or_else(Vec::new, |r| c.block_tables(&[r]).unwrap()[g].data.clone());
            let off = if l.windowed {
                usize::try_from(self.offs[g][row]).unwrap()
            } else {
                0
            };
            // A windowed row's offset is any slot with no real page before it and the
            // table's end within the row.
            assert!(
                table[..off.min(table.len())].iter().all(|&p| p == 0),
                "group {g} row {row}"
            );
            assert!(table.len() <= off + l.cols, "group {g} row {row}");
            let mut want: Vec<i32> = table[off.min(table.len())..].to_vec();
            want.resize(l.cols, PAD);
            assert_eq!(
                &self.bufs[g][row * l.cols..(row + 1) * l.cols],
                &want[..],
                "group {g} row {row}"
            );
            if req.is_none() {
                assert_eq!(off, 0, "a vacant row shows offset 0");
            }
        }
    }

    fn plain(cols: usize) -> RowLayout {
        RowLayout { cols, windowed: false }
    }

    #[test]
    fn rows_follow_decode_and_deltas_are_only_the_changes() {
        if !crate::FLAT_KVCACHE {
            let mut c = hybrid(64);
            assert_eq!(
                c.bind_rows(2, vec![plain(4), plain(4)]),
                Err(CoreError::FlatUnavailable)
            );
            return;
        }
        let mut c = hybrid(64);
        // full: P 4; swa: P 4, W 8 -> windowed row of ceil((8 + 1) / 4) + 1 = 4 slots.
        let mut rows = Caller::bind(
            &mut c,
            3,
            vec![
                plain(12),
                RowLayout {
                    cols: 4,
                    windowed: true,
                },
            ],
        );
        // A takes slot (row) 1; row 0 is vacant again once X is finished.
        let x = RequestIdRef::Str("x");
        let sx = add(&mut c, x, toks(500..504)).0;
        let sa = add(&mut c, A, toks(0..10)).0;
        assert_eq!((sx, sa), (0, 1));
        c.finish(&[sx]).unwrap();
        assert_eq!(rows.update(&mut c, false).unwrap(), 0, "nothing allocated yet");
        assert!(sched(&mut c, sa, 10, 0).unwrap());
        assert_eq!(rows.update(&mut c, false).unwrap(), 6, "3 pages in each group");
        rows.expect_row(&c, 0, 1, Some(A));
        rows.expect_row(&c, 1, 1, Some(A));
        let mut pages_per_step = Vec::new();
        for t in 10..40 {
            append(&mut c, sa, &[t]).unwrap();
            assert!(sched(&mut c, sa, 1, 0).unwrap());
            pages_per_step.push(rows.update(&mut c, false).unwrap());
            rows.expect_row(&c, 0, 1, Some(A));
            rows.expect_row(&c, 1, 1, Some(A));
            rows.expect_row(&c, 0, 0, None);
        }
        // P = 4: per 4 steps one new page per group and one page sliding out; the steps
        // between change nothing, a boundary a few cells (a windowed row shifts by one slot).
        assert!(
            pages_per_step.iter().filter(|&&n| n == 0).count() >= 14,
            "{pages_per_step:?}"
        );
        assert!(pages_per_step.iter().all(|&n| n <= 1 + 4 + 1), "{pages_per_step:?}");
        c.finish(&[sa]).unwrap();
        rows.update(&mut c, false).unwrap();
        rows.expect_row(&c, 0, 1, None);
        rows.expect_row(&c, 1, 1, None);
        assert_eq!(rows.offs[1][1], 0);
    }

    #[test]
    fn rows_are_checked_reused_and_repaired() {
        if !crate::FLAT_KVCACHE {
            return;
        }
        let mut c = hybrid(64);
        let mut rows = Caller::bind(&mut c, 2, vec![plain(3), plain(3)]);
        let p = prompt(&c, toks(0..8));
        let sa = add(&mut c, A, toks(0..8)).0;
        let sb = add(&mut c, B, toks(100..108)).0;
        assert_eq!((sa, sb), (0, 1));
        // Both rows are held: a third request is refused and nothing is added.
        let d = RequestIdRef::Str("d");
        let before = c.stats();
        let err = c.add_request(d, p.clone(), true).unwrap_err();
        assert_eq!(
            err,
            CoreError::invalid(
                "add_request: all 2 slots of the bound rows are held (finish a request or bind more rows)"
            )
        );
        assert!(!c.has_request(d), "a refused add adds nothing");
        // admit answers None then, and changes nothing either.
        assert_eq!(c.admit(d, p.clone(), 1, true).unwrap(), None);
        assert!(!c.has_request(d));
        assert_eq!((c.num_requests(), c.stats()), (2, before));
        // A bad request is still refused as such (its id in use), not for want of a row.
        assert!(c
            .admit(A, p.clone(), 1, true)
            .unwrap_err()
            .to_string()
            .contains("already exists"));
        assert!(sched(&mut c, sa, 8, 0).unwrap());
        rows.update(&mut c, false).unwrap();
        // Too wide for 3 columns: an error naming the group and request; nothing written.
        append(&mut c, sa, &toks(8..16)).unwrap();
        assert!(sched(&mut c, sa, 8, 0).unwrap());
        let before = rows.bufs.clone();
        let err = rows.update(&mut c, false).unwrap_err().to_string();
        assert!(err.contains("tables['full']") && err.contains("'a'"), "{err}");
        assert_eq!(rows.bufs, before);
        c.finish(&[sa]).unwrap();
        // The row is free again and reused; the new owner's row is exact.
        let (sd, hit) = c.add_request(d, p, true).unwrap();
        assert_eq!(sd, 0);
        let sd = u64::try_from(sd).unwrap();
        assert!(sched(&mut c, sd, 8 - hit, 0).unwrap());
        rows.update(&mut c, false).unwrap();
        rows.expect_row(&c, 0, 0, Some(d));
        rows.expect_row(&c, 1, 0, Some(d));
        rows.expect_row(&c, 0, 1, Some(B));
        // Someone scribbles on a buffer: a full update repairs it and reports the cells.
        rows.bufs[0][1] = 99;
        rows.shadow[0][1] = 99;
        rows.bufs[1][5] = 98;
        rows.shadow[1][5] = 98;
        assert_eq!(rows.update(&mut c, true).unwrap(), 2);
        rows.expect_row(&c, 0, 0, Some(d));
        rows.expect_row(&c, 1, 1, Some(B));
        // Unbound, slots are not limited by rows any more.
        c.unbind_rows();
        assert_eq!(add(&mut c, C, toks(0..4)).0, 2);
        c.check_invariants().unwrap();
    }

    #[test]
    fn a_row_reused_in_the_same_slot_shows_the_new_request_without_an_update_between() {
        if !crate::FLAT_KVCACHE {
            return;
        }
        let mut c = hybrid(64);
        let mut rows = Caller::bind(
            &mut c,
            2,
            vec![
                plain(8),
                RowLayout {
                    cols: 4,
                    windowed: true,
                },
            ],
        );
        let sa = add(&mut c, A, toks(0..20)).0;
        let sb = add(&mut c, B, toks(100..104)).0;
        // 16 tokens, then 4 more: a's first two sliding slots slide out before its fifth page.
        assert!(sched(&mut c, sa, 16, 0).unwrap());
        assert_eq!(c.schedule(&[sa, sb], &[4, 4], 0).unwrap(), vec![true, true]);
        rows.update(&mut c, false).unwrap();
        rows.expect_row(&c, 0, 0, Some(A));
        rows.expect_row(&c, 1, 0, Some(A));
        assert!(rows.offs[1][0] > 0, "a's windowed row shows its table from an offset");
        // A ends and a new request takes its slot before any update: first with no pages.
        c.finish(&[sa]).unwrap();
        let x = RequestIdRef::Str("x");
        assert_eq!(add(&mut c, x, toks(300..306)), (sa, 0));
        rows.update(&mut c, false).unwrap();
        for g in 0..2 {
            rows.expect_row(&c, g, 0, Some(x));
            rows.expect_row(&c, g, 1, Some(B));
        }
        assert!(rows.bufs[0][..8].iter().all(|&v| v == PAD), "a's pages are gone");
        assert_eq!(rows.offs[1][0], 0);
        // Again with pages: a few of its own, fewer than a's, in both groups.
        assert!(sched(&mut c, sa, 6, 0).unwrap());
        rows.update(&mut c, false).unwrap();
        c.finish(&[sa]).unwrap();
        // The next one shares a's prefix (claimed, cached since a finished), then grows.
        assert_eq!(add(&mut c, A, toks(0..13)), (sa, 12));
        assert!(sched(&mut c, sa, 1, 0).unwrap());
        rows.update(&mut c, false).unwrap();
        for g in 0..2 {
            rows.expect_row(&c, g, 0, Some(A));
            rows.expect_row(&c, g, 1, Some(B));
        }
        // And once more, finished and re-added with a short prompt within one update.
        c.finish(&[sa]).unwrap();
        assert_eq!(add(&mut c, x, toks(700..702)), (sa, 0));
        assert!(sched(&mut c, sa, 2, 0).unwrap());
        rows.update(&mut c, false).unwrap();
        for g in 0..2 {
            rows.expect_row(&c, g, 0, Some(x));
        }
        assert_eq!(
            &rows.bufs[0][..2],
            &[i32::try_from(c.page_ids(x).unwrap()[0][0]).unwrap(), PAD]
        );
        c.check_invariants().unwrap();
    }

    #[test]
    fn bind_rows_refuses_a_request_in_a_slot_past_the_new_rows() {
        if !crate::FLAT_KVCACHE {
            return;
        }
        let mut c = hybrid(64);
        let slots: Vec<u64> = [A, B, C].map(|r| add(&mut c, r, toks(0..4)).0).to_vec();
        assert_eq!(slots, vec![0, 1, 2]);
        let err = c.bind_rows(2, vec![plain(4), plain(4)]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "bind_rows: request 3 holds slot 2, but the new tables have 2 rows"
        );
        // Nothing was bound.
        assert!(!c.rows_pending());
        assert!(c.update_rows(&mut [], &mut [], false).is_err());
        // With slot 2 free, the binding fits; the live requests keep their slots as rows.
        c.finish(&[2]).unwrap();
        let mut rows = Caller::bind(&mut c, 2, vec![plain(4), plain(4)]);
        assert!(c.rows_pending());
        assert!(c.schedule(&[0, 1], &[3, 3], 0).unwrap().iter().all(|&ok| ok));
        rows.update(&mut c, false).unwrap();
        rows.expect_row(&c, 0, 0, Some(A));
        rows.expect_row(&c, 0, 1, Some(B));
        // A refused rebinding keeps the old binding.
        assert!(c.bind_rows(1, vec![plain(4), plain(4)]).is_err());
        c.finish(&[1]).unwrap();
        rows.update(&mut c, false).unwrap();
        rows.expect_row(&c, 0, 1, None);
        rows.expect_row(&c, 0, 0, Some(A));
    }

    #[test]
    fn windowed_row_refuses_a_real_page_before_its_first_slot() {
        if !crate::FLAT_KVCACHE {
            return;
        }
        let mut c = hybrid(64);
        // W = 8, P = 4: 2 columns cannot show a step of 4 tokens plus the window.
        let mut rows = Caller::bind(
            &mut c,
            1,
            vec![
                plain(16),
                RowLayout {
                    cols: 2,
                    windowed: true,
                },
            ],
        );
        let sa = add(&mut c, A, toks(0..12)).0;
        assert!(sched(&mut c, sa, 12, 0).unwrap());
        let err = rows.update(&mut c, false).unwrap_err().to_string();
        assert!(err.contains("windowed group 'swa'") && err.contains("slot 0"), "{err}");
        // Binding wider rows keeps the request's row and rewrites it whole.
        let mut rows = Caller::bind(
            &mut c,
            1,
            vec![
                plain(16),
                RowLayout {
                    cols: 4,
                    windowed: true,
                },
            ],
        );
        rows.update(&mut c, false).unwrap();
        rows.expect_row(&c, 1, 0, Some(A));
        assert_eq!(c.slot_of(A), Some(0));
        let err = c.bind_rows(0, vec![plain(16), plain(4)]).unwrap_err().to_string();
        assert_eq!(
            err,
            "bind_rows: request 'a' holds slot 0, but the new tables have 0 rows"
        );
    }
}
