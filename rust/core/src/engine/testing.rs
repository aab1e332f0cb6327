//! Helpers shared by the engine's unit tests.

use super::coordinator::GroupSpec;
use super::group::GroupKind;
use super::ids::RequestIdRef;
use super::tokens::Prompt;
use super::{CacheOptions, FlatCache};
use crate::error::CoreResult;

pub(super) const A: RequestIdRef<'static> = RequestIdRef::Str("a");

pub(super) const B: RequestIdRef<'static> = RequestIdRef::Str("b");

pub(super) const C: RequestIdRef<'static> = RequestIdRef::Int(3);

pub(super) fn spec(id: &str, kind: GroupKind, page_size: u64) -> GroupSpec {
    GroupSpec {
        group_id: id.to_owned(),
        kind,
        page_size,
    }
}

pub(super) fn sw(window: u64) -> GroupKind {
    GroupKind::SlidingWindow { window }
}

pub(super) fn cache(specs: Vec<GroupSpec>, pages: u64, options: CacheOptions) -> FlatCache {
    FlatCache::with_options(specs, pages, options).unwrap()
}

/// Full P = 4 and sliding P = 4, W = 8 (the docs' running example).
pub(super) fn hybrid(pages: u64) -> FlatCache {
    cache(
        vec![spec("full", GroupKind::Full, 4), spec("swa", sw(8), 4)],
        pages,
        CacheOptions::default(),
    )
}

pub(super) fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

pub(super) fn prompt(c: &FlatCache, tokens: Vec<u32>) -> Prompt {
    Prompt::new(tokens, Vec::new(), c.coordinator().base_page_size()).unwrap()
}

/// Add token-level request `req` for `tokens` with the prefix cache; returns its slot (as the
/// slot-addressed calls take it) and its hit.
pub(super) fn add(c: &mut FlatCache, req: RequestIdRef<'_>, tokens: Vec<u32>) -> (u64, u64) {
    let p = prompt(c, tokens);
    let (slot, hit) = c.add_request(req, p, true).unwrap();
    (u64::try_from(slot).unwrap(), hit)
}

/// `schedule` of one slot.
pub(super) fn sched(c: &mut FlatCache, slot: u64, n: u64, lookahead: u64) -> CoreResult<bool> {
    let got = c.schedule(&[slot], &[n], lookahead)?;
    assert_eq!(got.len(), 1);
    Ok(got[0])
}

/// `append_tokens` of `tokens` to one slot.
pub(super) fn append(c: &mut FlatCache, slot: u64, tokens: &[u32]) -> CoreResult<()> {
    let n = u64::try_from(tokens.len()).unwrap();
    c.append_tokens(&[slot], tokens, Some(&[n]))
}

/// `preempt` of one slot: its tokens.
pub(super) fn preempt1(c: &mut FlatCache, slot: u64) -> CoreResult<Vec<u32>> {
    let mut got = c.preempt(&[slot])?;
    assert_eq!(got.len(), 1);
    Ok(got.remove(0))
}

pub(super) fn free_list(c: &FlatCache) -> Vec<u32> {
    c.coordinator().pool().free_list().collect()
}

/// Run `req` to the end of its known tokens in one schedule, then finish it.
pub(super) fn run_and_finish(c: &mut FlatCache, req: RequestIdRef<'_>, tokens: Vec<u32>) {
    let len = u64::try_from(tokens.len()).unwrap();
    let (slot, hit) = add(c, req, tokens);
    let rest = len - hit;
    assert!(sched(c, slot, rest, 0).unwrap());
    c.finish(&[slot]).unwrap();
    assert!(!c.has_request(req));
    c.check_invariants().unwrap();
}
