//! Admission accounting (docs/requests-api.md; SPEC 9): what a prompt would hit and cost
//! before it is added, and the per-request reserves that budget the next decodes.

use crate::engine::coordinator::PrefixMatch;
use crate::engine::tokens::Prompt;
use crate::engine::FlatCache;
use crate::error::{CoreError, CoreResult};

impl FlatCache {
    pub(in crate::engine) fn check_prompt(&self, prompt: &Prompt) -> CoreResult<()> {
        let base = self.coord.base_page_size();
        if prompt.base != base {
            return Err(CoreError::invalid(format!(
                "the prompt was hashed for base page size {}, this cache's is {base}",
                prompt.base
            )));
        }
        Ok(())
    }

    /// The capped prefix match of a prompt: never the last token (SPEC 9), so over the first
    /// `max((len - 1) // base, 0)` base pages.
    pub(in crate::engine) fn capped_match(&self, prompt: &Prompt) -> CoreResult<PrefixMatch> {
        self.check_prompt(prompt)?;
        let len = u64::try_from(prompt.tokens.len()).unwrap_or(u64::MAX);
        let cap = self.coord.base_div().quotient(len.saturating_sub(1));
        let cap = usize::try_from(cap).map_or(prompt.hashes.len(), |c| c.min(prompt.hashes.len()));
        let hashes = &prompt.hashes[..cap];
        if self.coord.host().is_none() {
            return self.coord.match_prefix(hashes);
        }
        // Host tier: device-or-host hits, unless the pool lacks the free pages the claim and
        // the loads take (in arena mode: the units they would bind); then the device-only
        // match (host.rs).
        let m = self.coord.match_prefix_tiered(hashes)?;
        if m.host_hits.is_empty() || self.coord.tiered_claim_fits(&m) {
            return Ok(m);
        }
        self.coord.match_prefix(hashes)
    }

    /// The hit `add_request` would get for `prompt` (capped), read-only.
    pub fn prefix_hit_tokens(&self, prompt: &Prompt) -> CoreResult<u64> {
        Ok(self.capped_match(prompt)?.num_common_tokens)
    }

    /// Pages admitting `prompt` would take: the capped match's claim (its free cached pages,
    /// and with a host tier one device page per page loaded back) plus the pages of
    /// `num_new_tokens + reserve_tokens` on fresh tables (in arena mode: credits).
    pub fn pages_needed_to_admit(&self, prompt: &Prompt, num_new_tokens: u64, reserve_tokens: u64) -> CoreResult<u64> {
        let m = self.capped_match(prompt)?;
        let what = "num_new_tokens + reserve_tokens";
        let tokens = num_new_tokens
            .checked_add(reserve_tokens)
            .ok_or_else(|| CoreError::overflow(what))?;
        self.pages_to_admit(Some(&m), tokens, what)
    }

    /// Pages a new request claiming `m` (`None`: nothing) and then taking `tokens` on fresh
    /// tables needs: the device pages the claim takes off the free list, one per host-tier
    /// load, and `pages_needed(tokens)`. `what` names the tokens in an overflow error.
    pub(in crate::engine) fn pages_to_admit(
        &self,
        m: Option<&PrefixMatch>,
        tokens: u64,
        what: &str,
    ) -> CoreResult<u64> {
        let (device, loads) = m.map_or((0, 0), |m| self.coord.tiered_claim_cost(m));
        let consumed = u64::try_from(device.saturating_add(loads)).unwrap_or(u64::MAX);
        self.coord
            .pages_needed(None, tokens)?
            .checked_add(consumed)
            .ok_or_else(|| CoreError::overflow(what))
    }

    /// Promise `pages_needed(tokens[i], slots[i])` pages to the next decode of the request in
    /// `slots[i]` (replacing its previous reserve; 0 tokens clears it; a repeated slot: the
    /// last one counts). Everything is checked first (lengths, slots, page counts).
    pub fn reserve(&mut self, slots: &[u64], tokens: &[u64]) -> CoreResult<()> {
        if slots.len() != tokens.len() {
            return Err(CoreError::invalid(format!(
                "tokens has {} entries but slots has {}",
                tokens.len(),
                slots.len()
            )));
        }
        let mut pages = Vec::with_capacity(slots.len());
        for (&slot, &n) in slots.iter().zip(tokens) {
            let at = self.held("reserve", slot)?;
            pages.push((at, self.coord.pages_needed(Some(&self.entries[at].tables), n)?));
        }
        for (at, n) in pages {
            let entry = &mut self.entries[at];
            self.reserved = self.reserved - u128::from(entry.reserve) + u128::from(n);
            entry.reserve = n;
        }
        Ok(())
    }

    /// Pages promised to the next decode of the request in `slot`.
    pub fn reserved_pages(&self, slot: u64) -> CoreResult<u64> {
        Ok(self.entries[self.held("reserved_pages", slot)?].reserve)
    }

    /// Free pages minus the reserves of every request other than the one in `slot` (may be
    /// negative).
    pub fn budget(&self, slot: Option<u64>) -> CoreResult<i128> {
        let own = match slot {
            Some(s) => u128::from(self.entries[self.held("budget", s)?].reserve),
            None => 0,
        };
        let free = i128::try_from(self.coord.pool().num_free()).unwrap_or(i128::MAX);
        let others = i128::try_from(self.reserved - own).map_err(|_| CoreError::overflow("reserves"))?;
        Ok(free - others)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::testing::*;

    #[test]
    fn capped_match_never_covers_the_last_prompt_token() {
        let mut c = hybrid(64);
        run_and_finish(&mut c, A, toks(0..16));
        // All 4 pages of 0..16 are cached, but a 16-token prompt matches at most
        // (16 - 1) // 4 = 3 pages: the last token must be recomputed.
        let p16 = prompt(&c, toks(0..16));
        assert_eq!(c.prefix_hit_tokens(&p16).unwrap(), 12);
        // 17 tokens: cap = 4 pages, all cached.
        let p17 = prompt(&c, toks(0..17));
        assert_eq!(c.prefix_hit_tokens(&p17).unwrap(), 16);
        // One token: cap 0, no hit; the probe changed nothing.
        let p1 = prompt(&c, toks(0..1));
        assert_eq!(c.prefix_hit_tokens(&p1).unwrap(), 0);
        // The slot run_and_finish used is free again: B takes it.
        let (sb, hit) = add(&mut c, B, toks(0..16));
        assert_eq!((sb, hit), (0, 12));
        assert_eq!(c.num_computed_tokens(sb).unwrap(), 12);
        assert_eq!(c.num_tokens(sb).unwrap(), 16);
        // The claim took 3 full pages and the sliding run behind 12 (W = 8: 2 pages), and
        // allocated nothing else.
        let ids = c.page_ids(B).unwrap();
        assert_eq!((ids[0].len(), ids[1].iter().filter(|&&p| p != 0).count()), (3, 2));
        assert_eq!(c.tail_available(B).unwrap(), vec![0, 0]);
        c.check_invariants().unwrap();
    }

    #[test]
    fn admit_counts_the_first_decode_page_only_when_the_chunk_completes_the_prompt() {
        // 5 real pages. 8 new tokens take 2 + 2 pages, a ninth (the first decode) 3 + 3.
        let mut c = hybrid(6);
        let p = prompt(&c, toks(0..8));
        let before = c.stats();
        assert_eq!(c.admit(A, p.clone(), 8, true).unwrap(), None);
        assert_eq!(c.stats(), before);
        assert!(!c.has_request(A));
        // A chunk that leaves a prompt token for later needs no reserve: 4 pages fit.
        assert_eq!(c.admit(A, p, 7, true).unwrap(), Some((0, 0, 7)));
        let sa = 0;
        assert_eq!(c.slot_of(A), Some(0));
        assert_eq!(c.num_computed_tokens(sa).unwrap(), 0);
        assert!(sched(&mut c, sa, 7, 0).unwrap());
        c.check_invariants().unwrap();
    }

    #[test]
    fn admit_is_the_probes_then_add_request() {
        let mut c = hybrid(64);
        run_and_finish(&mut c, A, toks(0..16));
        let p = prompt(&c, toks(0..24));
        let hit = c.prefix_hit_tokens(&p).unwrap();
        assert!(hit > 0);
        let need = c.pages_needed_to_admit(&p, 3, 0).unwrap();
        let free = c.budget(None).unwrap();
        assert_eq!(c.admit(B, p, 3, true).unwrap(), Some((0, hit, 3)));
        let sb = 0;
        assert_eq!(c.num_computed_tokens(sb).unwrap(), hit);
        assert!(sched(&mut c, sb, 3, 0).unwrap());
        // Exactly the pages the probe counted left the free list.
        assert_eq!(c.budget(None).unwrap(), free - i128::from(need));
        // Without the prefix cache the hit is 0, and an id in use is an error.
        let q = prompt(&c, toks(0..24));
        assert_eq!(c.admit(C, q.clone(), 4, false).unwrap(), Some((1, 0, 4)));
        assert!(matches!(c.admit(B, q, 4, true), Err(CoreError::InvalidArgument(_))));
        c.check_invariants().unwrap();
    }

    #[test]
    fn reserve_and_budget_arithmetic() {
        let mut c = hybrid(21); // 20 real pages
        let sa = add(&mut c, A, toks(0..8)).0;
        let sb = add(&mut c, B, toks(0..8)).0;
        assert!(sched(&mut c, sa, 6, 0).unwrap()); // 2 + 2 pages, tail 2
        assert_eq!(c.budget(None).unwrap(), 16);
        // a's next 3 tokens: tail 2, then 1 page per group.
        c.reserve(&[sa], &[3]).unwrap();
        assert_eq!(c.reserved_pages(sa).unwrap(), 2);
        // b (empty tables): 9 tokens -> 3 + 3.
        c.reserve(&[sb], &[9]).unwrap();
        assert_eq!(c.reserved_pages(sb).unwrap(), 6);
        assert_eq!(c.budget(None).unwrap(), 16 - 8);
        assert_eq!(c.budget(Some(sa)).unwrap(), 16 - 6);
        assert_eq!(c.budget(Some(sb)).unwrap(), 16 - 2);
        // Replacing a reserve, and clearing it.
        c.reserve(&[sb], &[40]).unwrap(); // 10 + 10
        assert_eq!(c.budget(None).unwrap(), 16 - 22);
        c.reserve(&[sb], &[0]).unwrap();
        assert_eq!(c.budget(None).unwrap(), 14);
        // A successful schedule releases the reserve; finish releases it too.
        assert!(sched(&mut c, sa, 2, 0).unwrap());
        assert_eq!(c.reserved_pages(sa).unwrap(), 0);
        c.reserve(&[sb], &[4]).unwrap();
        c.finish(&[sb]).unwrap();
        assert_eq!(c.budget(None).unwrap(), 16);
        assert!(matches!(
            c.budget(Some(sb)),
            Err(CoreError::UnknownSlot { slot: 1, .. })
        ));
        assert!(matches!(c.reserved_pages(sb), Err(CoreError::UnknownSlot { .. })));
        // Admission: 8 tokens of a fresh prompt plus a 5-token reserve -> 13 tokens on
        // fresh tables: 4 + 4; a's pages are held (count > 0), so its claim takes none.
        let p = prompt(&c, toks(0..9));
        assert_eq!(c.pages_needed_to_admit(&p, 8, 5).unwrap(), 8);
        assert!(c.pages_needed_to_admit(&p, u64::MAX, 1).is_err());
        c.check_invariants().unwrap();
    }

    #[test]
    fn pages_needed_to_admit_counts_free_cached_pages_the_claim_takes() {
        let mut c = hybrid(64);
        run_and_finish(&mut c, A, toks(0..16));
        // The capped match of 0..17 covers 4 full pages and the sliding run of 2 behind 16,
        // all free: the claim takes 6 pages; 1 more token needs 1 + 1.
        let p = prompt(&c, toks(0..17));
        assert_eq!(c.pages_needed_to_admit(&p, 1, 0).unwrap(), 6 + 2);
        let before = c.coordinator().pool().num_free();
        let (sb, hit) = add(&mut c, B, toks(0..17));
        assert_eq!(hit, 16);
        assert!(sched(&mut c, sb, 1, 0).unwrap());
        assert_eq!(before - c.coordinator().pool().num_free(), 8);
    }

    #[test]
    fn reserve_takes_arrays_checked_first_and_a_repeated_slot_counts_last() {
        let mut c = hybrid(21); // 20 real pages
        let sa = add(&mut c, A, toks(0..8)).0;
        let sb = add(&mut c, B, toks(0..8)).0;
        assert!(c.acquire(C, 4).unwrap()); // a page-level request in slot 2
        let sc = u64::try_from(c.slot_of(C).unwrap()).unwrap();
        assert_eq!((sa, sb, sc), (0, 1, 2));
        // One call, several slots: 5 tokens -> 2 + 2 pages; 4 tokens -> 1 + 1; a page-level
        // request's reserve counts too (its last page has 0 tokens of room).
        c.reserve(&[sa, sb, sc], &[5, 4, 1]).unwrap();
        assert_eq!([sa, sb, sc].map(|s| c.reserved_pages(s).unwrap()), [4, 2, 2]);
        assert_eq!(c.budget(None).unwrap(), 18 - 8);
        // A repeated slot: the last one counts.
        c.reserve(&[sb, sa, sb], &[40, 0, 1]).unwrap();
        assert_eq!([sa, sb, sc].map(|s| c.reserved_pages(s).unwrap()), [0, 2, 2]);
        assert_eq!(c.budget(None).unwrap(), 18 - 4);
        c.check_invariants().unwrap();
        // Errors change nothing, even when earlier entries were fine.
        let before = (
            [sa, sb, sc].map(|s| c.reserved_pages(s).unwrap()),
            c.budget(None).unwrap(),
        );
        let err = c.reserve(&[sa, sb], &[1]).unwrap_err();
        assert_eq!(err.to_string(), "tokens has 1 entries but slots has 2");
        assert_eq!(
            c.reserve(&[sa, 7], &[9, 9]),
            Err(CoreError::UnknownSlot {
                method: "reserve".into(),
                slot: 7
            })
        );
        assert!(matches!(
            c.reserve(&[sa, u64::MAX], &[9, 9]),
            Err(CoreError::UnknownSlot { .. })
        ));
        assert_eq!(
            (
                [sa, sb, sc].map(|s| c.reserved_pages(s).unwrap()),
                c.budget(None).unwrap()
            ),
            before
        );
        c.reserve(&[], &[]).unwrap();
        // A finished request's slot holds no request: refused until a new request takes it.
        c.finish(&[sa]).unwrap();
        assert!(matches!(
            c.reserve(&[sa], &[1]),
            Err(CoreError::UnknownSlot { slot: 0, .. })
        ));
        assert_eq!(add(&mut c, A, toks(0..8)).0, sa);
        assert_eq!(c.reserved_pages(sa).unwrap(), 0, "a new request starts with no reserve");
        c.check_invariants().unwrap();
    }
}
