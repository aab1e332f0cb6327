//! Persistent block-table rows (docs/requests-api.md "Persistent rows"): each token-level
//! request may own one row of caller buffers (one `max_rows x cols` int32 table per group),
//! and [`FlatCache::update_rows`] writes only the cells that changed since the last update,
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
//! cell by cell. Only token-level requests hold rows, and page-level calls refuse them, so
//! their tables change only through `schedule` (appends and slid-out holes) and release.

use super::table::Table;
use super::FlatCache;
use crate::engine::block_tables::TableOut;
use crate::engine::ids::RequestIdRef;
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

/// One row of the binding.
#[derive(Clone, Copy, Debug, Default)]
struct RowState {
    /// Slab position of the request that owns the row.
    owner: Option<usize>,
    /// On the dirty list.
    dirty: bool,
    /// Compare every cell on the next update (bound anew, or a full update asked for).
    full: bool,
}

/// The rows of a cache's bound buffers and what their cells hold.
#[derive(Clone, Debug)]
pub(super) struct RowBinding {
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
    pub(super) fn touch(&mut self, row: usize, full: bool) {
        let state = &mut self.rows[row];
        state.full |= full;
        if !state.dirty {
            state.dirty = true;
            self.dirty.push(row);
        }
    }

    /// The row's owner is gone: its cells go back to padding on the next update.
    pub(super) fn vacate(&mut self, row: usize) {
        self.rows[row].owner = None;
        self.touch(row, false);
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
    buf: &'a mut [i32],
    delta: &'a mut RowDelta,
}

/// Bring one row of one group up to date with `table` (`None`: the row is vacant) and move
/// its mark; returns the row's page offset. Only the cells the mark says can differ are
/// visited (all of them with `full`).
fn write_row(at: Cell<'_>, layout: RowLayout, table: Option<&Table>, mark: &mut Mark, full: bool) -> usize {
    let Cell { row, buf, delta } = at;
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
        // New holes among the slots already shown, then new slots.
        for slot in mark.holes_below.max(offset)..holes_below.min(mark.len) {
            put(buf, delta, row, slot - offset, 0);
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
        let outside = self.bound_entries().filter(|&(_, row)| row >= max_rows);
        if let Some((at, row)) = outside.min_by_key(|&(_, row)| row) {
            return Err(CoreError::invalid(format!(
                "bind_rows: request {} holds row {row}, but the new tables have {max_rows} rows",
                self.id_at(at)
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
        let owned: Vec<(usize, usize)> = self.bound_entries().collect();
        for (at, row) in owned {
            binding.rows[row].owner = Some(at);
            binding.touch(row, true);
        }
        self.rows = Some(binding);
        Ok(())
    }

    /// Drop the row binding; requests keep no rows.
    pub fn unbind_rows(&mut self) {
        self.rows = None;
        for entry in &mut self.entries {
            entry.row = None;
        }
    }

    /// The row `req` holds, if any.
    pub fn row_of(&self, req: RequestIdRef<'_>) -> CoreResult<Option<usize>> {
        Ok(self.entries[self.find(req)?].row)
    }

    /// Live requests holding a row: (slab position, row).
    fn bound_entries(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.entries
            .iter()
            .enumerate()
            .filter_map(|(at, e)| e.row.filter(|_| e.live).map(|row| (at, row)))
    }

    /// The id of the live request at slab position `at` (a scan: for error paths only).
    pub(super) fn id_ref_at(&self, at: usize) -> Option<RequestIdRef<'_>> {
        self.index.iter().find(|&(_, &i)| i == at).map(|(id, _)| id.as_ref())
    }

    /// [`Self::id_ref_at`] as messages show it.
    pub(super) fn id_at(&self, at: usize) -> String {
        self.id_ref_at(at).map_or_else(|| format!("#{at}"), |id| id.to_string())
    }

    /// The slab position of the request holding `row` (an error for `method` if none does).
    pub(super) fn row_owner(&self, method: &str, row: u64) -> CoreResult<usize> {
        let Some(binding) = &self.rows else {
            return Err(CoreError::invalid(format!(
                "{method}: no rows are bound (call bind_rows first)"
            )));
        };
        usize::try_from(row)
            .ok()
            .and_then(|r| binding.rows.get(r))
            .and_then(|state| state.owner)
            .ok_or_else(|| CoreError::invalid(format!("{method}: row {row} holds no request")))
    }

    /// Check that `row` can be given to a new request.
    pub(super) fn check_row_free(&self, row: usize) -> CoreResult<()> {
        let Some(binding) = &self.rows else {
            return Err(CoreError::invalid(
                "row: no rows are bound (call bind_rows first)".to_string(),
            ));
        };
        let Some(state) = binding.rows.get(row) else {
            return Err(CoreError::invalid(format!(
                "row must be < {} (the bound tables' rows), got {row}",
                binding.rows.len()
            )));
        };
        if let Some(at) = state.owner {
            return Err(CoreError::invalid(format!(
                "row {row} is held by request {}",
                self.id_at(at)
            )));
        }
        Ok(())
    }

    /// Give `row` (checked free) to the request at slab position `at`.
    pub(super) fn assign_row(&mut self, at: usize, row: usize) {
        if let Some(binding) = self.rows.as_mut() {
            binding.rows[row].owner = Some(at);
            binding.touch(row, true);
            self.entries[at].row = Some(row);
        }
    }

    /// The tables of the request at `at` changed: visit its row on the next update.
    #[inline]
    pub(super) fn touch_row(&mut self, at: usize) {
        if let (Some(row), Some(binding)) = (self.entries[at].row, self.rows.as_mut()) {
            binding.touch(row, false);
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
            let Some(at) = b.rows[row].owner else { continue };
            let tables = &self.entries[at].tables;
            let groups = tables.len();
            for (g, (table, &layout)) in tables.iter().zip(&b.layouts).enumerate() {
                if layout.windowed {
                    let shown = b.marks[row * groups + g].offset;
                    if choose_offset(layout, table, shown).is_none() {
                        let (first, last) = (first_real(table), table.len() - layout.cols);
                        return Err(CoreError::invalid(format!(
                            "update_rows: row {row} (request {}) of windowed group '{}' shows slots from {last}, \
                             but slot {first} still holds page {} (reclaim slid-out pages first, or bind wider rows)",
                            self.id_at(at),
                            specs[g].group_id.escape_debug(),
                            table.pages()[first]
                        )));
                    }
                } else if table.len() > layout.cols {
                    return Err(CoreError::invalid(format!(
                        "update_rows: tables['{}'] has {} columns but request {} (row {row}) has {} pages in that group",
                        specs[g].group_id.escape_debug(),
                        layout.cols,
                        self.id_at(at),
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
            b.rows[row].owner = state.owner;
            let tables = state.owner.map(|at| self.entries[at].tables.as_slice());
            // Row indices fit i32 (checked when binding).
            let r = i32::try_from(row).unwrap_or(i32::MAX);
            for g in 0..groups {
                let layout = b.layouts[g];
                let cols = layout.cols;
                let at = Cell {
                    row: r,
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

        /// Row `row` of group `g` is what `block_tables` gives for `req` (or padding).
        fn expect_row(&self, c: &FlatCache, g: usize, row: usize, req: Option<RequestIdRef<'_>>) {
            let l = self.layouts[g];
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
        let p = prompt(&c, toks(0..10));
        c.add_request_in_row(A, p, true, 1).unwrap();
        assert_eq!(rows.update(&mut c, false).unwrap(), 0, "nothing allocated yet");
        assert!(c.schedule(A, 10, 0).unwrap());
        assert_eq!(rows.update(&mut c, false).unwrap(), 6, "3 pages in each group");
        rows.expect_row(&c, 0, 1, Some(A));
        rows.expect_row(&c, 1, 1, Some(A));
        let mut pages_per_step = Vec::new();
        for t in 10..40 {
            c.append_tokens(A, &[t]).unwrap();
            assert!(c.schedule(A, 1, 0).unwrap());
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
        c.finish(A).unwrap();
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
        assert!(c.check_row_free(0).unwrap_err().to_string().contains("bind_rows"));
        let mut rows = Caller::bind(&mut c, 2, vec![plain(3), plain(3)]);
        let p = prompt(&c, toks(0..8));
        c.add_request_in_row(A, p.clone(), true, 0).unwrap();
        let err = c.add_request_in_row(B, p.clone(), true, 0).unwrap_err();
        assert!(err.to_string().contains("row 0 is held by request 'a'"), "{err}");
        assert!(!c.has_request(B), "a refused row adds nothing");
        assert!(c
            .add_request_in_row(B, p.clone(), true, 2)
            .unwrap_err()
            .to_string()
            .contains("< 2"));
        assert!(c.schedule(A, 8, 0).unwrap());
        rows.update(&mut c, false).unwrap();
        // Too wide for 3 columns: an error naming the group and request; nothing written.
        c.append_tokens(A, &toks(8..16)).unwrap();
        assert!(c.schedule(A, 8, 0).unwrap());
        let before = rows.bufs.clone();
        let err = rows.update(&mut c, false).unwrap_err().to_string();
        assert!(err.contains("tables['full']") && err.contains("'a'"), "{err}");
        assert_eq!(rows.bufs, before);
        c.finish(A).unwrap();
        // The row is free again and reused; the new owner's row is exact.
        c.add_request_in_row(B, p, true, 0).unwrap();
        assert!(c.schedule(B, 8 - c.num_computed_tokens(B).unwrap(), 0).unwrap());
        rows.update(&mut c, false).unwrap();
        rows.expect_row(&c, 0, 0, Some(B));
        rows.expect_row(&c, 1, 0, Some(B));
        // Someone scribbles on a buffer: a full update repairs it and reports the cells.
        rows.bufs[0][1] = 99;
        rows.shadow[0][1] = 99;
        rows.bufs[1][5] = 98;
        rows.shadow[1][5] = 98;
        assert_eq!(rows.update(&mut c, true).unwrap(), 2);
        rows.expect_row(&c, 0, 0, Some(B));
        rows.expect_row(&c, 1, 1, None);
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
        let p = prompt(&c, toks(0..12));
        c.add_request_in_row(A, p, true, 0).unwrap();
        assert!(c.schedule(A, 12, 0).unwrap());
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
        assert_eq!(c.row_of(A).unwrap(), Some(0));
        let err = c.bind_rows(0, vec![plain(16), plain(4)]).unwrap_err().to_string();
        assert!(err.contains("holds row 0"), "{err}");
    }
}
