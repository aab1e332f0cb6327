//! Flat per-group block tables (SPEC 8): one `rows x cols` int32 table per group for a batch
//! of requests, returned or written into caller buffers. Holes are 0, padding is -1.

use crate::engine::ids::RequestIdRef;
use crate::engine::table::Table;
use crate::engine::FlatCache;
use crate::error::{CoreError, CoreResult};

/// One group's flat block table for a batch: `rows x cols` int32, row-major; holes are 0 and
/// padding past a row's end is -1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatTable {
    /// Number of rows (requests in the batch).
    pub rows: usize,
    /// Number of columns (the longest table of the batch in this group).
    pub cols: usize,
    /// `rows * cols` page ids.
    pub data: Vec<i32>,
}

/// A caller-provided output table of one group: `rows x cols` int32 in row-major (C) order.
/// Rows past the batch are left untouched.
#[derive(Debug)]
pub struct TableOut<'a> {
    /// The buffer, `rows * cols` values.
    pub data: &'a mut [i32],
    /// Rows of the buffer (at least the batch size).
    pub rows: usize,
    /// Columns of the buffer (at least the widest table of the batch in this group).
    pub cols: usize,
}

/// A page id as `i32`: pools hold at most `i32::MAX` pages, so every id fits.
#[inline]
#[allow(clippy::cast_possible_wrap, reason = "page ids are < MAX_BLOCKS = i32::MAX")]
fn page_i32(page: u32) -> i32 {
    page as i32
}

/// Write one table as a flat row (`row.len() >= table.len()`): the page ids (holes 0), then
/// -1 padding. `base` is the group's first pool id (`BlockPool::group_base`; 0 without an
/// arena): a pool id `p > 0` is page `p - base` of the group's view, and 0 stays 0.
#[inline]
fn write_row(row: &mut [i32], table: &Table, base: u32) {
    let pages = table.pages();
    let (head, tail) = row.split_at_mut(pages.len());
    for (dst, &p) in head.iter_mut().zip(pages) {
        *dst = page_i32(p.saturating_sub(base));
    }
    tail.fill(-1);
}

impl FlatCache {
    /// Flat block tables of the page-level requests `reqs`, one per group in group order:
    /// `[len(reqs), max_cols]`, holes 0, padding -1, rows in the order given (repeats
    /// allowed). Unavailable without the `flat` feature.
    pub fn block_tables(&self, reqs: &[RequestIdRef<'_>]) -> CoreResult<Vec<FlatTable>> {
        if !crate::FLAT_KVCACHE {
            return Err(CoreError::FlatUnavailable);
        }
        let rows: Vec<&[Table]> = reqs.iter().map(|&r| self.tables(r)).collect::<CoreResult<_>>()?;
        self.flat_tables(&rows, "reqs")
    }

    /// [`Self::block_tables`] of the requests in `slots` (a slot that holds no request is
    /// `UnknownSlot`).
    pub fn block_tables_in(&self, slots: &[u64]) -> CoreResult<Vec<FlatTable>> {
        if !crate::FLAT_KVCACHE {
            return Err(CoreError::FlatUnavailable);
        }
        let rows = self.slot_tables(slots)?;
        self.flat_tables(&rows, "slots")
    }

    /// The tables of the requests in `slots`, in order.
    fn slot_tables(&self, slots: &[u64]) -> CoreResult<Vec<&[Table]>> {
        slots
            .iter()
            .map(|&s| {
                self.held("block_tables", s)
                    .map(|at| self.entries[at].tables.as_slice())
            })
            .collect()
    }

    /// One flat table per group of `rows` (`what` names the batch in an overflow error).
    fn flat_tables(&self, rows: &[&[Table]], what: &str) -> CoreResult<Vec<FlatTable>> {
        let mut out = Vec::with_capacity(self.coord.num_groups());
        for g in 0..self.coord.num_groups() {
            let cols = rows.iter().map(|ts| ts[g].len()).max().unwrap_or(0);
            let size = rows.len().checked_mul(cols).ok_or_else(|| CoreError::overflow(what))?;
            let mut data = Vec::new();
            data.try_reserve_exact(size)
                .map_err(|_| CoreError::OutOfMemory(format!("block_tables: {} x {cols} int32", rows.len())))?;
            for ts in rows {
                let start = data.len();
                data.resize(start + cols, 0);
                write_row(&mut data[start..], &ts[g], self.coord.pool().group_base(g));
            }
            out.push(FlatTable {
                rows: rows.len(),
                cols,
                data,
            });
        }
        Ok(out)
    }

    /// Write the flat block tables of the page-level requests `reqs` into caller buffers, one
    /// per group in group order: row `r` of group `g` gets request `reqs[r]`'s page ids (holes
    /// 0) then -1 up to the buffer's columns; rows past the batch are untouched. Everything is
    /// checked before anything is written: an unknown request, a buffer with too few rows, or
    /// a table wider than its buffer (an error naming the group) leaves every buffer as it was.
    pub fn write_block_tables(&self, reqs: &[RequestIdRef<'_>], outs: &mut [TableOut<'_>]) -> CoreResult<()> {
        if !crate::FLAT_KVCACHE {
            return Err(CoreError::FlatUnavailable);
        }
        self.check_outs(outs)?;
        let rows: Vec<&[Table]> = reqs.iter().map(|&r| self.tables(r)).collect::<CoreResult<_>>()?;
        write_tables(self, &rows, outs, |r| format!("request {}", reqs[r]))
    }

    /// [`Self::write_block_tables`] for the requests in `slots`.
    pub fn write_block_tables_in(&self, slots: &[u64], outs: &mut [TableOut<'_>]) -> CoreResult<()> {
        if !crate::FLAT_KVCACHE {
            return Err(CoreError::FlatUnavailable);
        }
        self.check_outs(outs)?;
        let rows = self.slot_tables(slots)?;
        // Every slot is held (checked above), so it fits usize.
        write_tables(self, &rows, outs, |r| {
            self.named(usize::try_from(slots[r]).unwrap_or(usize::MAX))
        })
    }

    /// One output buffer per group.
    fn check_outs(&self, outs: &[TableOut<'_>]) -> CoreResult<()> {
        let groups = self.coord.num_groups();
        if outs.len() == groups {
            return Ok(());
        }
        Err(CoreError::invalid(format!(
            "block_tables: out has {} tables but the cache has {groups} groups",
            outs.len()
        )))
    }
}

/// Write `rows` (one request's tables each) into `outs` after checking every buffer; `name`
/// names request `r` in an error.
fn write_tables(
    cache: &FlatCache,
    rows: &[&[Table]],
    outs: &mut [TableOut<'_>],
    name: impl Fn(usize) -> String,
) -> CoreResult<()> {
    let specs = cache.coord.specs();
    for (g, out) in outs.iter().enumerate() {
        // Quoted the Python way, as the caller indexes the mapping: out['full'] (built only
        // for a message).
        let gid = || format!("'{}'", specs[g].group_id.escape_debug());
        if out.rows.checked_mul(out.cols) != Some(out.data.len()) {
            return Err(CoreError::invalid(format!(
                "block_tables: out[{}] holds {} values, not {} x {}",
                gid(),
                out.data.len(),
                out.rows,
                out.cols
            )));
        }
        if out.rows < rows.len() {
            return Err(CoreError::invalid(format!(
                "block_tables: out[{}] has {} rows, fewer than the {} requests",
                gid(),
                out.rows,
                rows.len()
            )));
        }
        if let Some((r, ts)) = rows.iter().enumerate().find(|(_, ts)| ts[g].len() > out.cols) {
            return Err(CoreError::invalid(format!(
                "block_tables: out[{}] has {} columns but {} has {} pages in that group",
                gid(),
                out.cols,
                name(r),
                ts[g].len()
            )));
        }
    }
    for (g, out) in outs.iter_mut().enumerate() {
        let cols = out.cols;
        if cols == 0 {
            continue;
        }
        let base = cache.coord.pool().group_base(g);
        for (row, ts) in out.data.chunks_exact_mut(cols).zip(rows) {
            write_row(row, &ts[g], base);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::testing::*;

    #[test]
    fn block_tables_pad_with_minus_one_and_keep_holes() {
        let mut c = hybrid(64);
        assert!(c.acquire(A, 20).unwrap());
        assert!(c.acquire(B, 4).unwrap());
        c.reclaim(A, 20).unwrap(); // (20 - 7) // 4 = 3 slid out
        if !crate::FLAT_KVCACHE {
            assert!(matches!(c.block_tables(&[B, A]), Err(CoreError::FlatUnavailable)));
            return;
        }
        let t = c.block_tables(&[B, A]).unwrap();
        assert_eq!((t[1].rows, t[1].cols), (2, 5));
        let a = c.page_ids(A).unwrap();
        let b = c.page_ids(B).unwrap();
        let mut row_b: Vec<i32> = b[1].iter().map(|&p| page_i32(p)).collect();
        row_b.resize(5, -1);
        let row_a: Vec<i32> = a[1].iter().map(|&p| page_i32(p)).collect();
        assert_eq!(&t[1].data[..5], &row_b[..]);
        assert_eq!(&t[1].data[5..], &row_a[..]);
        assert_eq!(&row_a[..3], &[0, 0, 0]);
        assert!(c.block_tables(&[]).unwrap().iter().all(|t| t.rows == 0 && t.cols == 0));
    }

    #[test]
    fn write_block_tables_checks_everything_before_writing() {
        let mut c = hybrid(64);
        let sa = add(&mut c, A, toks(0..20)).0;
        assert!(sched(&mut c, sa, 20, 0).unwrap());
        let sb = add(&mut c, B, toks(0..4)).0;
        assert!(sched(&mut c, sb, 4, 0).unwrap());
        append(&mut c, sa, &[20]).unwrap();
        assert!(sched(&mut c, sa, 1, 0).unwrap()); // swa slots 0..3 slid out
        let (mut g0, mut g1) = (vec![7; 3 * 6], vec![7; 3 * 6]);
        if !crate::FLAT_KVCACHE {
            let mut outs = [TableOut {
                data: &mut g0,
                rows: 3,
                cols: 6,
            }];
            let err = c.write_block_tables(&[B, A], &mut outs).unwrap_err();
            assert_eq!(err, CoreError::FlatUnavailable);
            assert_eq!(err.to_string(), crate::error::FLAT_UNAVAILABLE);
            return;
        }
        {
            let mut outs = [
                TableOut {
                    data: &mut g0,
                    rows: 3,
                    cols: 6,
                },
                TableOut {
                    data: &mut g1,
                    rows: 3,
                    cols: 6,
                },
            ];
            c.write_block_tables(&[B, A], &mut outs).unwrap();
        }
        let ids = c.page_ids(A).unwrap();
        let row = |pages: &[u32]| {
            let mut r: Vec<i32> = pages.iter().map(|&p| i32::try_from(p).unwrap()).collect();
            r.resize(6, -1);
            r
        };
        assert_eq!(&g0[6..12], &row(&ids[0])[..]);
        assert_eq!(&g1[6..12], &row(&ids[1])[..]);
        assert_eq!(&g1[6..9], &[0, 0, 0]);
        assert_eq!(&g0[12..], &[7; 6], "rows past the batch are untouched");
        // Too narrow for a's 6 pages in group 0 / too few rows: nothing is written.
        let (mut n0, mut n1) = (vec![7; 2 * 5], vec![7; 2 * 6]);
        let mut outs = [
            TableOut {
                data: &mut n0,
                rows: 2,
                cols: 5,
            },
            TableOut {
                data: &mut n1,
                rows: 2,
                cols: 6,
            },
        ];
        let err = c.write_block_tables(&[B, A], &mut outs).unwrap_err();
        assert!(err.to_string().contains("out['full']"), "{err}");
        assert!(c.write_block_tables(&[B, A, A], &mut outs).is_err());
        assert!(n0.iter().chain(&n1).all(|&v| v == 7));
    }

    /// Two groups' output buffers of `rows x cols`.
    fn outs<'a>(g0: &'a mut [i32], g1: &'a mut [i32], rows: usize, cols: usize) -> [TableOut<'a>; 2] {
        [TableOut { data: g0, rows, cols }, TableOut { data: g1, rows, cols }]
    }

    #[test]
    fn block_tables_by_slot_are_those_by_id_and_errors_name_the_slot() {
        let mut c = hybrid(64);
        let sa = add(&mut c, A, toks(0..20)).0;
        let sb = add(&mut c, B, toks(100..104)).0;
        assert_eq!(c.schedule(&[sa, sb], &[20, 4], 0).unwrap(), vec![true, true]);
        let buffers = |rows: usize, cols: usize| (vec![7; rows * cols], vec![7; rows * cols]);
        if !crate::FLAT_KVCACHE {
            assert_eq!(c.block_tables_in(&[sa]), Err(CoreError::FlatUnavailable));
            let (mut g0, mut g1) = buffers(1, 5);
            let err = c.write_block_tables_in(&[sa], &mut outs(&mut g0, &mut g1, 1, 5));
            assert_eq!(err, Err(CoreError::FlatUnavailable));
            return;
        }
        // Repeats and order as given.
        assert_eq!(
            c.block_tables_in(&[sb, sa, sb]).unwrap(),
            c.block_tables(&[B, A, B]).unwrap()
        );
        assert!(c
            .block_tables_in(&[])
            .unwrap()
            .iter()
            .all(|t| t.rows == 0 && t.cols == 0));
        let (mut by_slot0, mut by_slot1) = buffers(3, 6);
        let (mut by_id0, mut by_id1) = buffers(3, 6);
        c.write_block_tables_in(&[sb, sa], &mut outs(&mut by_slot0, &mut by_slot1, 3, 6))
            .unwrap();
        c.write_block_tables(&[B, A], &mut outs(&mut by_id0, &mut by_id1, 3, 6))
            .unwrap();
        assert_eq!((&by_slot0, &by_slot1), (&by_id0, &by_id1));
        assert_eq!(&by_slot0[12..], &[7; 6], "rows past the batch are untouched");
        // Too narrow for a's 5 pages: the error names the request by id and slot; an unknown
        // slot is refused; nothing is written either way.
        let (mut n0, mut n1) = buffers(2, 4);
        let err = c
            .write_block_tables_in(&[sb, sa], &mut outs(&mut n0, &mut n1, 2, 4))
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "block_tables: out['full'] has 4 columns but request 'a' (slot 0) has 5 pages in that group"
        );
        let err = c
            .write_block_tables_in(&[sb, 2], &mut outs(&mut n0, &mut n1, 2, 4))
            .unwrap_err();
        assert_eq!(
            err,
            CoreError::UnknownSlot {
                method: "block_tables".into(),
                slot: 2
            }
        );
        assert!(n0.iter().chain(&n1).all(|&v| v == 7));
        assert!(c
            .write_block_tables_in(&[sb], &mut outs(&mut n0, &mut n1, 2, 4)[..1])
            .is_err());
    }
}
