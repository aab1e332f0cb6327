//! Helpers shared by the engine's unit tests.

use super::coordinator::GroupSpec;
use super::group::GroupKind;
use super::ids::RequestIdRef;
use super::tokens::Prompt;
use super::{CacheOptions, FlatCache};

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

pub(super) fn add(c: &mut FlatCache, req: RequestIdRef<'_>, tokens: Vec<u32>) -> u64 {
    let p = prompt(c, tokens);
    c.add_request(req, p, true).unwrap()
}

pub(super) fn free_list(c: &FlatCache) -> Vec<u32> {
    c.coordinator().pool().free_list().collect()
}

/// Run `req` to the end of its known tokens in one schedule, then finish it.
pub(super) fn run_and_finish(c: &mut FlatCache, req: RequestIdRef<'_>, tokens: Vec<u32>) {
    let len = u64::try_from(tokens.len()).unwrap();
    let hit = add(c, req, tokens);
    let rest = len - hit;
    assert!(c.schedule(req, rest, 0).unwrap());
    c.finish(req).unwrap();
    c.check_invariants().unwrap();
}
