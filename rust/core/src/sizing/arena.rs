//! The arena plan (SPEC 13 storage, docs/sizing-api.md "Arena plan"): one arena of equal units,
//! each bound to one group while in use. Page groups address their pages by byte offset (page
//! `p` at byte `p * page_bytes`), so every layer view has one page stride; the state slot (every
//! state layer's state) is one unit. Not allocated from by the engine yet.
//!
//! The checks run in the contract's order on the exact integers; sizes are then computed in
//! checked `u64` (`u128` where a product of two `u64` is divided back down), so a size that does
//! not fit is an `Overflow` naming it.

use crate::error::{CoreError, CoreResult};
use crate::num::checked;
use crate::num::int::{capped_quotient, Int, IntArg};
use crate::sizing::plan::{check_components, Checked, ComponentArg};

/// One group of an arena plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaGroup {
    /// The index of the group's first component (its id is that component's `group_id`).
    pub group_source: usize,
    /// `"pages"` or `"state"`.
    pub kind: &'static str,
    /// A page's bytes, or the state slot's.
    pub item_bytes: u64,
    /// Items per unit.
    pub per_unit: u64,
    /// The size of the group's id space.
    pub num_ids: u64,
    /// `unit_bytes - per_unit * item_bytes`.
    pub slack_bytes: u64,
}

/// Where one component lies inside its page or state slot (components in input order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArenaComponent {
    /// Its offset in bytes.
    pub offset: u64,
    /// Its bytes in one page or slot.
    pub nbytes: u64,
}

/// The arena: `num_units` units of `unit_bytes` (unit 0 null).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaPlan {
    /// Tokens per page of the page groups.
    pub page_size: u64,
    /// The alignment of the state components and of the unit (with state groups).
    pub alignment: u64,
    /// Bytes per unit.
    pub unit_bytes: u64,
    /// Units in the budget (unit 0 included).
    pub num_units: u64,
    /// The groups, in first-appearance order.
    pub groups: Vec<ArenaGroup>,
    /// The components, in input order.
    pub components: Vec<ArenaComponent>,
}

fn gcd128(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// `v` rounded up to a multiple of `a > 0`.
fn align_up(v: u64, a: u64, what: &str) -> CoreResult<u64> {
    checked::mul(checked::ceil_div(v, a, what)?, a, what)
}

/// A group's components, as the contract classifies them.
struct GroupRows {
    first: usize,
    members: Vec<usize>,
    per_token: bool,
    constant: bool,
}

/// The groups of `checked` in first-appearance order of their key, classified; a group that
/// mixes both kinds of bytes, or holds none, is an error.
fn group_rows(components: &[ComponentArg], checked: &[Checked<'_>]) -> CoreResult<Vec<GroupRows>> {
    let mut groups: Vec<GroupRows> = Vec::new();
    for (k, c) in checked.iter().enumerate() {
        let key = c.arg.group_key;
        let at = if let Some(at) = groups.iter().position(|g| components[g.first].group_key == key) {
            at
        } else {
            groups.push(GroupRows {
                first: k,
                members: Vec::new(),
                per_token: false,
                constant: false,
            });
            groups.len() - 1
        };
        let group = &mut groups[at];
        group.members.push(k);
        group.per_token |= c.bytes_per_slot.is_positive();
        group.constant |= c.const_bytes.is_positive();
    }
    for g in &groups {
        let gid = &components[g.first].group_id;
        if g.per_token && g.constant {
            return Err(CoreError::invalid(format!(
                "group {gid} mixes per-token and constant components"
            )));
        }
        if !g.per_token && !g.constant {
            return Err(CoreError::invalid(format!("group {gid} holds no bytes")));
        }
    }
    Ok(groups)
}

/// Each page group's page bytes (`None` for state groups), its components placed side by side.
fn place_pages(
    components: &[ComponentArg],
    checked: &[Checked<'_>],
    groups: &[GroupRows],
    page: u64,
    placed: &mut [ArenaComponent],
) -> CoreResult<Vec<Option<u64>>> {
    let mut page_bytes = Vec::with_capacity(groups.len());
    for g in groups {
        if g.constant {
            page_bytes.push(None);
            continue;
        }
        let gid = &components[g.first].group_id;
        let what = format!("page_bytes of group {gid}: page_size * sum of its bytes_per_slot");
        let mut cursor = 0u64;
        for &k in &g.members {
            let nbytes = checked::mul(checked[k].bytes_per_slot.u64(&what)?, page, &what)?;
            placed[k] = ArenaComponent { offset: cursor, nbytes };
            cursor = checked::add(cursor, nbytes, &what)?;
        }
        page_bytes.push(Some(cursor));
    }
    Ok(page_bytes)
}

/// The state slot's bytes (0 without state groups): every state component in input order, each
/// at an aligned offset.
fn place_state(
    checked: &[Checked<'_>],
    groups: &[GroupRows],
    align: u64,
    placed: &mut [ArenaComponent],
) -> CoreResult<u64> {
    const WHAT: &str = "slot_bytes: the state components, each aligned";
    // The state groups' components, back in input order.
    let mut state: Vec<usize> = groups
        .iter()
        .filter(|g| g.constant)
        .flat_map(|g| g.members.iter().copied())
        .collect();
    state.sort_unstable();
    let mut end = 0u64;
    for k in state {
        let nbytes = checked[k].const_bytes.u64(WHAT)?;
        let offset = align_up(end, align, WHAT)?;
        placed[k] = ArenaComponent { offset, nbytes };
        end = checked::add(offset, nbytes, WHAT)?;
    }
    align_up(end, align, WHAT)
}

/// Whether every unit of `unit` bytes holds a whole page of `page` bytes (`page <= unit`), pages
/// lying at multiples of `page` bytes: a unit starts a multiple of `gcd(unit, page)` bytes
/// into a page, at worst `page - gcd` bytes, and then holds a page iff `unit >= 2 page - gcd`.
pub fn every_unit_holds_a_page(unit: u64, page: u64) -> bool {
    let (u, b) = (u128::from(unit), u128::from(page));
    u + gcd128(u, b) >= 2 * b
}

/// The divisors `k` of the largest page tried for a unit `2 b - b / k` (docs/sizing-api.md, `unit_bytes`).
pub const UNIT_DIVISORS: u64 = 64;

/// The unit: with state, the slot and the largest page rounded up to the alignment; without,
/// the lcm of the pages when it is at most 4 pages, else the largest page. When some unit of
/// that size would hold no whole page of some group (pages lie at multiples of their bytes,
/// and one that straddles two units is never used), the unit is raised to the smallest of the
/// candidates that gives every unit a page of every group: `2 b - b / k` for `k` in `1 ..=
/// UNIT_DIVISORS` dividing `b` (`b` the largest page; below `2 b - 1` only sizes of this form
/// hold a page of `b` in every unit) and the first size `>= 2 b - 1`, each at least the default
/// and a multiple of the alignment (with state).
fn unit_bytes(page_bytes: &[Option<u64>], slot: u64, align: u64) -> CoreResult<u64> {
    let largest = page_bytes.iter().flatten().copied().max().unwrap_or(0);
    let (default, step) = if slot > 0 {
        (align_up(slot.max(largest), align, "unit_bytes")?, align)
    } else {
        // Computed in u128: an lcm past u128 is far past 4 pages of u64 bytes.
        let mut lcm: Option<u128> = Some(1);
        for &b in page_bytes.iter().flatten() {
            let b = u128::from(b);
            lcm = lcm.and_then(|l| (l / gcd128(l, b)).checked_mul(b));
        }
        let unit = match lcm {
            Some(l) if l <= u128::from(largest) * 4 => checked::narrow(l, "unit_bytes")?,
            _ => largest,
        };
        (unit, 1)
    };
    let holds_all = |unit: u64| page_bytes.iter().flatten().all(|&b| every_unit_holds_a_page(unit, b));
    if holds_all(default) {
        return Ok(default);
    }
    // In u128: 2 b - 1 may be past u64 while a smaller candidate is not.
    let (b, step, default) = (u128::from(largest), u128::from(step), u128::from(default));
    let holds_all_wide = |unit: u128| u64::try_from(unit).is_ok_and(holds_all);
    // At least 2 b - 1: every unit holds a page of every group (gcd >= 1).
    let threshold = (2 * b - 1).max(default).div_ceil(step) * step;
    let best = (1..=u128::from(UNIT_DIVISORS))
        .filter(|&k| b % k == 0)
        .map(|k| 2 * b - b / k)
        .filter(|&unit| unit >= default && unit % step == 0 && holds_all_wide(unit))
        .fold(threshold, u128::min);
    checked::narrow(best, "unit_bytes")
}

/// `plan_arena`'s arguments but the components, checked in the contract's order (they come
/// first): `(page_size, budget_bytes, alignment, max_live_requests)`.
pub fn check_scalars<'a>(
    page_size: &'a IntArg,
    budget_bytes: &'a IntArg,
    alignment: &'a IntArg,
    max_live_requests: &'a IntArg,
) -> CoreResult<(&'a Int, &'a Int, &'a Int, &'a Int)> {
    Ok((
        page_size.positive("page_size")?,
        budget_bytes.non_negative("budget_bytes")?,
        alignment.positive("alignment")?,
        max_live_requests.non_negative("max_live_requests")?,
    ))
}

/// `plan_arena`: the units, each group's item, and every component's place (docs/sizing-api.md).
pub fn plan_arena(
    components: &[ComponentArg],
    page_size: &IntArg,
    budget_bytes: &IntArg,
    alignment: &IntArg,
    max_live_requests: &IntArg,
) -> CoreResult<ArenaPlan> {
    let (page, budget, align, live) = check_scalars(page_size, budget_bytes, alignment, max_live_requests)?;
    let checked = check_components(components)?;
    if checked.is_empty() {
        return Err(CoreError::invalid("components must not be empty"));
    }
    let groups = group_rows(components, &checked)?;
    let page_u64 = page.u64("page_size")?;
    let align_u64 = align.u64("alignment")?;
    let mut placed = vec![ArenaComponent { offset: 0, nbytes: 0 }; checked.len()];
    let page_bytes = place_pages(components, &checked, &groups, page_u64, &mut placed)?;
    let slot_bytes = place_state(&checked, &groups, align_u64, &mut placed)?;
    let unit = unit_bytes(&page_bytes, slot_bytes, align_u64)?;
    let units = capped_quotient(budget, &Int::from(unit));
    if units <= Int::from(1u64) {
        return Err(CoreError::invalid(format!(
            "budget_bytes={budget} gives {units} units of {unit} bytes; need at least 2 (unit 0 is null)"
        )));
    }
    let num_units = units.u64("num_units = budget_bytes // unit_bytes")?;
    // Every live request of a state model holds a working state slot, one unit each.
    let slots = Int::from(num_units - 1);
    if page_bytes.iter().any(Option::is_none) && slots < *live {
        let needed = live.add(&Int::from(1u64)).mul(&Int::from(unit));
        return Err(CoreError::Config(format!(
            "budget_bytes={budget} gives {num_units} units of {unit} bytes: {slots} working state slots, fewer \
             than max_live_requests={live} live requests need (one each); give budget_bytes >= {needed} or \
             fewer live requests"
        )));
    }
    let arena = u128::from(num_units) * u128::from(unit);
    let mut planned = Vec::with_capacity(groups.len());
    for (g, bytes) in groups.iter().zip(&page_bytes) {
        let gid = &components[g.first].group_id;
        let (kind, item, per_unit, num_ids) = match bytes {
            Some(b) => (
                "pages",
                *b,
                unit / b,
                checked::narrow(arena / u128::from(*b), &format!("num_ids of group {gid}"))?,
            ),
            None => ("state", slot_bytes, 1, num_units),
        };
        planned.push(ArenaGroup {
            group_source: g.first,
            kind,
            item_bytes: item,
            per_unit,
            num_ids,
            slack_bytes: unit - per_unit * item,
        });
    }
    Ok(ArenaPlan {
        page_size: page_u64,
        alignment: align_u64,
        unit_bytes: unit,
        num_units,
        groups: planned,
        components: placed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sizing::plan::{component_args, ComponentSpec};

    fn spec(group: &str, layer: u64, name: &str, per_token: u64, constant: u64) -> ComponentSpec {
        ComponentSpec {
            group_id: group.to_owned(),
            layer: usize::try_from(layer).unwrap(),
            component: name.to_owned(),
            bytes_per_slot: Int::from(per_token),
            const_bytes: Int::from(constant),
        }
    }

    fn plan(specs: &[ComponentSpec], page: u64, budget: u64) -> CoreResult<ArenaPlan> {
        plan_aligned(specs, page, budget, 256)
    }

    fn plan_aligned(specs: &[ComponentSpec], page: u64, budget: u64, align: u64) -> CoreResult<ArenaPlan> {
        let args = component_args(specs);
        plan_arena(
            &args,
            &IntArg::Int(Int::from(page)),
            &IntArg::Int(Int::from(budget)),
            &IntArg::Int(Int::from(align)),
            &IntArg::Int(Int::zero()),
        )
    }

    #[test]
    fn a_state_unit_holds_the_slot_and_packs_pages() {
        // 2 attention layers of 100 bytes/token (page 16: 3,200 bytes), 2 state layers of
        // 1,000 + 5,000 bytes: the slot is 1,024 + 5,120 rounded... each component aligned to 256.
        let specs = [
            spec("full", 0, "kv", 100, 0),
            spec("lin", 1, "conv", 0, 1000),
            spec("lin", 1, "ssm", 0, 5000),
            spec("full", 2, "kv", 100, 0),
            spec("lin", 3, "conv", 0, 1000),
            spec("lin", 3, "ssm", 0, 5000),
        ];
        let p = plan(&specs, 16, 1_000_000).unwrap();
        // Slot: conv 0..1000, ssm 1024..6024, conv 6144..7144, ssm 7168..12168 -> 12288.
        let offsets: Vec<u64> = p.components.iter().map(|c| c.offset).collect();
        assert_eq!(offsets, vec![0, 0, 1024, 1600, 6144, 7168]);
        assert_eq!(p.unit_bytes, 12_288);
        assert_eq!(p.num_units, 1_000_000 / 12_288);
        let full = &p.groups[0];
        assert_eq!((full.kind, full.item_bytes, full.per_unit), ("pages", 3200, 3));
        assert_eq!(full.slack_bytes, 12_288 - 9_600);
        assert_eq!(full.num_ids, p.num_units * 12_288 / 3200);
        let lin = &p.groups[1];
        assert_eq!(
            (lin.kind, lin.item_bytes, lin.per_unit, lin.num_ids),
            ("state", 12_288, 1, p.num_units)
        );
    }

    #[test]
    fn without_state_the_unit_is_the_lcm_of_the_pages_when_small() {
        // Pages of 22 and 4 layer-units: lcm 44 <= 4 * 22 -> no slack for either.
        let specs = [spec("swa", 0, "kv", 22, 0), spec("full", 1, "kv", 4, 0)];
        let p = plan(&specs, 1, 1000).unwrap();
        assert_eq!(p.unit_bytes, 44);
        assert_eq!(p.groups.iter().map(|g| g.slack_bytes).collect::<Vec<_>>(), vec![0, 0]);
        // 7 and 4: lcm 28 = 4 * 7 -> no slack either.
        let p = plan(&[spec("a", 0, "kv", 7, 0), spec("b", 1, "kv", 4, 0)], 1, 1000).unwrap();
        assert_eq!(p.unit_bytes, 28);
        // 7 and 3: lcm 21 <= 4 * 7 -> the lcm.
        let p = plan(&[spec("a", 0, "kv", 7, 0), spec("b", 1, "kv", 3, 0)], 1, 1000).unwrap();
        assert_eq!(p.unit_bytes, 21);
    }

    #[test]
    fn a_unit_that_would_hold_no_page_of_a_group_is_raised() {
        // 7 and 5: lcm 35 > 4 * 7, so the largest page, 7; but units of 7 bytes start 2, 4, 1, 3
        // bytes into 5-byte pages, and the unit at bytes 7..14 holds no whole 5-byte page
        // (5..10 and 10..15 straddle). Below 2 * 7 - 1 = 13 only 14 - 7/k for k | 7 can hold a
        // 7-byte page in every unit: 7 (k = 1, fails for 5) and 13 (k = 7): 13.
        let p = plan(&[spec("a", 0, "kv", 7, 0), spec("b", 1, "kv", 5, 0)], 1, 1000).unwrap();
        assert_eq!(
            (p.unit_bytes, p.groups[1].per_unit, p.groups[1].slack_bytes),
            (13, 2, 3)
        );
        // The reproduction: 3-byte pages beside a 4-byte slot, alignment 1. Units of 4
        // (the slot) would leave 4..8 without a page; 2 * 3 - 3 / 3 = 5 holds one everywhere.
        let p = plan_aligned(&[spec("attn", 0, "kv", 3, 0), spec("ssm", 1, "state", 0, 4)], 1, 12, 1).unwrap();
        assert_eq!((p.unit_bytes, p.num_units), (5, 2));
        // 40 KiB pages beside a 48 KiB slot (alignment 256): 2 * 40 KiB - 20 KiB = 60 KiB.
        let p = plan_aligned(
            &[spec("attn", 0, "kv", 2560, 0), spec("ssm", 1, "state", 0, 48 << 10)],
            16,
            1 << 30,
            256,
        )
        .unwrap();
        assert_eq!(p.unit_bytes, 60 << 10);
    }

    #[test]
    fn every_unit_holds_a_page_matches_a_scan_of_the_units() {
        for unit in 1..=60u64 {
            for page in 1..=unit {
                // Units 1 ..= page (a whole period of their offsets into a page) each hold a
                // page: ids ceil(u U / s) .. floor((u + 1) U / s), as the engine places them.
                let scanned = (1..=page).all(|u| ((u + 1) * unit) / page > (u * unit).div_ceil(page));
                assert_eq!(every_unit_holds_a_page(unit, page), scanned, "unit {unit} page {page}");
            }
        }
    }

    #[test]
    fn errors_follow_the_contract() {
        let err = |specs: &[ComponentSpec], budget: u64| plan(specs, 16, budget).unwrap_err().to_string();
        assert_eq!(err(&[], 100), "components must not be empty");
        assert_eq!(
            err(&[spec("g", 0, "kv", 1, 1)], 100),
            "group g mixes per-token and constant components"
        );
        assert_eq!(
            err(&[spec("g", 0, "kv", 1, 0), spec("g", 1, "s", 0, 4)], 100),
            "group g mixes per-token and constant components"
        );
        assert_eq!(err(&[spec("g", 0, "kv", 0, 0)], 100), "group g holds no bytes");
        assert_eq!(
            err(&[spec("g", 0, "kv", 2, 0)], 63),
            "budget_bytes=63 gives 1 units of 32 bytes; need at least 2 (unit 0 is null)"
        );
    }
}
