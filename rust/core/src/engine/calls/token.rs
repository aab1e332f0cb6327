//! Token-level requests (docs/requests-api.md; SPEC 8, 9, 12.4): requests that own their
//! tokens and content hashes, and the scheduler-loop calls (add, append, schedule, finish,
//! preempt).
//!
//! A token-level request keeps its tokens, the chained hash of every full base page (each
//! hashed once, when it fills: SPEC 12.4), how many tokens are computed, and how many base
//! pages have been registered. Its tables are the same per-group tables page-level requests
//! use, and "allocated tokens" is read off them (claimed plus acquired tokens, the same in
//! every group), so page-level calls on a token-level request cannot desynchronise it.

use crate::engine::coordinator::{Coordinator, PrefixMatch, TokenContext};
use crate::engine::hash::{hash_page, ContentHash, GroupKey};
use crate::engine::ids::RequestIdRef;
use crate::engine::policy::{EvictionPolicy, Role};
use crate::engine::pool::NULL_PAGE;
use crate::engine::table::Table;
use crate::engine::tokens::{Prompt, StepSlots, TokenState};
use crate::engine::FlatCache;
use crate::error::{CoreError, CoreResult};

/// Tokens of spare capacity a new request's token vector gets for its appends.
const APPEND_HEADROOM: usize = 256;

/// The error for a token-level method called on a page-level request.
fn page_level(method: &str, req: RequestIdRef<'_>) -> CoreError {
    CoreError::invalid(format!(
        "{method}: request {req} is page-level (not created by add_request)"
    ))
}

/// The lengths of a batch append: one token per entry of the batch (`what` names it) without
/// `counts`, else one count per entry adding up to the tokens.
fn check_append_lengths(len: usize, what: &str, tokens: &[u32], counts: Option<&[u64]>) -> CoreResult<()> {
    match counts {
        None if tokens.len() != len => Err(CoreError::invalid(format!(
            "token_ids has {} entries but {what} has {len} (one token per request without num_tokens)",
            tokens.len()
        ))),
        Some(ns) if ns.len() != len => Err(CoreError::invalid(format!(
            "num_tokens has {} entries but {what} has {len}",
            ns.len()
        ))),
        Some(ns) => {
            let total = ns
                .iter()
                .try_fold(0u64, |sum, &n| sum.checked_add(n))
                .ok_or_else(|| CoreError::overflow("num_tokens"))?;
            if u64::try_from(tokens.len()).ok() == Some(total) {
                Ok(())
            } else {
                Err(CoreError::invalid(format!(
                    "num_tokens adds up to {total} but token_ids has {} entries",
                    tokens.len()
                )))
            }
        }
        None => Ok(()),
    }
}

/// Slots plus known-hole slots of every table, summed: both only grow between frees, so the
/// sum changes exactly when a cell of a block-table row does.
#[inline]
fn shape(tables: &[Table]) -> usize {
    tables.iter().map(|t| t.len() + t.holes_below()).sum()
}

/// Tokens allocated to a request: claimed plus acquired tokens (the same in every group).
#[inline]
fn allocated(coord: &Coordinator, tables: &[Table]) -> u64 {
    let (Some(table), Some(manager)) = (tables.first(), coord.managers().first()) else {
        return 0;
    };
    // Tables hold fewer than 2**31 pages; saturating is exact for any realistic page size and
    // only ever over-states room that no pool could hold.
    u64::try_from(table.len())
        .unwrap_or(u64::MAX)
        .saturating_mul(manager.page_size())
        .saturating_sub(table.tail_avail())
}

impl FlatCache {
    /// The slot of a token-level request (`UnknownSlot` if it holds none, `InvalidArgument`
    /// if its request is page-level).
    #[inline]
    pub(in crate::engine) fn token_slot(&self, method: &str, slot: u64) -> CoreResult<usize> {
        let at = self.held(method, slot)?;
        if self.entries[at].tokens.is_none() {
            return Err(page_level(method, self.id_ref_at(at)));
        }
        Ok(at)
    }

    /// Add a token-level request for `prompt` (non-empty; `req` must be new) in the lowest
    /// free slot. With caching on and `use_prefix_cache`, claims the capped prefix match and
    /// sets the computed tokens to the hit. Returns the slot and the hit; allocates nothing
    /// else. With rows bound, a request that would get no row is refused.
    pub fn add_request(
        &mut self,
        req: RequestIdRef<'_>,
        prompt: Prompt,
        use_prefix_cache: bool,
    ) -> CoreResult<(usize, u64)> {
        self.check_new_request("add_request", req, &prompt)?;
        self.check_slot_free("add_request")?;
        let m = self.claimable_match(&prompt, use_prefix_cache)?;
        self.add_matched(req, prompt, m)
    }

    /// Refuse, for `method`, a request that cannot be added: a prompt hashed for another base
    /// page size, an empty prompt (the arguments), or an id already in use (the cache's state).
    fn check_new_request(&self, method: &str, req: RequestIdRef<'_>, prompt: &Prompt) -> CoreResult<()> {
        self.check_prompt(prompt)?;
        if prompt.tokens.is_empty() {
            return Err(CoreError::invalid("prompt_token_ids must not be empty"));
        }
        if self.has_request(req) {
            return Err(CoreError::invalid(format!("{method}: request {req} already exists")));
        }
        Ok(())
    }

    /// The capped match a new request for `prompt` claims; `None` without the prefix cache
    /// (`use_prefix_cache` false, or caching off).
    fn claimable_match(&self, prompt: &Prompt, use_prefix_cache: bool) -> CoreResult<Option<PrefixMatch>> {
        if use_prefix_cache && self.coord.pool().caching_enabled() {
            self.capped_match(prompt).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Add the new request `req` (checked by the caller: new, non-empty prompt, a slot free)
    /// claiming `m`, a capped match made under the lock just now (`None`: no prefix cache).
    /// Returns the request's slot and the hit.
    fn add_matched(
        &mut self,
        req: RequestIdRef<'_>,
        prompt: Prompt,
        m: Option<PrefixMatch>,
    ) -> CoreResult<(usize, u64)> {
        let hit = m.as_ref().map_or(0, |m| m.num_common_tokens);
        let branch = self.branch_of(m.as_ref());
        let registered = usize::try_from(self.coord.base_div().quotient(hit)).unwrap_or(usize::MAX);
        let prompt_len = u64::try_from(prompt.tokens.len()).unwrap_or(u64::MAX);
        // The request's own growable copies, with room for some generated tokens so the
        // first appends do not reallocate a long prompt.
        let mut tokens = Vec::with_capacity(prompt.tokens.len().saturating_add(APPEND_HEADROOM));
        tokens.extend_from_slice(&prompt.tokens);
        let state = TokenState {
            tokens,
            hashes: prompt.hashes.to_vec(),
            extra_keys: prompt.extra_keys,
            computed: hit,
            registered,
            pending: 0,
            fast_until: 0,
            branch,
            prompt_len,
            step: None,
            decode_checkpoint: None,
            decode_since: None,
            decode_dated: false,
            decode_place: None,
            prompt_checkpoints: Vec::new(),
        };
        let at = self.insert(req, Some(state));
        if let (Some(m), Some(grain)) = (m.as_ref(), self.coord.state_grain()) {
            // SPEC 13.8: a full-attention match that stops before the capped prompt left a
            // cached path there (a divergence point): evidence of where prompts share.
            let base = self.coord.base_page_size();
            let cap = prompt_len.saturating_sub(1) / base * base;
            if self.coord.eviction_policy() == EvictionPolicy::Reuse && m.branch_tokens > 0 && m.branch_tokens < cap {
                self.coord.evidence_mut().observe(m.branch_tokens, grain);
            }
        }
        if let Some(m) = m {
            // A match just made under the lock is never stale and the tables are empty.
            let mut host_hit = 0;
            if self.coord.host().is_some() {
                host_hit = self.coord.host_hit_tokens(&m, hit);
                if let Err(e) = self.claim_with_loads(at, &m) {
                    self.release(at);
                    return Err(e);
                }
            } else {
                self.coord.claim(&mut self.entries[at].tables, &m);
            }
            // SPEC 13.8b (`reuse`): which checkpoint the prompt resumes at, and whether it
            // would have resumed deeper at a finish checkpoint that was not kept (a ghost).
            if self.coord.eviction_policy() == EvictionPolicy::Reuse {
                if let (Some(g), Some(grain)) = (self.coord.single_state_group(), self.coord.state_grain()) {
                    let slots = self.coord.state_slots();
                    self.coord.evidence_mut().decay(slots);
                    let base = self.coord.base_page_size();
                    let cap = prompt_len.saturating_sub(1);
                    let ghost = self.entries[at].tokens.as_ref().is_some_and(|state| {
                        self.coord
                            .evidence_mut()
                            .ghost_resumed(&state.hashes, hit, cap, grain, base)
                    });
                    // A prompt that a finish checkpoint not kept would have served deeper counts
                    // for the finish role, not for the checkpoint it fell back to.
                    if hit > 0 && !ghost {
                        let page = state_page(&self.coord, &self.entries[at].tables, g, hit);
                        self.coord.evidence_mut().resumed(page);
                    }
                }
            }
            let c = &mut self.counters;
            c.prefix_queries_tokens = c.prefix_queries_tokens.saturating_add(prompt_len);
            c.prefix_hits_tokens = c.prefix_hits_tokens.saturating_add(hit);
            c.host_hits_tokens = c.host_hits_tokens.saturating_add(host_hit);
            if hit > 0 && self.coord.state_grain().is_some() {
                c.checkpoints_hit = c.checkpoints_hit.saturating_add(1);
            }
        }
        Ok((at, hit))
    }

    /// SPEC 9 admission in one call, with one prefix match: the first chunk is the
    /// [`Self::next_chunk`] cut of the prompt after the capped hit, at most `max_new_tokens`
    /// (`min(len(prompt) - hit, max_new_tokens)` without state groups), plus one token of
    /// reserve when the chunk completes the prompt (the first decode's page). With rows
    /// bound and no row free, or if `pages_needed_to_admit(prompt, chunk, reserve)` exceeds
    /// `budget()`, nothing changes and the answer is `None`; otherwise the request is added
    /// exactly as `add_request` would and the answer is `(slot, hit, chunk)`. Scheduling the
    /// chunk is left to the caller (host-tier loads must be acknowledged first).
    pub fn admit(
        &mut self,
        req: RequestIdRef<'_>,
        prompt: Prompt,
        max_new_tokens: u64,
        use_prefix_cache: bool,
    ) -> CoreResult<Option<(usize, u64, u64)>> {
        self.check_new_request("admit", req, &prompt)?;
        if !self.slot_available() {
            return Ok(None);
        }
        let m = self.claimable_match(&prompt, use_prefix_cache)?;
        let hit = m.as_ref().map_or(0, |m| m.num_common_tokens);
        let len = u64::try_from(prompt.tokens.len()).unwrap_or(u64::MAX);
        // hit < len: the capped match never covers the last prompt token.
        let chunk = self.cut(hit, len, max_new_tokens, self.branch_of(m.as_ref()));
        let reserve = u64::from(hit + chunk == len);
        // chunk + reserve <= len <= usize::MAX, so the sum cannot overflow u64.
        let need = self.pages_to_admit(m.as_ref(), chunk + reserve, "max_new_tokens")?;
        if i128::from(need) > self.budget(None)? {
            return Ok(None);
        }
        // In arena mode the credit only estimates: a group's pages come from its own units.
        if self.coord.pool().is_arena() && !self.coord.fits_claim_then_acquire(m.as_ref(), chunk + reserve) {
            return Ok(None);
        }
        let (at, hit) = self.add_matched(req, prompt, m)?;
        Ok(Some((at, hit, chunk)))
    }

    /// Append newly known tokens to the requests in `slots`: slot `i` gets the next
    /// `counts[i]` tokens of `tokens` (one each when `counts` is `None`), in order; every base
    /// page that becomes full is hashed once, chained from the previous page's hash.
    /// Everything is validated first (lengths that do not add up, a slot that holds no
    /// token-level request): on error nothing has changed.
    pub fn append_tokens(&mut self, slots: &[u64], tokens: &[u32], counts: Option<&[u64]>) -> CoreResult<()> {
        check_append_lengths(slots.len(), "slots", tokens, counts)?;
        self.with_scratch(|this, at| {
            for &slot in slots {
                at.push(this.token_slot("append_tokens", slot)?);
            }
            this.append_positions(at, tokens, counts)
        })
    }

    /// Append to each request in the slots `at` its share of `tokens` (lengths checked).
    fn append_positions(&mut self, at: &[usize], tokens: &[u32], counts: Option<&[u64]>) -> CoreResult<()> {
        let mut start = 0usize;
        for (k, &i) in at.iter().enumerate() {
            // The counts add up to tokens.len() (checked), so each fits usize.
            let n = counts.map_or(1, |ns| usize::try_from(ns[k]).unwrap_or(usize::MAX));
            self.append_at(i, &tokens[start..start + n])?;
            start += n;
        }
        Ok(())
    }

    /// Run `f` with the cache's reusable vector of slots (emptied first), then keep the vector
    /// for the next batch call, so batch calls allocate nothing for it.
    fn with_scratch<R>(&mut self, f: impl FnOnce(&mut Self, &mut Vec<usize>) -> R) -> R {
        let mut at = std::mem::take(&mut self.scratch);
        at.clear();
        let result = f(self, &mut at);
        self.scratch = at;
        result
    }

    /// Append `tokens` to the token-level request in slot `at`.
    fn append_at(&mut self, at: usize, tokens: &[u32]) -> CoreResult<()> {
        let base = usize::try_from(self.coord.base_page_size()).unwrap_or(usize::MAX);
        let Some(state) = self.entries[at].tokens.as_mut() else {
            return Ok(());
        };
        if let [token] = tokens {
            state.tokens.push(*token); // a decode step's one token: no memcpy call
        } else {
            state.tokens.extend_from_slice(tokens);
        }
        // Hash each base page that is now full (a multiplication per append, not a division:
        // this runs for every request of every decode step).
        while (state.hashes.len() + 1).saturating_mul(base) <= state.tokens.len() {
            let i = state.hashes.len();
            let page = &state.tokens[i * base..(i + 1) * base];
            let prior: &[u8] = state.hashes.last().map_or(&[], |h| h.as_slice());
            let hash = hash_page(page, prior, &state.extra_keys)?;
            state.hashes.push(hash);
        }
        Ok(())
    }

    /// How many of its next known tokens the request in `slot` should schedule, at most
    /// `max_tokens`, so that state snapshots can be kept (SPEC 13.5a-b with today's snapshot
    /// grain): see `cut`. 0 when every known token is computed.
    pub fn next_chunk(&self, slot: u64, max_tokens: u64) -> CoreResult<u64> {
        let at = self.token_slot("next_chunk", slot)?;
        let Some(state) = self.entries[at].tokens.as_ref() else {
            return Ok(0);
        };
        let known = u64::try_from(state.tokens.len()).unwrap_or(u64::MAX);
        Ok(self.cut(state.computed, known, max_tokens, state.branch))
    }

    /// The tokens to schedule from position `c` of `known` known tokens, at most `max`.
    /// Without state groups: all that are left, up to `max`. With state groups, whose
    /// snapshots are kept only where a step ends on their grain `g` (the lcm of their page
    /// sizes): when the rest fits, it is cut at the last multiple of `g` before the last known
    /// token (the body, whose end is snapshotted; the tail follows next step); otherwise the
    /// chunk ends at the last multiple of `g` within `max`; when neither boundary lies ahead,
    /// no cut.
    ///
    /// A branch point `branch` (see [`Self::branch_of`]) comes first: while it lies ahead
    /// within `max` and before the last known token, the chunk ends there.
    fn cut(&self, c: u64, known: u64, max: u64, branch: u64) -> u64 {
        let rest = known.saturating_sub(c);
        let Some(grain) = self.coord.state_grain() else {
            return rest.min(max);
        };
        if branch > c && branch < known && branch - c <= max {
            return branch - c;
        }
        let end = if rest <= max {
            known.saturating_sub(1)
        } else {
            c.saturating_add(max)
        };
        // The body's end lies on the sharing grain (SPEC 13.8: the state grain under `lru`);
        // with none ahead the rest is one chunk. A chunk cut by the limit: on the state grain.
        let sharing = self.coord.sharing_grain().unwrap_or(grain);
        // Under `reuse` the body's end is written only while prompts resume there (SPEC 13.8b).
        if rest <= max
            && self.coord.eviction_policy() == EvictionPolicy::Reuse
            && !self.coord.evidence().writes_body_end()
        {
            return rest;
        }
        if rest <= max && sharing > grain {
            let body = end - end % sharing;
            return if body > c { body - c } else { rest };
        }
        let boundary = end - end % grain;
        match boundary.checked_sub(c) {
            Some(n) if n > 0 => n,
            _ => rest.min(max),
        }
    }

    /// The branch point of a request admitted with match `m` (SPEC 13.5c): the tokens its
    /// full-attention pages matched, aligned down to the state grain, when that is beyond the
    /// hit (a checkpoint was missing there); else 0. Always 0 without state groups.
    fn branch_of(&self, m: Option<&PrefixMatch>) -> u64 {
        match (m, self.coord.state_grain()) {
            (Some(m), Some(grain)) => {
                let branch = m.branch_tokens - m.branch_tokens % grain;
                if branch > m.num_common_tokens {
                    branch
                } else {
                    0
                }
            }
            _ => 0,
        }
    }

    /// Tokens computed so far by the token-level request in `slot`.
    pub fn num_computed_tokens(&self, slot: u64) -> CoreResult<u64> {
        let at = self.token_slot("num_computed_tokens", slot)?;
        Ok(self.entries[at].tokens.as_ref().map_or(0, |s| s.computed))
    }

    /// Tokens the token-level request in `slot` knows (prompt plus appended).
    pub fn num_tokens(&self, slot: u64) -> CoreResult<u64> {
        let at = self.token_slot("num_tokens", slot)?;
        Ok(self.entries[at]
            .tokens
            .as_ref()
            .map_or(0, |s| u64::try_from(s.tokens.len()).unwrap_or(u64::MAX)))
    }

    /// Schedule the next `ns[i]` known tokens of the request in `slots[i]`, in order, each at
    /// its own position `c`: register the full base pages below `c` not registered yet,
    /// reclaim slid-out pages at `c`, then acquire room for `c + n + lookahead` tokens all or
    /// nothing. On success the position moves to `c + n` and the request's reserve is
    /// released (with `register_on_schedule`, the full pages below `c + n` are registered
    /// then: same-step sharing); on `false` nothing is allocated and the position stays.
    /// Everything is validated first (a slot that holds no token-level request, host-tier
    /// loads in flight, more tokens than known counting repeats of a slot, `c + n +
    /// lookahead` past u64): on error nothing has changed.
    pub fn schedule(&mut self, slots: &[u64], ns: &[u64], lookahead: u64) -> CoreResult<Vec<bool>> {
        if slots.len() != ns.len() {
            return Err(CoreError::invalid(format!(
                "num_new_tokens has {} entries but slots has {}",
                ns.len(),
                slots.len()
            )));
        }
        if lookahead > 0 && self.coord.state_grain().is_some() {
            return Err(CoreError::invalid(format!(
                "schedule: lookahead must be 0 for a model with state groups (their state is kept \
                 only after computed tokens, SPEC 13.4), got {lookahead}"
            )));
        }
        self.with_scratch(|this, at| {
            if let Err(e) = this.validate_schedule(slots, ns, lookahead, at) {
                this.clear_pending(at);
                return Err(e);
            }
            this.schedule_validated(at, ns, lookahead)
        })
    }

    /// Forget the asks a refused validation left in `pending`.
    fn clear_pending(&mut self, at: &[usize]) {
        for &i in at {
            if let Some(s) = self.entries[i].tokens.as_mut() {
                s.pending = 0;
            }
        }
    }

    /// Schedule a validated batch in order (each request's `pending` is cleared as it comes).
    fn schedule_validated(&mut self, at: &[usize], ns: &[u64], lookahead: u64) -> CoreResult<Vec<bool>> {
        let mut out = Vec::with_capacity(at.len());
        for (k, (&i, &n)) in at.iter().zip(ns).enumerate() {
            if let Some(s) = self.entries[i].tokens.as_mut() {
                s.pending = 0;
            }
            match self.schedule_at(i, n, lookahead) {
                Ok(done) => out.push(done),
                Err(e) => {
                    self.clear_pending(&at[k..]);
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// Resolve and check the slots of a `schedule` call, leaving each request's cumulative
    /// ask in `pending`.
    fn validate_schedule(&mut self, slots: &[u64], ns: &[u64], lookahead: u64, at: &mut Vec<usize>) -> CoreResult<()> {
        const METHOD: &str = "schedule";
        for (&slot, &n) in slots.iter().zip(ns) {
            let i = self.token_slot(METHOD, slot)?;
            at.push(i);
            if self.entries[i].loading > 0 {
                self.check_loaded(METHOD, i)?;
            }
            let Some(s) = self.entries[i].tokens.as_mut() else {
                continue; // token_slot checked it
            };
            s.pending = s
                .pending
                .checked_add(n)
                .ok_or_else(|| CoreError::overflow("num_new_tokens"))?;
            if let Some(known) = exceeds_known(s, s.pending) {
                let (computed, pending) = (s.computed, s.pending);
                return Err(too_many_tokens(
                    METHOD,
                    &self.labeled(i),
                    "num_new_tokens",
                    pending,
                    computed,
                    known,
                ));
            }
            if lookahead > 0 {
                s.computed
                    .checked_add(s.pending)
                    .and_then(|t| t.checked_add(lookahead))
                    .ok_or_else(|| CoreError::overflow("lookahead"))?;
            }
        }
        Ok(())
    }

    /// One request's step of [`Self::schedule`], for a validated request in slot `at`; with
    /// one state group, the step's state slots are recorded for `state_slots`.
    fn schedule_at(&mut self, at: usize, n: u64, lookahead: u64) -> CoreResult<bool> {
        let Some(g) = self.coord.single_state_group() else {
            return self.schedule_tokens(at, n, lookahead);
        };
        let computed = |c: &Self| c.entries[at].tokens.as_ref().map_or(0, |s| s.computed);
        let read = state_page(&self.coord, &self.entries[at].tables, g, computed(self));
        let scheduled = self.schedule_tokens(at, n, lookahead)?;
        let write = state_page(&self.coord, &self.entries[at].tables, g, computed(self));
        if let Some(state) = self.entries[at].tokens.as_mut() {
            state.step = scheduled.then_some(StepSlots { n, read, write });
        }
        Ok(scheduled)
    }

    /// [`Self::schedule_at`] without the record.
    fn schedule_tokens(&mut self, at: usize, n: u64, lookahead: u64) -> CoreResult<bool> {
        let entry = &mut self.entries[at];
        let Some(state) = entry.tokens.as_mut() else {
            return Ok(false);
        };
        let c = state.computed;
        if c < state.fast_until {
            // Nothing to register or reclaim at c: if every group's last page has room, the
            // step only takes slots of it (what acquire does then), and no cell changes.
            let target = c.saturating_add(n).saturating_add(lookahead);
            let need = target.saturating_sub(allocated(&self.coord, &entry.tables));
            if entry.tables.iter().all(|t| need <= t.tail_avail) {
                for table in &mut entry.tables {
                    table.tail_avail -= need;
                }
                state.computed = c + n;
                self.reserved -= u128::from(std::mem::take(&mut entry.reserve));
                if self.register_on_schedule && self.register_scheduled(at)? {
                    let entry = &mut self.entries[at];
                    if let Some(state) = entry.tokens.as_mut() {
                        state.fast_until = fast_until(&self.coord, &entry.tables, state);
                    }
                }
                return Ok(true);
            }
        }
        let scheduled = self.schedule_slow(at, n, lookahead)?;
        if scheduled && self.register_on_schedule {
            self.register_scheduled(at)?;
        }
        let entry = &mut self.entries[at];
        if let Some(state) = entry.tokens.as_mut() {
            state.fast_until = fast_until(&self.coord, &entry.tables, state);
        }
        Ok(scheduled)
    }

    /// Same-step sharing ([`crate::engine::CacheOptions::register_on_schedule`]): after a
    /// successful schedule, register the full pages below the new position, which the coming
    /// forward writes, so a request admitted later in this step can hit them. Exact because
    /// every attention layer writes the step's K/V into the pages before its attention reads
    /// any (the option is off for models with state groups); a page the chunk fills only in
    /// part is not full yet and is not registered. Returns whether it registered a page
    /// (then `fast_until` must move on).
    fn register_scheduled(&mut self, at: usize) -> CoreResult<bool> {
        let entry = &mut self.entries[at];
        let Some(state) = entry.tokens.as_mut() else {
            return Ok(false);
        };
        let before = state.registered;
        register_computed(&mut self.coord, &entry.tables, state)?;
        Ok(state.registered != before)
    }

    /// [`Self::schedule_at`] the general way: register, reclaim, then acquire.
    fn schedule_slow(&mut self, at: usize, n: u64, lookahead: u64) -> CoreResult<bool> {
        let bound = self.rows.is_some();
        let entry = &mut self.entries[at];
        let Some(state) = entry.tokens.as_mut() else {
            return Ok(false);
        };
        register_computed(&mut self.coord, &entry.tables, state)?;
        let c = state.computed;
        // A bound row is visited by the next update only if a reclaim or an acquire changed
        // the tables (an acquire served by the last page's free slots changes no cell).
        let shape_before = bound.then(|| shape(&entry.tables));
        self.coord.reclaim(&mut entry.tables, c, self.eviction);
        date_decode_checkpoint(&mut self.coord, state);
        // Validated by the callers: c + n + lookahead fits u64.
        let target = c.saturating_add(n).saturating_add(lookahead);
        let need = target.saturating_sub(allocated(&self.coord, &entry.tables));
        let acquired = need > 0 && self.coord.acquire(&mut entry.tables, need);
        let changed = shape_before.is_some_and(|h| h != shape(&entry.tables));
        let scheduled = need == 0 || acquired;
        if scheduled {
            state.computed = c + n;
            self.reserved -= u128::from(std::mem::take(&mut entry.reserve));
        }
        if changed {
            self.touch_row(at);
        }
        Ok(scheduled)
    }

    /// Resolve the slots of a `finish` / `preempt` call: each held by a token-level request
    /// and listed once.
    fn check_release(&mut self, method: &str, slots: &[u64], at: &mut Vec<usize>) -> CoreResult<()> {
        for &slot in slots {
            let i = self.token_slot(method, slot)?;
            // Calls name a few requests; a repeat is found by a scan of the ones before.
            if at.contains(&i) {
                return Err(CoreError::invalid(format!("{method}: slot {slot} is listed twice")));
            }
            at.push(i);
        }
        Ok(())
    }

    /// For each request in `slots`: register its completed full pages, free everything in
    /// the eviction order, release its reserve and free its slot and id. Everything is
    /// validated first (a slot that holds no token-level request, a slot listed twice).
    pub fn finish(&mut self, slots: &[u64]) -> CoreResult<()> {
        self.release_slots(
            "finish",
            slots,
            |this, state| end_of_request(&mut this.coord, state),
            |_, _| {},
        )
    }

    /// [`Self::finish`], counted as one preemption per request; returns each request's whole
    /// token list (prompt plus generated), in order, to re-add for recompute.
    pub fn preempt(&mut self, slots: &[u64]) -> CoreResult<Vec<Vec<u32>>> {
        let mut out = Vec::with_capacity(slots.len());
        self.release_slots(
            "preempt",
            slots,
            |_, _| {},
            |this, tokens| {
                this.counters.preemptions = this.counters.preemptions.saturating_add(1);
                out.push(tokens);
            },
        )?;
        Ok(out)
    }

    /// Finish the requests in `slots` (validated first), handing each one's tokens to `then`.
    fn release_slots(
        &mut self,
        method: &str,
        slots: &[u64],
        mut released: impl FnMut(&mut Self, &TokenState),
        mut then: impl FnMut(&mut Self, Vec<u32>),
    ) -> CoreResult<()> {
        self.with_scratch(|this, at| {
            this.check_release(method, slots, at)?;
            for &i in at.iter() {
                let entry = &mut this.entries[i];
                if let Some(state) = entry.tokens.as_mut() {
                    register_computed(&mut this.coord, &entry.tables, state)?;
                }
                let state = this.release(i);
                if let Some(state) = state.as_ref() {
                    released(this, state);
                }
                then(this, state.map(|s| s.tokens).unwrap_or_default());
            }
            Ok(())
        })
    }
}

/// The tokens `state` knows, when `n` more from its position would be more than that.
#[inline]
fn exceeds_known(state: &TokenState, n: u64) -> Option<u64> {
    let known = u64::try_from(state.tokens.len()).unwrap_or(u64::MAX);
    match state.computed.checked_add(n) {
        Some(end) if end <= known => None,
        _ => Some(known),
    }
}

/// The error of a request `req` (as messages name it) asked for `n` tokens past `computed` of `known`.
fn too_many_tokens(
    method: &str,
    req: &dyn std::fmt::Display,
    arg: &str,
    n: u64,
    computed: u64,
    known: u64,
) -> CoreError {
    CoreError::invalid(format!(
        "{method}: {arg} = {n} for request {req} asks for more tokens than are known: {computed} computed of {known}"
    ))
}

/// Register the full base pages of a token-level request below its position that were not
/// registered yet (`end_tokens` = the position, so state groups snapshot on their page
/// boundary). The range starts at the last base page aligned to every group's fold width,
/// so a group wider than the base page sees its whole run; registering is idempotent, so the
/// overlap caches nothing twice.
fn register_computed(coord: &mut Coordinator, tables: &[Table], state: &mut TokenState) -> CoreResult<()> {
    if !coord.pool().caching_enabled() {
        return Ok(());
    }
    let full = usize::try_from(coord.base_div().quotient(state.computed))
        .map_or(state.hashes.len(), |f| f.min(state.hashes.len()));
    if full <= state.registered {
        return Ok(());
    }
    // lcm / base is a multiple of every group's fold width m_g (and fits usize: it is at
    // most the number of base pages in a group page).
    let step = usize::try_from(coord.lcm_page_size() / coord.base_page_size()).unwrap_or(usize::MAX);
    let first = state.registered - state.registered % step.max(1);
    let ctx = TokenContext {
        tokens: &state.tokens,
        hashes: &state.hashes,
        extra_keys: &state.extra_keys,
    };
    // State checkpoints where a step ended on the grain (SPEC 13.5a-c: chunk ends, the
    // body's end, branch points; 13.5d: in decode, the latest only). The prompt's end is one
    // only once a token follows it (a decode step or the finish of a request that sampled
    // one): then it is the state decode starts from, the first decode checkpoint.
    let decoding = state.computed >= state.prompt_len
        && u64::try_from(state.tokens.len()).map_or(true, |known| known > state.prompt_len);
    // SPEC 13.8b: under `reuse` a decode checkpoint is written only while finish checkpoints
    // are kept; one that would be released at the finish holds a state slot for the whole
    // decode and serves nothing.
    let writes = !decoding || coord.eviction_policy() != EvictionPolicy::Reuse || coord.evidence().keep_finish();
    let end_tokens = (writes && (state.computed != state.prompt_len || decoding)).then_some(state.computed);
    coord.register_with(
        tables,
        &state.hashes[first..full],
        u64::try_from(first).unwrap_or(u64::MAX),
        end_tokens,
        Some(ctx),
    )?;
    state.registered = full;
    if decoding {
        keep_latest_decode_checkpoint(coord, tables, state);
    } else if coord.eviction_policy() == EvictionPolicy::Reuse {
        note_prompt_checkpoint(coord, tables, state);
    }
    Ok(())
}

/// The checkpoint at the request's position, if its state page took a key: `(page, key)`.
fn checkpoint_at(coord: &Coordinator, tables: &[Table], state: &TokenState) -> Option<(u32, GroupKey)> {
    let g = coord.single_state_group()?;
    let page = state_page(coord, tables, g, state.computed);
    if page == NULL_PAGE {
        return None;
    }
    coord.pool().key_of(page).map(|&key| (page, key))
}

/// SPEC 13.8 (`reuse`): a checkpoint written while computing the prompt is remembered, for
/// its path to be kept at finish (whole hybrid prefixes).
fn note_prompt_checkpoint(coord: &mut Coordinator, tables: &[Table], state: &mut TokenState) {
    let Some((page, key)) = checkpoint_at(coord, tables, state) else {
        return;
    };
    if state
        .prompt_checkpoints
        .last()
        .is_none_or(|&(p, k, _)| (p, k) != (page, key))
    {
        state.prompt_checkpoints.push((page, key, state.computed));
        // SPEC 13.8b: the body end is the last multiple of `S` before the prompt's last token.
        let sharing = coord.sharing_grain().unwrap_or(1).max(1);
        let last = state.prompt_len.saturating_sub(1);
        let role = if state.computed == last - last % sharing {
            Role::Body
        } else if state.computed == state.branch {
            Role::Other
        } else {
            Role::Chunk
        };
        coord.evidence_mut().wrote(page, role);
        note_boundary(coord, state, key, false);
    }
}

/// SPEC 13.8b (`reuse`): remember the boundary of the checkpoint `key` at the request's
/// position, so that its eviction leaves a ghost.
fn note_boundary(coord: &mut Coordinator, state: &TokenState, key: GroupKey, finish: bool) {
    if let Some(hash) = boundary_hash(coord, state, state.computed) {
        coord.evidence_mut().note_boundary(key, hash, finish);
    }
}

/// The base-page hash that names a boundary at `tokens` (a multiple of the base page) of the
/// request's path: that of its last base page; `None` at 0 or past the hashes known.
fn boundary_hash(coord: &Coordinator, state: &TokenState, tokens: u64) -> Option<ContentHash> {
    let index = usize::try_from(tokens / coord.base_page_size()).ok()?;
    index.checked_sub(1).and_then(|i| state.hashes.get(i)).copied()
}

/// SPEC 13.8 (`reuse`), when a request finishes (its pages released): its finish checkpoint
/// and chunk ends are kept (evicted like a page, 13.7) while their role pays (13.8b), every
/// other checkpoint it wrote stays cached; with whole hybrid prefixes, its free
/// full-attention pages on no cached checkpoint's path lose their keys.
fn end_of_request(coord: &mut Coordinator, state: &TokenState) {
    // SPEC 13.8b: the finish checkpoint is one a request leaves, while finish checkpoints pay.
    if coord.eviction_policy() == EvictionPolicy::Reuse {
        let held = state
            .decode_checkpoint
            .filter(|(page, key)| coord.pool().key_of(*page) == Some(key));
        let keep = coord.evidence().keep_finish();
        match held {
            Some((page, _)) if keep => {
                coord.evidence_mut().wrote(page, Role::Finish);
                // Its request's finish is its first use: the newest in the eviction order.
                coord.date_checkpoint(page, None, None);
            }
            Some((page, key)) => {
                coord.drop_checkpoint(page, key);
                leave_ghost(coord, state);
            }
            // Decode wrote none while finish checkpoints were not kept (SPEC 13.8b).
            None if !keep && state.decode_checkpoint.is_none() => leave_ghost(coord, state),
            None => {}
        }
    }
    // SPEC 13.8b: its chunk-end checkpoints still cached are kept only while they pay.
    for &(page, key, _) in &state.prompt_checkpoints {
        if coord.pool().key_of(page) == Some(&key)
            && coord.evidence().is_chunk_end(page)
            && !coord.evidence_mut().keep_chunk_end()
        {
            coord.drop_checkpoint(page, key);
        }
    }
    if coord.whole_prefixes() {
        keep_whole_prefixes(coord, state);
    }
}

/// SPEC 13.8b (`reuse`): a finished request whose finish checkpoint was not kept leaves a
/// ghost at the boundary it would have had (the last multiple of the state grain within its
/// computed tokens, if decode reached one at or past the prompt's end), at most as many as the
/// pool has state pages.
fn leave_ghost(coord: &mut Coordinator, state: &TokenState) {
    let (Some(_), Some(grain)) = (coord.single_state_group(), coord.state_grain()) else {
        return;
    };
    let at = state.computed / grain * grain;
    let decoded = u64::try_from(state.tokens.len()).map_or(true, |known| known > state.prompt_len);
    if at == 0 || at < state.prompt_len || !decoded {
        return;
    }
    if let Some(hash) = boundary_hash(coord, state, at) {
        let capacity = coord.state_slots();
        coord.evidence_mut().left_ghost(hash, capacity);
    }
}

/// SPEC 13.8 (`reuse`, whole hybrid prefixes; `prefixes.rs`), at a request's finish:
/// remember the path of each of its checkpoints still cached (a prompt
/// checkpoint at `t` holds `[0, t)`; the decode checkpoint sits at the last multiple of the
/// state grain), then drop its free full-attention pages that no remembered path holds.
fn keep_whole_prefixes(coord: &mut Coordinator, state: &TokenState) {
    let base = coord.base_page_size();
    let pages = |tokens: u64| usize::try_from(tokens / base).unwrap_or(usize::MAX);
    let remember = |coord: &mut Coordinator, page: u32, key: GroupKey, tokens: u64| {
        if coord.pool().key_of(page) == Some(&key) {
            coord.remember_checkpoint(key, &state.hashes, pages(tokens));
        }
    };
    for &(page, key, tokens) in &state.prompt_checkpoints {
        remember(coord, page, key, tokens);
    }
    if let (Some((page, key)), Some(grain)) = (state.decode_checkpoint, coord.state_grain()) {
        remember(coord, page, key, state.computed / grain * grain);
    }
    coord.drop_unheld(&state.hashes);
}

/// The pool page of state group `g` holding the state after `computed` tokens: the page of
/// the last one's slot (0, the null page, before any token or where the table has a hole).
fn state_page(coord: &Coordinator, tables: &[Table], g: usize, computed: u64) -> u32 {
    let Some(last) = computed.checked_sub(1) else {
        return NULL_PAGE;
    };
    let slot = usize::try_from(coord.managers()[g].page().quotient(last)).unwrap_or(usize::MAX);
    tables[g].pages().get(slot).copied().unwrap_or(NULL_PAGE)
}

/// SPEC 13.5d: after a registration in decode, if the state page of the last computed token
/// took a key (a decode step ended on the grain), it is the request's decode checkpoint and
/// the previous one, no longer its latest, is dropped (when nobody else holds it).
fn keep_latest_decode_checkpoint(coord: &mut Coordinator, tables: &[Table], state: &mut TokenState) {
    let Some((page, key)) = checkpoint_at(coord, tables, state) else {
        return;
    };
    if coord.eviction_policy() == EvictionPolicy::Reuse && state.decode_checkpoint != Some((page, key)) {
        coord.evidence_mut().wrote(page, Role::Other);
        note_boundary(coord, state, key, true);
    }
    if let Some((old_page, old_key)) = state.decode_checkpoint.replace((page, key)) {
        if (old_page, old_key) != (page, key) {
            state.decode_dated = false;
            if coord.eviction_policy() == EvictionPolicy::Reuse && coord.pool().key_of(old_page) == Some(&old_key) {
                state.decode_place = coord.checkpoint_place(old_page);
            }
            coord.drop_checkpoint(old_page, old_key);
        }
    }
}

/// SPEC 13.8b (`reuse`, arena storage): a decode checkpoint serves no prompt while its request
/// decodes (the next one replaces it a grain on; a continuation resumes at the finish), so
/// writing it is no use of the cache: once free, each decode checkpoint after the first takes
/// the first one's eviction stamp, the request's decode start, and ages from there; a kept
/// finish checkpoint is dated at the finish ([`end_of_request`]).
fn date_decode_checkpoint(coord: &mut Coordinator, state: &mut TokenState) {
    if state.decode_dated || coord.eviction_policy() != EvictionPolicy::Reuse {
        return;
    }
    let Some((page, key)) = state.decode_checkpoint else {
        return;
    };
    if coord.pool().key_of(page) != Some(&key) {
        return;
    }
    let Some(stamp) = coord.checkpoint_stamp(page) else {
        return;
    };
    match state.decode_since {
        None => state.decode_since = Some(stamp),
        Some(since) => coord.date_checkpoint(page, Some(since), state.decode_place),
    }
    state.decode_dated = true;
}

/// The first position at which scheduling would register or reclaim something, given the
/// tables and registration progress now: registration waits for the next full base page,
/// and each windowed group for its next slid-out slot.
fn fast_until(coord: &Coordinator, tables: &[Table], state: &TokenState) -> u64 {
    let mut until = u64::MAX;
    if coord.pool().caching_enabled() {
        let next = u64::try_from(state.registered).map_or(u64::MAX, |r| r.saturating_add(1));
        until = next.saturating_mul(coord.base_page_size());
    }
    for (manager, table) in coord.managers().iter().zip(tables) {
        if let Some(due) = manager.reclaim_due(table) {
            until = until.min(due);
        }
    }
    until
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::calls::tables::TableOut;
    use crate::engine::coordinator::PrefixMatch;
    use crate::engine::events::KvEvent;
    use crate::engine::group::EvictionOrder;
    use crate::engine::group::GroupKind;
    use crate::engine::hash::fold_run;
    use crate::engine::hash::hash_pages;
    use crate::engine::hash::ContentHash;
    use crate::engine::testing::*;
    use crate::engine::CacheOptions;
    use std::sync::Arc;

    #[test]
    fn add_request_refuses_duplicates_and_empty_prompts_and_can_skip_the_cache() {
        let mut c = hybrid(64);
        run_and_finish(&mut c, A, toks(0..16));
        assert_eq!(add(&mut c, B, toks(0..16)), (0, 12));
        let again = prompt(&c, toks(0..16));
        assert!(matches!(
            c.add_request(B, again, true),
            Err(CoreError::InvalidArgument(_))
        ));
        let empty = prompt(&c, Vec::new());
        assert!(matches!(
            c.add_request(C, empty, true),
            Err(CoreError::InvalidArgument(_))
        ));
        assert!(!c.has_request(C));
        // The refused adds took no slot: C gets slot 1.
        let p = prompt(&c, toks(0..16));
        assert_eq!(c.add_request(C, p, false).unwrap(), (1, 0));
        // Only the cache-using add counted a query.
        let s = c.stats();
        assert_eq!((s.prefix_queries_tokens, s.prefix_hits_tokens), (16 + 16, 12));
        // A prompt hashed for another base page size is refused.
        let wrong = Prompt::new(toks(0..8), Vec::new(), 2).unwrap();
        assert!(c.add_request(RequestIdRef::Int(9), wrong, true).is_err());
        assert_eq!(c.num_requests(), 2);
        c.check_invariants().unwrap();
    }

    #[test]
    fn append_tokens_hashes_each_page_once_chained_like_hash_pages() {
        let mut c = hybrid(64);
        let extra = vec!["lora-1".to_owned()];
        let p = Prompt::new(toks(0..6), extra.clone(), 4).unwrap();
        let (at, _) = c.add_request(A, p, true).unwrap();
        let sa = u64::try_from(at).unwrap();
        for t in 6..23 {
            c.append_tokens(&[sa], &[t], None).unwrap();
        }
        append(&mut c, sa, &toks(23..30)).unwrap();
        let state = c.entries[at].tokens.as_ref().unwrap();
        assert_eq!(state.tokens, toks(0..30));
        assert_eq!(state.hashes, hash_pages(&toks(0..30), 4, &[], &extra).unwrap());
        assert_eq!(c.num_tokens(sa).unwrap(), 30);
    }

    /// The arguments of one `append_tokens` call.
    type BatchAppend<'a> = (&'a [u64], &'a [u32], Option<&'a [u64]>);

    #[test]
    fn append_tokens_is_per_slot_in_order_after_validating_all() {
        // Same operations twice: one batch call vs per-slot append_tokens calls.
        let tokens_of = |c: &FlatCache, r| {
            let at = c.find(r).unwrap();
            let s = c.entries[at].tokens.as_ref().unwrap();
            (s.tokens.clone(), s.hashes.clone())
        };
        let (mut one, mut batch) = (hybrid(64), hybrid(64));
        for c in [&mut one, &mut batch] {
            assert_eq!(add(c, A, toks(0..6)).0, 0);
            assert_eq!(add(c, B, toks(100..103)).0, 1);
        }
        let (sa, sb) = (0, 1);
        append(&mut one, sa, &[6]).unwrap();
        append(&mut one, sb, &[103]).unwrap();
        batch.append_tokens(&[sa, sb], &[6, 103], None).unwrap();
        // Counts: 3 for B, none for A, then 2 more for A (a repeated slot appends in order).
        append(&mut one, sb, &[104, 105, 106]).unwrap();
        append(&mut one, sa, &[7, 8]).unwrap();
        batch
            .append_tokens(&[sb, sa, sa], &[104, 105, 106, 7, 8], Some(&[3, 0, 2]))
            .unwrap();
        for r in [A, B] {
            assert_eq!(tokens_of(&one, r), tokens_of(&batch, r));
        }
        assert_eq!(tokens_of(&batch, A).0, toks(0..9));
        assert_eq!(
            tokens_of(&batch, A).1,
            hash_pages::<&str>(&toks(0..9), 4, &[], &[]).unwrap()
        );
        // Errors change nothing, even when an earlier request in the batch was fine.
        assert!(batch.acquire(C, 4).unwrap()); // a page-level request in slot 2
        let before = (tokens_of(&batch, A), tokens_of(&batch, B));
        let bad: [BatchAppend<'_>; 8] = [
            (&[sa, sb], &[1], None),                // one token per request
            (&[sa, sb], &[1, 2, 3], Some(&[1])),    // counts per request
            (&[sa, sb], &[1, 2, 3], Some(&[1, 1])), // counts add up to the tokens
            (&[sa, 3], &[1, 2], None),              // a never-used slot
            (&[sa, u64::MAX], &[1, 2], None),       // a huge slot
            (&[sa, 2], &[1, 2], None),              // a page-level request
            (&[sa, sb], &[1, 2, 3], Some(&[u64::MAX, 4])),
            (&[sa, sb], &[1, 2], Some(&[u64::MAX, 3])),
        ];
        for (slots, t, counts) in bad {
            assert!(batch.append_tokens(slots, t, counts).is_err());
        }
        assert_eq!(
            batch.append_tokens(&[sa, 3], &[1, 2], None),
            Err(CoreError::UnknownSlot {
                method: "append_tokens".into(),
                slot: 3
            })
        );
        assert!(matches!(
            batch.append_tokens(&[sa, 2], &[1, 2], None),
            Err(CoreError::InvalidArgument(m)) if m.contains("page-level")
        ));
        assert_eq!((tokens_of(&batch, A), tokens_of(&batch, B)), before);
        batch.append_tokens(&[], &[], None).unwrap();
        batch.append_tokens(&[], &[], Some(&[])).unwrap();
        batch.check_invariants().unwrap();
    }

    #[test]
    fn slots_are_the_lowest_free_ones_and_reused_after_finish_and_preempt() {
        let mut c = cache(vec![spec("full", GroupKind::Full, 4)], 64, CacheOptions::default());
        let (d, e) = (RequestIdRef::Str("d"), RequestIdRef::Str("e"));
        assert_eq!(add(&mut c, A, toks(0..20)), (0, 0));
        assert_eq!(add(&mut c, B, toks(100..120)), (1, 0));
        assert!(c.acquire(C, 4).unwrap()); // a page-level request takes a slot too
        assert_eq!(c.slot_of(C), Some(2));
        assert_eq!(add(&mut c, d, toks(200..204)).0, 3);
        // A batch by slots: repeats and order included.
        assert_eq!(c.schedule(&[1, 0, 1], &[1, 2, 3], 0).unwrap(), vec![true; 3]);
        assert_eq!(
            (c.num_computed_tokens(0).unwrap(), c.num_computed_tokens(1).unwrap()),
            (2, 4)
        );
        c.append_tokens(&[0, 1], &[7, 8], None).unwrap();
        assert_eq!((c.num_tokens(0).unwrap(), c.num_tokens(1).unwrap()), (21, 21));
        // Finish slot 1 and preempt slot 0: both are free; nothing else moves.
        c.finish(&[1]).unwrap();
        assert_eq!(c.slot_of(B), None);
        assert!(matches!(c.num_tokens(1), Err(CoreError::UnknownSlot { slot: 1, .. })));
        let tokens = c.preempt(&[0]).unwrap();
        assert_eq!(tokens, vec![[toks(0..20), vec![7]].concat()]);
        assert_eq!((c.slot_of(C), c.slot_of(d)), (Some(2), Some(3)));
        assert_eq!(c.num_tokens(3).unwrap(), 4);
        // The next adds take the lowest free slots: 0, then 1, then past the end.
        assert_eq!(add(&mut c, e, toks(300..305)).0, 0);
        // Slot 0 now holds a fresh request: nothing of A's.
        assert_eq!((c.num_computed_tokens(0).unwrap(), c.num_tokens(0).unwrap()), (0, 5));
        assert_eq!(add(&mut c, A, tokens[0].clone()).0, 1);
        assert_eq!(add(&mut c, B, toks(100..101)).0, 4);
        for (slot, id) in [(0, e), (1, A), (2, C), (3, d), (4, B)] {
            assert_eq!(c.id_of(slot).unwrap(), id);
            assert_eq!(c.slot_of(id), Some(usize::try_from(slot).unwrap()));
        }
        assert_eq!(c.slot_of(RequestIdRef::Str("zz")), None);
        // Several slots freed at once come back lowest first; a page-level free frees its
        // slot too.
        c.finish(&[3, 0]).unwrap();
        c.free(C).unwrap();
        let new: Vec<u64> = (10..14)
            .map(|i| add(&mut c, RequestIdRef::Int(i), toks(0..4)).0)
            .collect();
        assert_eq!(new, vec![0, 2, 3, 5]);
        assert_eq!(c.num_requests(), 6);
        c.check_invariants().unwrap();
        // Errors name the request in a slot by its id and slot.
        let err = c.schedule(&[1], &[100], 0).unwrap_err().to_string();
        assert!(err.contains("request 'a' (slot 1)"), "{err}");
    }

    #[test]
    fn unknown_slots_are_refused_naming_the_method_and_nothing_changes() {
        let mut c = hybrid(64);
        let sa = add(&mut c, A, toks(0..8)).0;
        let sb = add(&mut c, B, toks(0..8)).0;
        assert!(sched(&mut c, sa, 4, 0).unwrap());
        c.finish(&[sb]).unwrap(); // slot 1: free, below the slab's end
        let snapshot = |c: &FlatCache| {
            (
                free_list(c),
                c.page_ids(A).unwrap(),
                c.num_computed_tokens(sa).unwrap(),
                c.num_tokens(sa).unwrap(),
                c.stats(),
            )
        };
        let before = snapshot(&c);
        assert_eq!(
            c.schedule(&[sa, sb], &[1, 1], 0).unwrap_err().to_string(),
            "schedule: slot 1 holds no request"
        );
        // A free slot, a never-used one, one far past the end, the largest u64.
        for slot in [sb, 2, 1000, u64::MAX] {
            let unknown = |method: &str| CoreError::UnknownSlot {
                method: method.into(),
                slot,
            };
            assert_eq!(c.schedule(&[sa, slot], &[1, 1], 0), Err(unknown("schedule")));
            assert_eq!(
                c.append_tokens(&[sa, slot], &[1, 2], None),
                Err(unknown("append_tokens"))
            );
            assert_eq!(c.finish(&[sa, slot]), Err(unknown("finish")));
            assert_eq!(c.preempt(&[sa, slot]), Err(unknown("preempt")));
            assert_eq!(c.reserve(&[sa, slot], &[1, 1]), Err(unknown("reserve")));
            assert_eq!(c.num_computed_tokens(slot), Err(unknown("num_computed_tokens")));
            assert_eq!(c.num_tokens(slot), Err(unknown("num_tokens")));
            assert_eq!(c.reserved_pages(slot), Err(unknown("reserved_pages")));
            assert_eq!(c.budget(Some(slot)), Err(unknown("budget")));
            assert_eq!(c.id_of(slot), Err(unknown("id_of")));
            assert_eq!(c.page_ids_in(slot), Err(unknown("page_ids")));
            assert_eq!(c.tail_available_in(slot), Err(unknown("tail_available")));
            assert_eq!(c.pages_needed_in(4, Some(slot)), Err(unknown("pages_needed")));
            assert_eq!(c.loads_in_flight_in(slot), Err(unknown("loads_in_flight")));
            if crate::FLAT_KVCACHE {
                assert_eq!(c.block_tables_in(&[sa, slot]), Err(unknown("block_tables")));
                let (mut g0, mut g1) = (vec![7; 2 * 4], vec![7; 2 * 4]);
                let mut outs = [
                    TableOut {
                        data: &mut g0,
                        rows: 2,
                        cols: 4,
                    },
                    TableOut {
                        data: &mut g1,
                        rows: 2,
                        cols: 4,
                    },
                ];
                assert_eq!(
                    c.write_block_tables_in(&[sa, slot], &mut outs),
                    Err(unknown("block_tables"))
                );
                assert!(g0.iter().chain(&g1).all(|&v| v == 7));
            }
            assert_eq!(snapshot(&c), before);
        }
        // The slot-addressed reads answer for a held slot as the id-addressed ones do.
        assert_eq!(c.page_ids_in(sa).unwrap(), c.page_ids(A).unwrap());
        assert_eq!(c.tail_available_in(sa).unwrap(), c.tail_available(A).unwrap());
        assert_eq!(
            c.pages_needed_in(9, Some(sa)).unwrap(),
            c.pages_needed(9, Some(A)).unwrap()
        );
        assert_eq!(c.pages_needed_in(9, None).unwrap(), c.pages_needed(9, None).unwrap());
        if crate::FLAT_KVCACHE {
            assert_eq!(c.block_tables_in(&[sa]).unwrap(), c.block_tables(&[A]).unwrap());
        }
        c.check_invariants().unwrap();
    }

    #[test]
    fn finish_and_preempt_refuse_a_repeated_slot_and_change_nothing() {
        let mut c = hybrid(64);
        let sa = add(&mut c, A, toks(0..8)).0;
        let sb = add(&mut c, B, toks(100..110)).0;
        assert_eq!(c.schedule(&[sa, sb], &[8, 10], 0).unwrap(), vec![true, true]);
        c.reserve(&[sa], &[1]).unwrap();
        let snapshot = |c: &FlatCache| {
            (
                free_list(c),
                c.page_ids(A).unwrap(),
                c.page_ids(B).unwrap(),
                c.reserved_pages(sa).unwrap(),
                c.stats(),
            )
        };
        let before = snapshot(&c);
        assert_eq!(
            c.finish(&[sa, sb, sa]),
            Err(CoreError::invalid("finish: slot 0 is listed twice"))
        );
        assert_eq!(
            c.preempt(&[sb, sb]),
            Err(CoreError::invalid("preempt: slot 1 is listed twice"))
        );
        // Nothing was registered, freed or counted (no pages cached, no preemption).
        assert_eq!(snapshot(&c), before);
        assert_eq!((c.stats().pages_cached, c.stats().preemptions), (0, 0));
        assert!(c.has_request(A) && c.has_request(B));
        // Listed once each, in any order: each request's tokens, in the order given.
        let got = c.preempt(&[sb, sa]).unwrap();
        assert_eq!(got, vec![toks(100..110), toks(0..8)]);
        assert_eq!((c.num_requests(), c.stats().preemptions), (0, 2));
        assert_eq!(c.budget(None).unwrap(), 63);
        c.finish(&[]).unwrap();
        assert!(c.preempt(&[]).unwrap().is_empty());
        c.check_invariants().unwrap();
    }

    #[test]
    fn schedule_registers_then_reclaims_then_acquires() {
        // Sliding only, P = 4, W = 5: at c tokens, slots below (c - 4) // 4 slid out.
        let mut c = cache(vec![spec("swa", sw(5), 4)], 5, CacheOptions::default());
        let sa = add(&mut c, A, toks(0..16)).0;
        assert!(sched(&mut c, sa, 12, 0).unwrap()); // pages 1, 2, 3; c = 12
        assert_eq!(c.page_ids(A).unwrap(), vec![vec![1, 2, 3]]);
        assert_eq!(c.coordinator().pool().num_free(), 1);
        // At c = 12: register base pages 0..3 (all full), THEN reclaim slots below
        // (12 - 4) // 4 = 2, THEN acquire 4 more tokens (one page).
        assert!(sched(&mut c, sa, 4, 0).unwrap());
        assert_eq!(c.page_ids(A).unwrap(), vec![vec![0, 0, 3, 4]]);
        // The reclaimed pages were registered before they became holes: still cached and
        // free, evicted lowest slot first.
        let hashes = hash_pages::<&str>(&toks(0..16), 4, &[], &[]).unwrap();
        let pool = c.coordinator().pool();
        assert!(pool.is_cached(1).unwrap() && pool.is_cached(2).unwrap() && pool.is_cached(3).unwrap());
        assert_eq!(free_list(&c), vec![1, 2]);
        assert_eq!(pool.lookup(&crate::engine::hash::GroupKey::new(hashes[0], 0)), Some(1));
        c.check_invariants().unwrap();
    }

    #[test]
    fn reclaimed_pages_fund_the_same_steps_acquire() {
        // Pool of 3 real pages, W = 5, P = 4: the request needs a 4th page at c = 12, which
        // only exists because the step reclaims slots 0 and 1 first.
        let mut c = cache(vec![spec("swa", sw(5), 4)], 4, CacheOptions::default());
        let sa = add(&mut c, A, toks(0..16)).0;
        assert!(sched(&mut c, sa, 12, 0).unwrap());
        assert_eq!(c.coordinator().pool().num_free(), 0);
        assert!(sched(&mut c, sa, 4, 0).unwrap());
        assert_eq!(c.page_ids(A).unwrap(), vec![vec![0, 0, 3, 1]]);
    }

    #[test]
    fn next_chunk_ends_on_the_state_grain() {
        // Full P = 4 and state P = 8: snapshots are kept on multiples of 8.
        let mut c = cache(
            vec![spec("full", GroupKind::Full, 4), spec("st", GroupKind::State, 8)],
            64,
            CacheOptions::default(),
        );
        let (s, _) = add(&mut c, A, toks(0..30));
        // The rest fits: the body ends at 24 (the last multiple of 8 before token 29).
        assert_eq!(c.next_chunk(s, 100).unwrap(), 24);
        // A limit: the last boundary within it, or no cut when none lies ahead.
        assert_eq!(c.next_chunk(s, 20).unwrap(), 16);
        assert_eq!(c.next_chunk(s, 7).unwrap(), 7);
        assert_eq!(c.next_chunk(s, 0).unwrap(), 0);
        assert!(sched(&mut c, s, 24, 0).unwrap());
        assert_eq!(c.next_chunk(s, 100).unwrap(), 6); // the tail
        assert!(sched(&mut c, s, 6, 0).unwrap());
        assert_eq!(c.next_chunk(s, 100).unwrap(), 0);
        assert!(matches!(c.next_chunk(9, 1), Err(CoreError::UnknownSlot { .. })));
        // Without state groups: everything left, up to the limit.
        let mut plain = hybrid(64);
        let (s, _) = add(&mut plain, A, toks(0..30));
        assert_eq!(plain.next_chunk(s, 100).unwrap(), 30);
        assert_eq!(plain.next_chunk(s, 7).unwrap(), 7);
    }

    #[test]
    fn lookahead_reserves_slots_without_moving_the_position() {
        let mut c = hybrid(64);
        let sa = add(&mut c, A, toks(0..8)).0;
        assert!(sched(&mut c, sa, 4, 3).unwrap());
        // Room for 4 + 3 = 7 tokens: 2 pages per group; the position moved by 4 only.
        assert_eq!(c.num_computed_tokens(sa).unwrap(), 4);
        assert_eq!(c.tail_available(A).unwrap(), vec![1, 1]);
        let free = c.coordinator().pool().num_free();
        // The next 3 tokens fit in the room already there: nothing allocated.
        assert!(sched(&mut c, sa, 3, 0).unwrap());
        assert_eq!(c.coordinator().pool().num_free(), free);
        // n = 0 with a lookahead only reserves slots.
        assert!(sched(&mut c, sa, 0, 5).unwrap());
        assert_eq!(c.num_computed_tokens(sa).unwrap(), 7);
        assert_eq!(c.tail_available(A).unwrap(), vec![0, 0]);
        assert_eq!(c.coordinator().pool().num_free(), free - 2);
        // More tokens than known: an error, nothing changes.
        assert!(matches!(sched(&mut c, sa, 2, 0), Err(CoreError::InvalidArgument(_))));
        assert!(matches!(
            sched(&mut c, sa, 1, u64::MAX),
            Err(CoreError::Overflow { .. })
        ));
        assert_eq!(c.num_computed_tokens(sa).unwrap(), 7);
        c.check_invariants().unwrap();
    }

    #[test]
    fn failed_schedule_allocates_nothing_and_keeps_the_position() {
        let mut c = hybrid(5); // 4 real pages
        let sa = add(&mut c, A, toks(0..20)).0;
        assert!(sched(&mut c, sa, 4, 0).unwrap()); // 1 + 1 pages
        c.reserve(&[sa], &[4]).unwrap();
        let before = (c.page_ids(A).unwrap(), c.tail_available(A).unwrap(), free_list(&c));
        // 12 more tokens need 3 + 3 pages; 2 are free.
        assert!(!sched(&mut c, sa, 12, 0).unwrap());
        assert_eq!(
            (c.page_ids(A).unwrap(), c.tail_available(A).unwrap(), free_list(&c)),
            before
        );
        assert_eq!(c.num_computed_tokens(sa).unwrap(), 4);
        // The reserve stays on failure.
        assert_eq!(c.reserved_pages(sa).unwrap(), 2);
        c.check_invariants().unwrap();
    }

    #[test]
    fn schedule_is_all_or_nothing_per_slot_in_order() {
        let mut c = hybrid(9); // 8 real pages
        let slots: Vec<u64> = [(A, 8), (B, 24), (C, 4)]
            .into_iter()
            .map(|(req, len)| add(&mut c, req, toks(0..len)).0)
            .collect();
        assert_eq!(slots, vec![0, 1, 2]);
        // a: 8 tokens -> 2 + 2 pages (4 left); b: 24 -> 6 + 6, does not fit: nothing for b;
        // c: 4 -> 1 + 1 fits after b failed.
        let got = c.schedule(&slots, &[8, 24, 4], 0).unwrap();
        assert_eq!(got, vec![true, false, true]);
        assert_eq!(c.page_ids(B).unwrap(), vec![Vec::<u32>::new(), vec![]]);
        assert_eq!(
            c.page_ids(C).unwrap(),
            vec![vec![5], vec![6]],
            "c allocates in index order after a"
        );
        assert_eq!([0, 1, 2].map(|s| c.num_computed_tokens(s).unwrap()), [8, 0, 4]);
        // An empty call schedules nothing.
        assert!(c.schedule(&[], &[], 3).unwrap().is_empty());
        c.check_invariants().unwrap();
    }

    #[test]
    fn schedule_validates_everything_before_changing_anything() {
        let mut c = hybrid(64);
        let sa = add(&mut c, A, toks(0..8)).0;
        let sb = add(&mut c, B, toks(0..8)).0;
        assert!(c.acquire(C, 4).unwrap()); // a page-level request
        let sc = u64::try_from(c.slot_of(C).unwrap()).unwrap();
        assert_eq!((sa, sb, sc), (0, 1, 2));
        let before = (free_list(&c), c.page_ids(A).unwrap());
        assert!(matches!(
            c.schedule(&[sa, 9], &[1, 1], 0),
            Err(CoreError::UnknownSlot { slot: 9, .. })
        ));
        assert!(matches!(
            c.schedule(&[sa, sc], &[1, 1], 0),
            Err(CoreError::InvalidArgument(_))
        ));
        assert!(matches!(
            c.schedule(&[sa, sb], &[1, 9], 0),
            Err(CoreError::InvalidArgument(_))
        ));
        // A repeated slot counts its asks together: 5 + 5 > 8 known.
        assert!(matches!(
            c.schedule(&[sa, sa], &[5, 5], 0),
            Err(CoreError::InvalidArgument(_))
        ));
        assert_eq!(
            c.schedule(&[sa], &[1, 1], 0),
            Err(CoreError::invalid("num_new_tokens has 2 entries but slots has 1"))
        );
        assert!(matches!(
            c.schedule(&[sb, sa], &[1, 1], u64::MAX),
            Err(CoreError::Overflow { .. })
        ));
        assert_eq!((free_list(&c), c.page_ids(A).unwrap()), before);
        assert_eq!(c.num_computed_tokens(sa).unwrap(), 0);
        assert_eq!(c.num_computed_tokens(sb).unwrap(), 0);
        // The scratch counters were reset: the same batch within bounds now works.
        assert_eq!(c.schedule(&[sa, sa], &[4, 4], 0).unwrap(), vec![true, true]);
        assert_eq!(c.num_computed_tokens(sa).unwrap(), 8);
        // Token-level methods refuse page-level requests.
        assert!(matches!(sched(&mut c, sc, 0, 0), Err(CoreError::InvalidArgument(_))));
        assert!(matches!(c.num_tokens(sc), Err(CoreError::InvalidArgument(_))));
        assert!(matches!(c.num_computed_tokens(sc), Err(CoreError::InvalidArgument(_))));
        assert!(matches!(c.finish(&[sc]), Err(CoreError::InvalidArgument(_))));
        assert!(matches!(c.preempt(&[sc]), Err(CoreError::InvalidArgument(_))));
        assert!(matches!(append(&mut c, sc, &[1]), Err(CoreError::InvalidArgument(_))));
        assert!(c.has_request(C));
        // And page-level methods refuse token-level requests, naming the method and the
        // request; nothing changes (read-only page-level calls still answer).
        let before = (free_list(&c), c.page_ids(A).unwrap(), c.tail_available(A).unwrap());
        let refused = |r: CoreResult<bool>, method: &str| match r {
            Err(CoreError::InvalidArgument(m)) => {
                assert!(m.starts_with(method) && m.contains("request 'a' is token-level"), "{m}");
            }
            other => panic!("{method}: {other:?}"),
        };
        let none = PrefixMatch::empty(2);
        refused(c.acquire(A, 1), "acquire");
        refused(c.claim(A, &none).map(|()| true), "claim");
        refused(c.register(A, &[], 0, None).map(|()| true), "register");
        refused(c.reclaim(A, 8).map(|()| true), "reclaim");
        refused(c.free(A).map(|()| true), "free");
        refused(c.prefill_first_chunk(A, &none, 1), "prefill_first_chunk");
        refused(c.prefill_chunk(A, &[], 1, 8), "prefill_chunk");
        refused(c.decode_step(A, &[], 0, 1, 8), "decode_step");
        assert_eq!(
            (free_list(&c), c.page_ids(A).unwrap(), c.tail_available(A).unwrap()),
            before
        );
        assert!(c.pages_needed(4, Some(A)).is_ok() && c.pages_reclaimable(A, 8, true).is_ok());
        // The reserve-carrying calls take any live slot, page-level included.
        c.reserve(&[sc], &[4]).unwrap();
        assert_eq!(c.reserved_pages(sc).unwrap(), 2);
        assert!(c.budget(Some(sc)).is_ok());
        c.check_invariants().unwrap();
    }

    /// Full (g0) P = 2 and sliding (g1) P = 4 with a window that never slides here: a request
    /// of 8 tokens holds g0 pages [1, 2, 3, 4] (slot ends 2, 4, 6, 8) and g1 pages [5, 6]
    /// (slot ends 4, 8).
    fn two_sizes(order: EvictionOrder) -> FlatCache {
        let mut c = cache(
            vec![spec("full", GroupKind::Full, 2), spec("swa", sw(64), 4)],
            9,
            CacheOptions {
                eviction_order: order,
                // The pages are never registered: appended, they show the release order.
                reuse_uncached_first: false,
                ..CacheOptions::default()
            },
        );
        assert!(c.acquire(A, 8).unwrap());
        assert_eq!(c.page_ids(A).unwrap(), vec![vec![1, 2, 3, 4], vec![5, 6]]);
        c
    }

    #[test]
    fn hybrid_eviction_releases_by_slot_end_across_groups() {
        let mut c = two_sizes(EvictionOrder::Hybrid);
        c.free(A).unwrap();
        // Slot end 8: g0 page 4, then g1 page 6 (tie: lower group first); 6: page 3;
        // 4: g0 page 2, then g1 page 5; 2: page 1. The first released is evicted first.
        assert_eq!(free_list(&c), vec![7, 8, 4, 6, 3, 2, 5, 1]);
        let mut g = two_sizes(EvictionOrder::Group);
        g.free(A).unwrap();
        // The reference design: g0 tail first, then g1 tail first.
        assert_eq!(free_list(&g), vec![7, 8, 4, 3, 2, 1, 6, 5]);
    }

    #[test]
    fn hybrid_eviction_keeps_both_halves_of_a_prefix() {
        // Full P = 4 and sliding P = 4, W = 5 (a hit needs 1 sliding page at its boundary),
        // 8 pages. A 16-token request fills the pool (4 + 4 pages, all registered when it
        // finishes at c = 16). Then a page-level request takes `taken` pages (1 + 1 per 4
        // tokens), evicting the front of the free list, and a 17-token prompt (cap 4 pages)
        // is matched again.
        let hit_after = |order: EvictionOrder, tokens: u64| {
            let mut c = cache(
                vec![spec("full", GroupKind::Full, 4), spec("swa", sw(5), 4)],
                9,
                CacheOptions {
                    eviction_order: order,
                    ..CacheOptions::default()
                },
            );
            run_and_finish(&mut c, A, toks(0..16));
            assert!(c.acquire(B, tokens).unwrap());
            c.prefix_hit_tokens(&prompt(&c, toks(0..17))).unwrap()
        };
        // Hybrid free list: [f3, s3, f2, s2, f1, s1, f0, s0] (f = full, s = sliding, by slot).
        // Two pages evict f3, s3: full matches 3 pages, sliding hits slot 2: 12 tokens.
        // Four pages evict f3, s3, f2, s2: 8 tokens.
        assert_eq!(hit_after(EvictionOrder::Hybrid, 4), 12);
        assert_eq!(hit_after(EvictionOrder::Hybrid, 8), 8);
        // Group free list: [f3, f2, f1, f0, s3, s2, s1, s0]. Two pages evict f3, f2: 8 tokens
        // (while s3 and s2 linger, useless). Four pages evict the whole full prefix: 0.
        assert_eq!(hit_after(EvictionOrder::Group, 4), 8);
        assert_eq!(hit_after(EvictionOrder::Group, 8), 0);
    }

    #[test]
    fn preempt_returns_the_tokens_and_the_re_added_request_hits_its_prefix() {
        let mut c = hybrid(64);
        let sa = add(&mut c, A, toks(0..10)).0;
        assert!(sched(&mut c, sa, 10, 0).unwrap());
        for t in 10..14 {
            append(&mut c, sa, &[t]).unwrap();
            assert!(sched(&mut c, sa, 1, 0).unwrap());
        }
        c.reserve(&[sa], &[1]).unwrap();
        let tokens = preempt1(&mut c, sa).unwrap();
        assert_eq!(tokens, toks(0..14));
        assert!(!c.has_request(A));
        assert_eq!(c.stats().preemptions, 1);
        assert_eq!(c.budget(None).unwrap(), 63);
        // 14 tokens computed -> base pages 0..3 registered on preempt; the re-added request
        // matches (14 - 1) // 4 = 3 pages, in the slot the old one left.
        assert_eq!(add(&mut c, A, tokens), (sa, 12));
        assert_eq!(c.num_computed_tokens(sa).unwrap(), 12);
        c.check_invariants().unwrap();
    }

    fn events_cache() -> FlatCache {
        cache(
            vec![spec("full", GroupKind::Full, 4), spec("swa", sw(5), 4)],
            7,
            CacheOptions {
                enable_kv_events: true,
                ..CacheOptions::default()
            },
        )
    }

    #[test]
    fn events_record_stored_pages_with_tokens_and_parents() {
        let mut c = events_cache();
        let extra = vec!["salt".to_owned()];
        let p = Prompt::new(toks(0..13), extra.clone(), 4).unwrap();
        let sa = u64::try_from(c.add_request(A, p, true).unwrap().0).unwrap();
        let h = hash_pages(&toks(0..13), 4, &[], &extra).unwrap();
        assert!(sched(&mut c, sa, 8, 0).unwrap()); // nothing to register at c = 0
        assert!(c.take_events().is_empty());
        assert!(sched(&mut c, sa, 4, 0).unwrap()); // c = 8: registers base pages 0, 1
        let extra_keys: Arc<[String]> = Arc::from(extra);
        let stored = |hashes: Vec<ContentHash>, parent, tokens: Vec<u32>, group| KvEvent::Stored {
            hashes,
            parent,
            token_ids: tokens,
            group,
            extra_keys: Arc::clone(&extra_keys),
        };
        assert_eq!(
            c.take_events(),
            vec![
                stored(vec![h[0], h[1]], None, toks(0..8), 0),
                stored(vec![h[0], h[1]], None, toks(0..8), 1),
            ]
        );
        // c = 12: registers base page 2 (the parent is page 1's hash). The pool (6 pages) is
        // full, so the acquire of 1 + 1 pages is funded by reclaiming sliding slots 0 and 1
        // ((12 - 4) // 4 = 2), which evicts their keys: one BlockRemoved per allocation, g0's
        // (evicting slot 0) then g1's (evicting slot 1), both keys of group 1.
        append(&mut c, sa, &[13]).unwrap();
        assert!(sched(&mut c, sa, 1, 0).unwrap());
        assert_eq!(
            c.take_events(),
            vec![
                stored(vec![h[2]], Some(h[1]), toks(8..12), 0),
                stored(vec![h[2]], Some(h[1]), toks(8..12), 1),
                KvEvent::Removed {
                    hashes: vec![h[0]],
                    group: 1
                },
                KvEvent::Removed {
                    hashes: vec![h[1]],
                    group: 1
                },
            ]
        );
        assert!(c.take_events().is_empty());
    }

    #[test]
    fn events_record_evictions_per_allocation_and_group_then_clears() {
        let mut c = events_cache(); // 6 real pages
        run_and_finish(&mut c, A, toks(0..8)); // 2 + 2 pages, cached when finished
        let h = hash_pages::<&str>(&toks(0..8), 4, &[], &[]).unwrap();
        c.take_events();
        // Free list after a hybrid free: [5, 6, 2, 4, 1, 3] (5, 6 never used). Taking 4
        // pages for a page-level request: g0 takes 5, 6; g1 takes 2, 4 and evicts g0 slot 1
        // then g1 slot 1 (two events: one per evicted group, first-appearance order).
        assert!(c.acquire(B, 8).unwrap());
        assert_eq!(c.page_ids(B).unwrap(), vec![vec![5, 6], vec![2, 4]]);
        assert_eq!(
            c.take_events(),
            vec![
                KvEvent::Removed {
                    hashes: vec![h[1]],
                    group: 0
                },
                KvEvent::Removed {
                    hashes: vec![h[1]],
                    group: 1
                },
            ]
        );
        assert_eq!(c.stats().evictions, 2);
        // Page-level register: no tokens, no extra keys, the parent from the given hashes.
        let other = hash_pages::<&str>(&toks(100..108), 4, &[], &[]).unwrap();
        c.register(B, &other, 0, None).unwrap();
        let events = c.take_events();
        assert_eq!(events.len(), 2);
        assert!(
            matches!(&events[0], KvEvent::Stored { token_ids, parent: None, group: 0, extra_keys, .. }
            if token_ids.is_empty() && extra_keys.is_empty())
        );
        // reset_prefix_cache drops the free cached pages' keys (1 holds a's g0 slot 0, 3 its
        // g1 slot 0, in free-list order [1, 3]). B's four pages keep theirs, so the events
        // name exactly the dropped keys: one BlockRemoved per group, no AllBlocksCleared.
        assert_eq!(c.stats().pages_cached, 2 + 4);
        assert_eq!(c.reset_prefix_cache(), 2);
        assert_eq!(
            c.take_events(),
            vec![
                KvEvent::Removed {
                    hashes: vec![h[0]],
                    group: 0
                },
                KvEvent::Removed {
                    hashes: vec![h[0]],
                    group: 1
                },
            ]
        );
        assert_eq!(c.stats().pages_cached, 4);
        assert_eq!(c.stats().evictions, 2);
        assert_eq!(c.prefix_hit_tokens(&prompt(&c, toks(0..9))).unwrap(), 0);
        // Nothing left to drop while B runs: no key changes, no event.
        assert_eq!(c.reset_prefix_cache(), 0);
        assert!(c.take_events().is_empty());
        // Once B is freed no page is pinned: the reset drops its 4 keys and the cache is empty.
        c.free(B).unwrap();
        assert_eq!(c.reset_prefix_cache(), 4);
        assert_eq!(c.take_events(), vec![KvEvent::Cleared]);
        assert_eq!(c.stats().pages_cached, 0);
        c.check_invariants().unwrap();
    }

    #[test]
    fn events_off_records_nothing() {
        let mut c = hybrid(8);
        run_and_finish(&mut c, A, toks(0..8));
        assert!(c.acquire(B, 12).unwrap()); // 3 + 3 of 7 pages: evicts cached pages
        assert!(c.stats().evictions > 0);
        c.reset_prefix_cache();
        assert!(c.take_events().is_empty());
    }

    #[test]
    fn wide_groups_register_their_whole_runs_when_pages_complete_one_by_one() {
        // base 4 (g0), g1 P = 8 (m = 2) and a state group P = 8: decoding token by token,
        // g1's slot 0 folds base pages 0 and 1, registered once c reaches 8, although base
        // page 0 was registered on its own at c = 4.
        let mut c = cache(
            vec![
                spec("a", GroupKind::Full, 4),
                spec("b", GroupKind::Full, 8),
                spec("s", GroupKind::State, 8),
            ],
            64,
            CacheOptions::default(),
        );
        let sa = add(&mut c, A, toks(0..1)).0;
        assert!(sched(&mut c, sa, 1, 0).unwrap());
        for t in 1..17 {
            append(&mut c, sa, &[t]).unwrap();
            assert!(sched(&mut c, sa, 1, 0).unwrap());
        }
        let h = hash_pages::<&str>(&toks(0..17), 4, &[], &[]).unwrap();
        let pool = c.coordinator().pool();
        let ids = c.page_ids(A).unwrap();
        assert_eq!(
            pool.lookup(&crate::engine::hash::GroupKey::new(fold_run(&h[0..2]), 1)),
            Some(ids[1][0])
        );
        assert_eq!(
            pool.lookup(&crate::engine::hash::GroupKey::new(fold_run(&h[2..4]), 1)),
            Some(ids[1][1])
        );
        // Decode keeps only its latest checkpoint (SPEC 13.5d): the one at 8 was dropped when
        // the step that ended at 16 left one; the page of 16 stays while the step of token 16,
        // which reads it, runs in a new working page.
        assert_eq!(ids[2].len(), 3);
        assert_eq!(ids[2][0], 0);
        assert!(pool
            .lookup(&crate::engine::hash::GroupKey::new(fold_run(&h[0..2]), 2))
            .is_none());
        assert_eq!(
            pool.lookup(&crate::engine::hash::GroupKey::new(fold_run(&h[2..4]), 2)),
            Some(ids[2][1])
        );
        assert_ne!(ids[2][2], 0);
        // So a 17-token prompt sharing the 16 tokens resumes at 16: the next turn.
        c.finish(&[sa]).unwrap();
        assert_eq!(c.prefix_hit_tokens(&prompt(&c, toks(0..17))).unwrap(), 16);
        c.check_invariants().unwrap();
    }

    mod properties {
        use proptest::prelude::*;

        use super::*;

        #[derive(Clone, Debug)]
        enum Op {
            /// Add request `r` with `len` tokens of prompt family `p`.
            Add(u8, u8, u16),
            /// Append `k` generated tokens to `r`.
            Append(u8, u8),
            /// Schedule `n` of `r`'s known tokens with a lookahead.
            Schedule(u8, u16, u8),
            /// Schedule every live request for all its known tokens, in one batch.
            Batch,
            /// Reserve `t` tokens for `r`.
            Reserve(u8, u8),
            Finish(u8),
            /// Preempt `r` and re-add its tokens.
            Preempt(u8),
            /// A page-level acquire of `n` tokens on a token-level request.
            PageAcquire(u8, u8),
            /// Finish (or preempt) the live requests of a bit mask in one call.
            EndMany(u8, bool),
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                (0u8..4, 0u8..3, 1u16..80).prop_map(|(r, p, l)| Op::Add(r, p, l)),
                (0u8..4, 1u8..9).prop_map(|(r, k)| Op::Append(r, k)),
                // No lookahead: the model has a state group, which refuses it (SPEC 13.4).
                (0u8..4, 0u16..40).prop_map(|(r, n)| Op::Schedule(r, n, 0)),
                Just(Op::Batch),
                (0u8..4, 0u8..20).prop_map(|(r, t)| Op::Reserve(r, t)),
                (0u8..4).prop_map(Op::Finish),
                (0u8..4).prop_map(Op::Preempt),
                (0u8..4, 0u8..12).prop_map(|(r, n)| Op::PageAcquire(r, n)),
                (0u8..16, any::<bool>()).prop_map(|(m, p)| Op::EndMany(m, p)),
            ]
        }

        fn family(p: u8, len: u16) -> Vec<u32> {
            // Families 0 and 1 share their first 24 tokens.
            (0..u32::from(len))
                .map(|i| {
                    if p == 2 || (p == 1 && i >= 24) {
                        1000 * u32::from(p) + i
                    } else {
                        i
                    }
                })
                .collect()
        }

        proptest! {
            /// Random token-level traffic on a small hybrid pool (full P = 4, sliding P = 8,
            /// state P = 8; either eviction order; events on) keeps every invariant, the
            /// position never passes the known tokens, a failed schedule changes nothing, each
            /// new request takes the lowest free slot, and a refused finish / preempt (a slot
            /// listed twice) changes nothing. Sometimes without the state group and with
            /// same-step sharing (`register_on_schedule`).
            #[test]
            fn random_token_traffic_keeps_invariants(
                ops in proptest::collection::vec(op(), 1..60),
                hybrid_order in any::<bool>(),
                attention_only in any::<bool>(),
                register_on_schedule in any::<bool>(),
            ) {
                let order = if hybrid_order { EvictionOrder::Hybrid } else { EvictionOrder::Group };
                let mut specs = vec![spec("full", GroupKind::Full, 4), spec("swa", sw(10), 8)];
                if !attention_only {
                    specs.push(spec("st", GroupKind::State, 8));
                }
                let mut c = cache(
                    specs,
                    30,
                    CacheOptions {
                        eviction_order: order,
                        enable_kv_events: true,
                        register_on_schedule,
                        ..CacheOptions::default()
                    },
                );
                let ids: Vec<RequestIdRef<'static>> = (0..4).map(RequestIdRef::Int).collect();
                // The model: the slot of each id's live request.
                let mut slots: [Option<u64>; 4] = [None; 4];
                let lowest_free = |slots: &[Option<u64>; 4]| (0u64..=4).find(|s| !slots.contains(&Some(*s))).unwrap();
                let mut next_token = 5000u32;
                for op in ops {
                    match op {
                        Op::Add(r, p, len) => {
                            let r = usize::from(r);
                            if slots[r].is_none() {
                                let (slot, hit) = add(&mut c, ids[r], family(p, len));
                                prop_assert_eq!(slot, lowest_free(&slots));
                                slots[r] = Some(slot);
                                prop_assert!(hit < u64::from(len));
                                prop_assert_eq!(hit % c.coordinator().lcm_page_size(), 0);
                            }
                        }
                        Op::Append(r, k) => {
                            if let Some(slot) = slots[usize::from(r)] {
                                let new: Vec<u32> = (0..u32::from(k)).map(|i| next_token + i).collect();
                                next_token += u32::from(k);
                                append(&mut c, slot, &new).unwrap();
                            }
                        }
                        Op::Schedule(r, n, ahead) => {
                            let Some(slot) = slots[usize::from(r)] else {
                                continue;
                            };
                            let id = ids[usize::from(r)];
                            let left = c.num_tokens(slot).unwrap() - c.num_computed_tokens(slot).unwrap();
                            let n = u64::from(n).min(left);
                            let before = c.num_computed_tokens(slot).unwrap();
                            if sched(&mut c, slot, n, u64::from(ahead)).unwrap() {
                                prop_assert_eq!(c.num_computed_tokens(slot).unwrap(), before + n);
                                prop_assert_eq!(c.reserved_pages(slot).unwrap(), 0);
                            } else {
                                // Steps 1-2 may have run; a second failing try changes nothing.
                                let snap = (c.page_ids(id).unwrap(), c.tail_available(id).unwrap(), c.pool_stats());
                                prop_assert!(!sched(&mut c, slot, n, u64::from(ahead)).unwrap());
                                let again = (c.page_ids(id).unwrap(), c.tail_available(id).unwrap(), c.pool_stats());
                                prop_assert_eq!(snap, again);
                                prop_assert_eq!(c.num_computed_tokens(slot).unwrap(), before);
                            }
                        }
                        Op::Batch => {
                            let live: Vec<u64> = slots.iter().flatten().copied().collect();
                            let ns: Vec<u64> = live
                                .iter()
                                .map(|&s| c.num_tokens(s).unwrap() - c.num_computed_tokens(s).unwrap())
                                .collect();
                            let got = c.schedule(&live, &ns, 0).unwrap();
                            prop_assert_eq!(got.len(), live.len());
                            for ((&s, &n), ok) in live.iter().zip(&ns).zip(got) {
                                let done = c.num_computed_tokens(s).unwrap() == c.num_tokens(s).unwrap();
                                prop_assert!(!ok || done || n == 0);
                            }
                        }
                        Op::Reserve(r, t) => {
                            if let Some(slot) = slots[usize::from(r)] {
                                c.reserve(&[slot], &[u64::from(t)]).unwrap();
                            }
                        }
                        Op::Finish(r) => {
                            if let Some(slot) = slots[usize::from(r)].take() {
                                c.finish(&[slot]).unwrap();
                                prop_assert!(!c.has_request(ids[usize::from(r)]));
                            }
                        }
                        Op::Preempt(r) => {
                            let r = usize::from(r);
                            if let Some(slot) = slots[r] {
                                let tokens = preempt1(&mut c, slot).unwrap();
                                slots[r] = None;
                                // Re-added in the lowest free slot (this one, or a lower one).
                                let (again, _) = add(&mut c, ids[r], tokens);
                                prop_assert_eq!(again, lowest_free(&slots));
                                prop_assert!(again <= slot);
                                slots[r] = Some(again);
                            }
                        }
                        Op::EndMany(mask, preempt) => {
                            let picked: Vec<usize> = (0..4).filter(|&r| mask & (1 << r) != 0 && slots[r].is_some()).collect();
                            let listed: Vec<u64> = picked.iter().filter_map(|&r| slots[r]).collect();
                            if let Some(&first) = listed.first() {
                                // A slot listed twice: refused before anything changes.
                                let mut twice = listed.clone();
                                twice.push(first);
                                let snap = (c.num_requests(), c.pool_stats(), c.stats());
                                if preempt {
                                    prop_assert!(c.preempt(&twice).is_err());
                                } else {
                                    prop_assert!(c.finish(&twice).is_err());
                                }
                                prop_assert_eq!(snap, (c.num_requests(), c.pool_stats(), c.stats()));
                            }
                            let known: Vec<u64> = listed.iter().map(|&s| c.num_tokens(s).unwrap()).collect();
                            if preempt {
                                let got = c.preempt(&listed).unwrap();
                                let lens: Vec<u64> = got.iter().map(|t| u64::try_from(t.len()).unwrap()).collect();
                                prop_assert_eq!(lens, known);
                            } else {
                                c.finish(&listed).unwrap();
                            }
                            for r in picked {
                                slots[r] = None;
                                prop_assert!(!c.has_request(ids[r]));
                            }
                        }
                        Op::PageAcquire(r, n) => {
                            // A page-level call on a token-level request is refused and
                            // changes nothing.
                            let id = ids[usize::from(r)];
                            if c.has_request(id) {
                                let snap = (c.page_ids(id).unwrap(), c.tail_available(id).unwrap(), c.pool_stats());
                                let refused = c.acquire(id, u64::from(n));
                                prop_assert!(matches!(refused, Err(CoreError::InvalidArgument(_))));
                                let again = (c.page_ids(id).unwrap(), c.tail_available(id).unwrap(), c.pool_stats());
                                prop_assert_eq!(snap, again);
                            }
                        }
                    }
                    prop_assert_eq!(c.check_invariants(), Ok(()));
                    for (r, slot) in slots.iter().enumerate() {
                        let want = slot.map(|s| usize::try_from(s).unwrap());
                        prop_assert_eq!(c.slot_of(ids[r]), want);
                        if let Some(s) = *slot {
                            prop_assert_eq!(c.id_of(s).unwrap(), ids[r]);
                        }
                    }
                    let b = c.budget(None).unwrap();
                    prop_assert!(b <= i128::try_from(c.pool_stats().num_free).unwrap());
                }
                c.take_events();
                let live: Vec<u64> = slots.iter().flatten().copied().collect();
                c.finish(&live).unwrap();
                let s = c.stats();
                prop_assert_eq!((s.pages_in_use, s.requests), (0, 0));
                prop_assert_eq!(c.budget(None).unwrap(), 29);
                prop_assert_eq!(c.check_invariants(), Ok(()));
            }
        }
    }

    /// Same-step sharing (`register_on_schedule`): the hybrid example (full P = 4, sliding
    /// P = 4, W = 8) where a 16-token prompt is scheduled 10 tokens at a time. The pages
    /// `[0, 8)` are full after the first chunk, `[8, 12)` only in part, so a request added
    /// after that schedule hits 8 tokens (without the option: nothing, the pages register at
    /// the writer's next schedule). With a state group the option changes nothing.
    #[test]
    fn register_on_schedule_shares_the_pages_a_chunk_fills_in_the_same_step() {
        let on = CacheOptions {
            register_on_schedule: true,
            ..CacheOptions::default()
        };
        let specs = || vec![spec("full", GroupKind::Full, 4), spec("swa", sw(8), 4)];
        for (options, want) in [(CacheOptions::default(), 0), (on, 8)] {
            let mut c = cache(specs(), 64, options);
            let (sa, _) = add(&mut c, A, toks(0..16));
            assert!(sched(&mut c, sa, 10, 0).unwrap());
            let (sb, hit) = add(&mut c, B, toks(0..16));
            assert_eq!(hit, want);
            if want > 0 {
                // The same pages: the hitter reads what the writer's chunk writes.
                assert_eq!(c.page_ids(B).unwrap()[0], c.page_ids(A).unwrap()[0][..2].to_vec());
            }
            // The writer's next chunk (the fast path when its pages have room) registers
            // through page 3: a third request hits the cap, 12 tokens.
            assert!(sched(&mut c, sa, 6, 0).unwrap());
            let (_, third) = add(&mut c, C, toks(0..16));
            assert_eq!(third, if want > 0 { 12 } else { 8 });
            assert!(sched(&mut c, sb, 16 - hit, 0).unwrap());
            c.check_invariants().unwrap();
        }
        let mut state = cache(
            vec![spec("full", GroupKind::Full, 4), spec("st", GroupKind::State, 4)],
            64,
            on,
        );
        let (sa, _) = add(&mut state, A, toks(0..16));
        assert!(sched(&mut state, sa, 8, 0).unwrap());
        assert_eq!(add(&mut state, B, toks(0..16)).1, 0);
        state.check_invariants().unwrap();
    }
}
