//! Token-level requests (docs/requests-api.md; SPEC 8, 9, 12.4): requests that own their
//! tokens and content hashes, and the scheduler-loop calls (add, append, schedule, finish,
//! preempt).
//!
//! A token-level request keeps its tokens, the chained hash of every full base page (each
//! hashed once, when it fills: SPEC 12.4), how many tokens are computed, and how many base
//! pages have been registered. Its tables are the same per-group tables page-level requests
//! use, and "allocated tokens" is read off them (claimed plus acquired tokens, the same in
//! every group), so page-level calls on a token-level request cannot desynchronise it.

use super::coordinator::{Coordinator, PrefixMatch, TokenContext};
use super::hash::hash_page;
use super::ids::RequestIdRef;
use super::table::Table;
use super::tokens::{Prompt, TokenState};
use super::{FlatCache, Lookup};
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
    /// The slab position of a token-level request, by id or handle (`KeyError` if unknown,
    /// `ValueError` if page-level).
    #[inline]
    fn find_token<'r>(&self, method: &str, req: impl Into<Lookup<'r>>) -> CoreResult<usize> {
        let req = req.into();
        let at = self.locate(req)?;
        if self.entries[at].tokens.is_none() {
            return Err(page_level(method, self.lookup_id(req, at)));
        }
        Ok(at)
    }

    /// Add a token-level request for `prompt` (non-empty; `req` must be new). With caching
    /// on and `use_prefix_cache`, claims the capped prefix match; sets the computed tokens to
    /// the hit and returns it. Allocates nothing else.
    pub fn add_request(&mut self, req: RequestIdRef<'_>, prompt: Prompt, use_prefix_cache: bool) -> CoreResult<u64> {
        self.check_new_request("add_request", req, &prompt)?;
        let m = self.claimable_match(&prompt, use_prefix_cache)?;
        self.add_matched(req, prompt, m).map(|(hit, _)| hit)
    }

    /// Refuse, for `method`, a request that cannot be added: a prompt hashed for another base
    /// page size, an id already in use, or an empty prompt.
    fn check_new_request(&self, method: &str, req: RequestIdRef<'_>, prompt: &Prompt) -> CoreResult<()> {
        self.check_prompt(prompt)?;
        if self.has_request(req) {
            return Err(CoreError::invalid(format!("{method}: request {req} already exists")));
        }
        if prompt.tokens.is_empty() {
            return Err(CoreError::invalid("prompt_token_ids must not be empty"));
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

    /// Add the new request `req` (checked by the caller: new, non-empty prompt) claiming
    /// `m`, a capped match made under the lock just now (`None`: no prefix cache). Returns
    /// the hit and the request's slab position.
    fn add_matched(
        &mut self,
        req: RequestIdRef<'_>,
        prompt: Prompt,
        m: Option<PrefixMatch>,
    ) -> CoreResult<(u64, usize)> {
        let hit = m.as_ref().map_or(0, |m| m.num_common_tokens);
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
        };
        let at = self.insert(req, Some(state));
        if let Some(m) = m {
            // A match just made under the lock is never stale and the tables are empty.
            let mut host_hit = 0;
            if self.coord.host().is_some() {
                host_hit = self.coord.host_hit_tokens(&m, hit);
                if let Err(e) = self.claim_with_loads(at, &m) {
                    self.release(req, at);
                    return Err(e);
                }
            } else {
                self.coord.claim(&mut self.entries[at].tables, &m);
            }
            let c = &mut self.counters;
            c.prefix_queries_tokens = c.prefix_queries_tokens.saturating_add(prompt_len);
            c.prefix_hits_tokens = c.prefix_hits_tokens.saturating_add(hit);
            c.host_hits_tokens = c.host_hits_tokens.saturating_add(host_hit);
        }
        Ok((hit, at))
    }

    /// SPEC 9 admission in one call, with one prefix match: the first chunk is
    /// `min(len(prompt) - hit, max_new_tokens)` tokens after the capped hit, plus one token
    /// of reserve when the chunk completes the prompt (the first decode's page). If
    /// `pages_needed_to_admit(prompt, chunk, reserve)` exceeds `budget()` nothing changes and
    /// the answer is `None`; otherwise the request is added exactly as `add_request` would
    /// (in `row`, if given) and the answer is `(hit, chunk)`. Scheduling the chunk is left to
    /// the caller (host-tier loads must be acknowledged first).
    pub fn admit(
        &mut self,
        req: RequestIdRef<'_>,
        prompt: Prompt,
        max_new_tokens: u64,
        use_prefix_cache: bool,
        row: Option<usize>,
    ) -> CoreResult<Option<(u64, u64)>> {
        // In add_request_in_row's order: the row, then the request.
        if let Some(row) = row {
            self.check_row_free(row)?;
        }
        self.check_new_request("admit", req, &prompt)?;
        let m = self.claimable_match(&prompt, use_prefix_cache)?;
        let hit = m.as_ref().map_or(0, |m| m.num_common_tokens);
        let len = u64::try_from(prompt.tokens.len()).unwrap_or(u64::MAX);
        // hit < len: the capped match never covers the last prompt token.
        let chunk = (len - hit).min(max_new_tokens);
        let reserve = u64::from(hit + chunk == len);
        // chunk + reserve <= len <= usize::MAX, so the sum cannot overflow u64.
        let need = self.pages_to_admit(m.as_ref(), chunk + reserve, "max_new_tokens")?;
        if i128::from(need) > self.budget(None)? {
            return Ok(None);
        }
        let (hit, at) = self.add_matched(req, prompt, m)?;
        if let Some(row) = row {
            self.assign_row(at, row);
        }
        Ok(Some((hit, chunk)))
    }

    /// [`Self::add_request`], giving the new request persistent row `row` of the bound
    /// tables ([`super::rows`]); a row past the bound rows or held by another request is an
    /// error and nothing is added.
    pub fn add_request_in_row(
        &mut self,
        req: RequestIdRef<'_>,
        prompt: Prompt,
        use_prefix_cache: bool,
        row: usize,
    ) -> CoreResult<u64> {
        self.check_row_free(row)?;
        let hit = self.add_request(req, prompt, use_prefix_cache)?;
        let at = self.find(req)?;
        self.assign_row(at, row);
        Ok(hit)
    }

    /// Append newly known tokens to a token-level request; every base page that becomes full
    /// is hashed once, chained from the previous page's hash.
    pub fn append_tokens(&mut self, req: RequestIdRef<'_>, tokens: &[u32]) -> CoreResult<()> {
        let at = self.find_token("append_tokens", req)?;
        self.append_at(at, tokens)
    }

    /// Append newly known tokens to many token-level requests in one call: request `i` gets
    /// the next `counts[i]` tokens of `tokens` (one each when `counts` is `None`), exactly as
    /// [`Self::append_tokens`] would, in order. Everything is validated first (unknown id,
    /// page-level request, lengths that do not add up): on error nothing has changed.
    ///
    /// `reqs` holds ids ([`RequestIdRef`]) or [`Lookup`]s (ids or handles, which skip the
    /// lookup).
    pub fn append_tokens_batch<'r, L: Into<Lookup<'r>> + Copy>(
        &mut self,
        reqs: &[L],
        tokens: &[u32],
        counts: Option<&[u64]>,
    ) -> CoreResult<()> {
        const METHOD: &str = "append_tokens_batch";
        check_append_lengths(reqs.len(), "reqs", tokens, counts)?;
        self.with_scratch(|this, at| {
            for &req in reqs {
                at.push(this.find_token(METHOD, req)?);
            }
            this.append_positions(at, tokens, counts)
        })
    }

    /// [`Self::append_tokens_batch`] addressed by persistent rows ([`super::rows`]): the
    /// request holding `rows[i]` gets the next `counts[i]` tokens (one each without
    /// `counts`). A row that holds no request is an error; on error nothing has changed.
    pub fn append_tokens_rows(&mut self, rows: &[u64], tokens: &[u32], counts: Option<&[u64]>) -> CoreResult<()> {
        check_append_lengths(rows.len(), "rows", tokens, counts)?;
        self.with_scratch(|this, at| {
            for &row in rows {
                at.push(this.row_owner("append_tokens_rows", row)?);
            }
            this.append_positions(at, tokens, counts)
        })
    }

    /// Append to each request at the slab positions `at` its share of `tokens` (lengths checked).
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

    /// Run `f` with the cache's reusable vector of slab positions (emptied first), then keep
    /// the vector for the next batch call, so batch calls allocate nothing for it.
    fn with_scratch<R>(&mut self, f: impl FnOnce(&mut Self, &mut Vec<usize>) -> R) -> R {
        let mut at = std::mem::take(&mut self.scratch);
        at.clear();
        let result = f(self, &mut at);
        self.scratch = at;
        result
    }

    /// [`Self::append_tokens`] for the token-level request at slab position `at`.
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

    /// Tokens computed so far by a token-level request.
    pub fn num_computed_tokens(&self, req: RequestIdRef<'_>) -> CoreResult<u64> {
        let at = self.find_token("num_computed_tokens", req)?;
        Ok(self.entries[at].tokens.as_ref().map_or(0, |s| s.computed))
    }

    /// Tokens a token-level request knows (prompt plus appended).
    pub fn num_tokens(&self, req: RequestIdRef<'_>) -> CoreResult<u64> {
        let at = self.find_token("num_tokens", req)?;
        Ok(self.entries[at]
            .tokens
            .as_ref()
            .map_or(0, |s| u64::try_from(s.tokens.len()).unwrap_or(u64::MAX)))
    }

    /// Schedule the next `n` known tokens of a token-level request at its own position `c`:
    /// register the full base pages below `c` not registered yet, reclaim slid-out pages at
    /// `c`, then acquire room for `c + n + lookahead` tokens all or nothing. On success the
    /// position moves to `c + n` and the request's reserve is released; on `false` nothing is
    /// allocated and the position stays. `n + c > num_tokens` is an error.
    pub fn schedule(&mut self, req: RequestIdRef<'_>, n: u64, lookahead: u64) -> CoreResult<bool> {
        let at = self.find_token("schedule", req)?;
        self.check_loaded("schedule", req, at)?;
        if let Some(s) = &self.entries[at].tokens {
            check_known("schedule", req, s, n, "num_new_tokens")?;
            n.checked_add(s.computed)
                .and_then(|t| t.checked_add(lookahead))
                .ok_or_else(|| CoreError::overflow("lookahead"))?;
        }
        self.schedule_at(at, n, lookahead)
    }

    /// Schedule every request of a batch like [`Self::schedule`] (no lookahead), in order.
    /// Everything is validated first (unknown id, page-level request, more tokens than known
    /// counting repeats of a request): on error nothing has changed.
    ///
    /// `reqs` holds ids ([`RequestIdRef`]) or [`Lookup`]s (ids or handles, which skip the
    /// lookup).
    pub fn schedule_batch<'r, L: Into<Lookup<'r>> + Copy>(&mut self, reqs: &[L], ns: &[u64]) -> CoreResult<Vec<bool>> {
        if reqs.len() != ns.len() {
            return Err(CoreError::invalid(format!(
                "num_new_tokens has {} entries but reqs has {}",
                ns.len(),
                reqs.len()
            )));
        }
        self.with_scratch(|this, at| {
            if let Err(e) = this.validate_batch(reqs, ns, at) {
                this.clear_pending(at);
                return Err(e);
            }
            this.schedule_validated(at, ns)
        })
    }

    /// [`Self::schedule_batch`] addressed by persistent rows ([`super::rows`]): the request
    /// holding `rows[i]` schedules `ns[i]` tokens. No id is looked up. A row that holds no
    /// request is an error; on error nothing has changed.
    pub fn schedule_rows(&mut self, rows: &[u64], ns: &[u64]) -> CoreResult<Vec<bool>> {
        if rows.len() != ns.len() {
            return Err(CoreError::invalid(format!(
                "num_new_tokens has {} entries but rows has {}",
                ns.len(),
                rows.len()
            )));
        }
        self.with_scratch(|this, at| {
            if let Err(e) = this.validate_rows(rows, ns, at) {
                this.clear_pending(at);
                return Err(e);
            }
            this.schedule_validated(at, ns)
        })
    }

    /// Forget the asks a refused batch validation left in `pending`.
    fn clear_pending(&mut self, at: &[usize]) {
        for &i in at {
            if let Some(s) = self.entries[i].tokens.as_mut() {
                s.pending = 0;
            }
        }
    }

    /// Schedule a validated batch in order (each request's `pending` is cleared as it comes).
    fn schedule_validated(&mut self, at: &[usize], ns: &[u64]) -> CoreResult<Vec<bool>> {
        let mut out = Vec::with_capacity(at.len());
        for (k, (&i, &n)) in at.iter().zip(ns).enumerate() {
            if let Some(s) = self.entries[i].tokens.as_mut() {
                s.pending = 0;
            }
            match self.schedule_at(i, n, 0) {
                Ok(done) => out.push(done),
                Err(e) => {
                    self.clear_pending(&at[k..]);
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// [`Self::validate_batch`] for rows.
    fn validate_rows(&mut self, rows: &[u64], ns: &[u64], at: &mut Vec<usize>) -> CoreResult<()> {
        for (&row, &n) in rows.iter().zip(ns) {
            let i = self.row_owner("schedule_rows", row)?;
            at.push(i);
            if self.entries[i].loading > 0 {
                if let Some(req) = self.id_ref_at(i) {
                    self.check_loaded("schedule_rows", req, i)?;
                }
            }
            let Some(s) = self.entries[i].tokens.as_mut() else {
                return Err(CoreError::invalid(format!(
                    "schedule_rows: row {row} holds a page-level request"
                )));
            };
            s.pending = s
                .pending
                .checked_add(n)
                .ok_or_else(|| CoreError::overflow("num_new_tokens"))?;
            if let Some(known) = exceeds_known(s, s.pending) {
                let (computed, pending) = (s.computed, s.pending);
                // The id is looked up (a scan) only for the message.
                let req = format!("{} (row {row})", self.id_at(i));
                return Err(too_many_tokens(
                    "schedule_rows",
                    &req,
                    "num_new_tokens",
                    pending,
                    computed,
                    known,
                ));
            }
        }
        Ok(())
    }

    /// Resolve and check a batch, leaving each request's cumulative ask in `pending`.
    fn validate_batch<'r, L: Into<Lookup<'r>> + Copy>(
        &mut self,
        reqs: &[L],
        ns: &[u64],
        at: &mut Vec<usize>,
    ) -> CoreResult<()> {
        const METHOD: &str = "schedule_batch";
        for (&req, &n) in reqs.iter().zip(ns) {
            let req = req.into();
            let i = self.find_token(METHOD, req)?;
            at.push(i);
            if self.entries[i].loading > 0 {
                self.check_loaded(METHOD, self.lookup_id(req, i), i)?;
            }
            let Some(s) = self.entries[i].tokens.as_mut() else {
                continue; // find_token checked it
            };
            s.pending = s
                .pending
                .checked_add(n)
                .ok_or_else(|| CoreError::overflow("num_new_tokens"))?;
            if let Some(known) = exceeds_known(s, s.pending) {
                let (computed, pending) = (s.computed, s.pending);
                let req = self.lookup_id(req, i);
                return Err(too_many_tokens(
                    METHOD,
                    &req,
                    "num_new_tokens",
                    pending,
                    computed,
                    known,
                ));
            }
        }
        Ok(())
    }

    /// The step of [`Self::schedule`] for a validated request at slab position `at`.
    fn schedule_at(&mut self, at: usize, n: u64, lookahead: u64) -> CoreResult<bool> {
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
                return Ok(true);
            }
        }
        let scheduled = self.schedule_slow(at, n, lookahead)?;
        let entry = &mut self.entries[at];
        if let Some(state) = entry.tokens.as_mut() {
            state.fast_until = fast_until(&self.coord, &entry.tables, state);
        }
        Ok(scheduled)
    }

    /// [`Self::schedule_at`] the general way: register, reclaim, then acquire.
    fn schedule_slow(&mut self, at: usize, n: u64, lookahead: u64) -> CoreResult<bool> {
        let entry = &mut self.entries[at];
        let Some(state) = entry.tokens.as_mut() else {
            return Ok(false);
        };
        register_computed(&mut self.coord, &entry.tables, state)?;
        let c = state.computed;
        // A bound row is visited by the next update only if a reclaim or an acquire changed
        // the tables (an acquire served by the last page's free slots changes no cell).
        let shape_before = entry.row.map(|_| shape(&entry.tables));
        self.coord.reclaim(&mut entry.tables, c);
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

    /// Register a token-level request's completed full pages, free everything in the
    /// eviction order, release its reserve and forget it.
    pub fn finish(&mut self, req: RequestIdRef<'_>) -> CoreResult<()> {
        self.finish_or_preempt("finish", req).map(|_| ())
    }

    /// [`Self::finish`], counted as a preemption; returns the request's whole token list
    /// (prompt plus generated) to re-add for recompute.
    pub fn preempt(&mut self, req: RequestIdRef<'_>) -> CoreResult<Vec<u32>> {
        let tokens = self.finish_or_preempt("preempt", req)?;
        self.counters.preemptions = self.counters.preemptions.saturating_add(1);
        Ok(tokens)
    }

    fn finish_or_preempt(&mut self, method: &str, req: RequestIdRef<'_>) -> CoreResult<Vec<u32>> {
        let at = self.find_token(method, req)?;
        let entry = &mut self.entries[at];
        if let Some(state) = entry.tokens.as_mut() {
            register_computed(&mut self.coord, &entry.tables, state)?;
        }
        Ok(self.release(req, at).map(|s| s.tokens).unwrap_or_default())
    }
}

/// `n` more tokens of `state` must be known: `computed + n <= len(tokens)`.
fn check_known(method: &str, req: RequestIdRef<'_>, state: &TokenState, n: u64, arg: &str) -> CoreResult<()> {
    match exceeds_known(state, n) {
        None => Ok(()),
        Some(known) => Err(too_many_tokens(method, &req, arg, n, state.computed, known)),
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

/// The error of a request `req` (as shown) asked for `n` tokens past `computed` of `known`.
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
    coord.register_with(
        tables,
        &state.hashes[first..full],
        u64::try_from(first).unwrap_or(u64::MAX),
        Some(state.computed),
        Some(ctx),
    )?;
    state.registered = full;
    Ok(())
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
    use crate::engine::coordinator::{EvictionOrder, PrefixMatch};
    use crate::engine::events::KvEvent;
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
        assert_eq!(add(&mut c, B, toks(0..16)), 12);
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
        let p = prompt(&c, toks(0..16));
        assert_eq!(c.add_request(C, p, false).unwrap(), 0);
        // Only the cache-using add counted a query.
        let s = c.stats();
        assert_eq!((s.prefix_queries_tokens, s.prefix_hits_tokens), (16 + 16, 12));
        // A prompt hashed for another base page size is refused.
        let wrong = Prompt::new(toks(0..8), Vec::new(), 2).unwrap();
        assert!(c.add_request(RequestIdRef::Int(9), wrong, true).is_err());
    }

    #[test]
    fn append_tokens_hashes_each_page_once_chained_like_hash_pages() {
        let mut c = hybrid(64);
        let extra = vec!["lora-1".to_owned()];
        let p = Prompt::new(toks(0..6), extra.clone(), 4).unwrap();
        c.add_request(A, p, true).unwrap();
        for t in 6..23 {
            c.append_tokens(A, &[t]).unwrap();
        }
        c.append_tokens(A, &toks(23..30)).unwrap();
        let at = c.find(A).unwrap();
        let state = c.entries[at].tokens.as_ref().unwrap();
        assert_eq!(state.tokens, toks(0..30));
        assert_eq!(state.hashes, hash_pages(&toks(0..30), 4, &[], &extra).unwrap());
        assert_eq!(c.num_tokens(A).unwrap(), 30);
    }

    /// The arguments of one `append_tokens_batch` call.
    type BatchAppend<'a> = (&'a [RequestIdRef<'a>], &'a [u32], Option<&'a [u64]>);

    #[test]
    fn append_tokens_batch_is_append_tokens_per_request_after_validating_all() {
        // Same operations twice: one batch call vs per-request append_tokens calls.
        let tokens_of = |c: &FlatCache, r| {
            let at = c.find(r).unwrap();
            let s = c.entries[at].tokens.as_ref().unwrap();
            (s.tokens.clone(), s.hashes.clone())
        };
        let (mut one, mut batch) = (hybrid(64), hybrid(64));
        for c in [&mut one, &mut batch] {
            add(c, A, toks(0..6));
            add(c, B, toks(100..103));
        }
        one.append_tokens(A, &[6]).unwrap();
        one.append_tokens(B, &[103]).unwrap();
        batch.append_tokens_batch(&[A, B], &[6, 103], None).unwrap();
        // Counts: 3 for B, none for A, then 2 more for A (a repeated id appends in order).
        one.append_tokens(B, &[104, 105, 106]).unwrap();
        one.append_tokens(A, &[7, 8]).unwrap();
        batch
            .append_tokens_batch(&[B, A, A], &[104, 105, 106, 7, 8], Some(&[3, 0, 2]))
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
        let before = (tokens_of(&batch, A), tokens_of(&batch, B));
        let bad: [BatchAppend<'_>; 5] = [
            (&[A, B], &[1], None),                // one token per request
            (&[A, B], &[1, 2, 3], Some(&[1])),    // counts per request
            (&[A, B], &[1, 2, 3], Some(&[1, 1])), // counts add up to the tokens
            (&[A, RequestIdRef::Str("zz")], &[1, 2], None),
            (&[A, B], &[1, 2, 3], Some(&[u64::MAX, 4])),
        ];
        for (reqs, t, counts) in bad {
            assert!(batch.append_tokens_batch(reqs, t, counts).is_err());
        }
        assert!(matches!(
            batch.append_tokens_batch(&[A, RequestIdRef::Str("zz")], &[1, 2], None),
            Err(CoreError::UnknownRequest(_))
        ));
        assert_eq!((tokens_of(&batch, A), tokens_of(&batch, B)), before);
        batch.append_tokens_batch::<RequestIdRef<'_>>(&[], &[], None).unwrap();
        batch.check_invariants().unwrap();
    }

    #[test]
    fn handles_name_their_request_until_it_is_gone() {
        use crate::engine::Lookup;
        let mut c = cache(vec![spec("full", GroupKind::Full, 4)], 32, CacheOptions::default());
        add(&mut c, A, toks(0..20));
        add(&mut c, B, toks(100..120));
        let (ha, hb) = (c.handle(A).unwrap(), c.handle(B).unwrap());
        assert!(c.handle(RequestIdRef::Str("zz")).is_none());
        // A batch by handles acts like one by ids, repeats and order included.
        let by_handle = [Lookup::Handle(hb), Lookup::Handle(ha), Lookup::Handle(hb)];
        assert_eq!(c.schedule_batch(&by_handle, &[1, 2, 3]).unwrap(), vec![true; 3]);
        assert_eq!(
            (c.num_computed_tokens(A).unwrap(), c.num_computed_tokens(B).unwrap()),
            (2, 4)
        );
        c.append_tokens_batch(&[Lookup::Handle(ha), Lookup::Id(B)], &[7, 8], None)
            .unwrap();
        assert_eq!((c.num_tokens(A).unwrap(), c.num_tokens(B).unwrap()), (21, 21));
        // Finished, then added again (possibly in the same slot): the old handle is stale and
        // refused, nothing moves; the new request has a new handle.
        c.finish(A).unwrap();
        assert!(!c.is_current(ha) && c.is_current(hb));
        add(&mut c, A, toks(300..305));
        assert!(!c.is_current(ha));
        assert_ne!(c.handle(A), Some(ha));
        assert!(c
            .schedule_batch(&[Lookup::Handle(hb), Lookup::Handle(ha)], &[1, 1])
            .is_err());
        assert!(c.append_tokens_batch(&[Lookup::Handle(ha)], &[1], None).is_err());
        assert_eq!(
            (c.num_computed_tokens(A).unwrap(), c.num_computed_tokens(B).unwrap()),
            (0, 4)
        );
        assert_eq!(c.num_tokens(A).unwrap(), 5);
        // Errors name the request a handle stands for, as its id would.
        let by_id = c.schedule_batch(&[B], &[100]).unwrap_err().to_string();
        let by_handle = c.schedule_batch(&[Lookup::Handle(hb)], &[100]).unwrap_err().to_string();
        assert_eq!(by_id, by_handle);
        c.check_invariants().unwrap();
    }

    #[test]
    fn schedule_registers_then_reclaims_then_acquires() {
        // Sliding only, P = 4, W = 5: at c tokens, slots below (c - 4) // 4 slid out.
        let mut c = cache(vec![spec("swa", sw(5), 4)], 5, CacheOptions::default());
        add(&mut c, A, toks(0..16));
        assert!(c.schedule(A, 12, 0).unwrap()); // pages 1, 2, 3; c = 12
        assert_eq!(c.page_ids(A).unwrap(), vec![vec![1, 2, 3]]);
        assert_eq!(c.coordinator().pool().num_free(), 1);
        // At c = 12: register base pages 0..3 (all full), THEN reclaim slots below
        // (12 - 4) // 4 = 2, THEN acquire 4 more tokens (one page).
        assert!(c.schedule(A, 4, 0).unwrap());
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
        add(&mut c, A, toks(0..16));
        assert!(c.schedule(A, 12, 0).unwrap());
        assert_eq!(c.coordinator().pool().num_free(), 0);
        assert!(c.schedule(A, 4, 0).unwrap());
        assert_eq!(c.page_ids(A).unwrap(), vec![vec![0, 0, 3, 1]]);
    }

    #[test]
    fn lookahead_reserves_slots_without_moving_the_position() {
        let mut c = hybrid(64);
        add(&mut c, A, toks(0..8));
        assert!(c.schedule(A, 4, 3).unwrap());
        // Room for 4 + 3 = 7 tokens: 2 pages per group; the position moved by 4 only.
        assert_eq!(c.num_computed_tokens(A).unwrap(), 4);
        assert_eq!(c.tail_available(A).unwrap(), vec![1, 1]);
        let free = c.coordinator().pool().num_free();
        // The next 3 tokens fit in the room already there: nothing allocated.
        assert!(c.schedule(A, 3, 0).unwrap());
        assert_eq!(c.coordinator().pool().num_free(), free);
        // n = 0 with a lookahead only reserves slots.
        assert!(c.schedule(A, 0, 5).unwrap());
        assert_eq!(c.num_computed_tokens(A).unwrap(), 7);
        assert_eq!(c.tail_available(A).unwrap(), vec![0, 0]);
        assert_eq!(c.coordinator().pool().num_free(), free - 2);
        // More tokens than known: an error, nothing changes.
        assert!(matches!(c.schedule(A, 2, 0), Err(CoreError::InvalidArgument(_))));
        assert!(matches!(c.schedule(A, 1, u64::MAX), Err(CoreError::Overflow { .. })));
        assert_eq!(c.num_computed_tokens(A).unwrap(), 7);
        c.check_invariants().unwrap();
    }

    #[test]
    fn failed_schedule_allocates_nothing_and_keeps_the_position() {
        let mut c = hybrid(5); // 4 real pages
        add(&mut c, A, toks(0..20));
        assert!(c.schedule(A, 4, 0).unwrap()); // 1 + 1 pages
        c.reserve(A, 4).unwrap();
        let before = (c.page_ids(A).unwrap(), c.tail_available(A).unwrap(), free_list(&c));
        // 12 more tokens need 3 + 3 pages; 2 are free.
        assert!(!c.schedule(A, 12, 0).unwrap());
        assert_eq!(
            (c.page_ids(A).unwrap(), c.tail_available(A).unwrap(), free_list(&c)),
            before
        );
        assert_eq!(c.num_computed_tokens(A).unwrap(), 4);
        // The reserve stays on failure.
        assert_eq!(c.reserved_pages(A).unwrap(), 2);
        c.check_invariants().unwrap();
    }

    #[test]
    fn schedule_batch_is_all_or_nothing_per_request_in_order() {
        let mut c = hybrid(9); // 8 real pages
        for (req, len) in [(A, 8), (B, 24), (C, 4)] {
            add(&mut c, req, toks(0..len));
        }
        // a: 8 tokens -> 2 + 2 pages (4 left); b: 24 -> 6 + 6, does not fit: nothing for b;
        // c: 4 -> 1 + 1 fits after b failed.
        let got = c.schedule_batch(&[A, B, C], &[8, 24, 4]).unwrap();
        assert_eq!(got, vec![true, false, true]);
        assert_eq!(c.page_ids(B).unwrap(), vec![Vec::<u32>::new(), vec![]]);
        assert_eq!(
            c.page_ids(C).unwrap(),
            vec![vec![5], vec![6]],
            "c allocates in index order after a"
        );
        assert_eq!([A, B, C].map(|r| c.num_computed_tokens(r).unwrap()), [8, 0, 4]);
        c.check_invariants().unwrap();
    }

    #[test]
    fn schedule_batch_validates_everything_before_changing_anything() {
        let mut c = hybrid(64);
        add(&mut c, A, toks(0..8));
        add(&mut c, B, toks(0..8));
        assert!(c.acquire(C, 4).unwrap()); // a page-level request
        let before = (free_list(&c), c.page_ids(A).unwrap());
        let unknown = RequestIdRef::Str("zz");
        assert!(matches!(
            c.schedule_batch(&[A, unknown], &[1, 1]),
            Err(CoreError::UnknownRequest(_))
        ));
        assert!(matches!(
            c.schedule_batch(&[A, C], &[1, 1]),
            Err(CoreError::InvalidArgument(_))
        ));
        assert!(matches!(
            c.schedule_batch(&[A, B], &[1, 9]),
            Err(CoreError::InvalidArgument(_))
        ));
        // A repeated request counts its asks together: 5 + 5 > 8 known.
        assert!(matches!(
            c.schedule_batch(&[A, A], &[5, 5]),
            Err(CoreError::InvalidArgument(_))
        ));
        assert!(matches!(
            c.schedule_batch(&[A], &[1, 1]),
            Err(CoreError::InvalidArgument(_))
        ));
        assert_eq!((free_list(&c), c.page_ids(A).unwrap()), before);
        assert_eq!(c.num_computed_tokens(A).unwrap(), 0);
        // The scratch counters were reset: the same batch within bounds now works.
        assert_eq!(c.schedule_batch(&[A, A], &[4, 4]).unwrap(), vec![true, true]);
        assert_eq!(c.num_computed_tokens(A).unwrap(), 8);
        // Token-level methods refuse page-level requests.
        assert!(matches!(c.schedule(C, 0, 0), Err(CoreError::InvalidArgument(_))));
        assert!(matches!(c.num_tokens(C), Err(CoreError::InvalidArgument(_))));
        assert!(matches!(c.finish(C), Err(CoreError::InvalidArgument(_))));
        assert!(matches!(c.append_tokens(C, &[1]), Err(CoreError::InvalidArgument(_))));
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
        add(&mut c, A, toks(0..10));
        assert!(c.schedule(A, 10, 0).unwrap());
        for t in 10..14 {
            c.append_tokens(A, &[t]).unwrap();
            assert!(c.schedule(A, 1, 0).unwrap());
        }
        c.reserve(A, 1).unwrap();
        let tokens = c.preempt(A).unwrap();
        assert_eq!(tokens, toks(0..14));
        assert!(!c.has_request(A));
        assert_eq!(c.stats().preemptions, 1);
        assert_eq!(c.budget(None).unwrap(), 63);
        // 14 tokens computed -> base pages 0..3 registered on preempt; the re-added request
        // matches (14 - 1) // 4 = 3 pages.
        assert_eq!(add(&mut c, A, tokens), 12);
        assert_eq!(c.num_computed_tokens(A).unwrap(), 12);
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
        c.add_request(A, p, true).unwrap();
        let h = hash_pages(&toks(0..13), 4, &[], &extra).unwrap();
        assert!(c.schedule(A, 8, 0).unwrap()); // nothing to register at c = 0
        assert!(c.take_events().is_empty());
        assert!(c.schedule(A, 4, 0).unwrap()); // c = 8: registers base pages 0, 1
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
        c.append_tokens(A, &[13]).unwrap();
        assert!(c.schedule(A, 1, 0).unwrap());
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
        add(&mut c, A, toks(0..1));
        assert!(c.schedule(A, 1, 0).unwrap());
        for t in 1..17 {
            c.append_tokens(A, &[t]).unwrap();
            assert!(c.schedule(A, 1, 0).unwrap());
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
        // The state group snapshots on its page boundaries: slot 0 at c = 8 (reclaimed since,
        // a hole in the table but still cached and free) and slot 1 at c = 16.
        assert_eq!(ids[2][0], 0);
        assert!(pool
            .lookup(&crate::engine::hash::GroupKey::new(fold_run(&h[0..2]), 2))
            .is_some());
        assert_eq!(
            pool.lookup(&crate::engine::hash::GroupKey::new(fold_run(&h[2..4]), 2)),
            Some(ids[2][1])
        );
        // The whole 16-token prefix comes back for a 17-token prompt.
        c.finish(A).unwrap();
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
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                (0u8..4, 0u8..3, 1u16..80).prop_map(|(r, p, l)| Op::Add(r, p, l)),
                (0u8..4, 1u8..9).prop_map(|(r, k)| Op::Append(r, k)),
                (0u8..4, 0u16..40, 0u8..6).prop_map(|(r, n, a)| Op::Schedule(r, n, a)),
                Just(Op::Batch),
                (0u8..4, 0u8..20).prop_map(|(r, t)| Op::Reserve(r, t)),
                (0u8..4).prop_map(Op::Finish),
                (0u8..4).prop_map(Op::Preempt),
                (0u8..4, 0u8..12).prop_map(|(r, n)| Op::PageAcquire(r, n)),
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
            /// position never passes the known tokens, and a failed schedule changes nothing.
            #[test]
            fn random_token_traffic_keeps_invariants(
                ops in proptest::collection::vec(op(), 1..60),
                hybrid_order in any::<bool>(),
            ) {
                let order = if hybrid_order { EvictionOrder::Hybrid } else { EvictionOrder::Group };
                let mut c = cache(
                    vec![spec("full", GroupKind::Full, 4), spec("swa", sw(10), 8), spec("st", GroupKind::State, 8)],
                    30,
                    CacheOptions { eviction_order: order, enable_kv_events: true, ..CacheOptions::default() },
                );
                let ids: Vec<RequestIdRef<'static>> = (0..4).map(RequestIdRef::Int).collect();
                let mut next_token = 5000u32;
                for op in ops {
                    match op {
                        Op::Add(r, p, len) => {
                            let id = ids[usize::from(r)];
                            if !c.has_request(id) {
                                let hit = add(&mut c, id, family(p, len));
                                prop_assert!(hit < u64::from(len));
                                prop_assert_eq!(hit % c.coordinator().lcm_page_size(), 0);
                            }
                        }
                        Op::Append(r, k) => {
                            let id = ids[usize::from(r)];
                            if c.has_request(id) {
                                let new: Vec<u32> = (0..u32::from(k)).map(|i| next_token + i).collect();
                                next_token += u32::from(k);
                                c.append_tokens(id, &new).unwrap();
                            }
                        }
                        Op::Schedule(r, n, ahead) => {
                            let id = ids[usize::from(r)];
                            if !c.has_request(id) {
                                continue;
                            }
                            let left = c.num_tokens(id).unwrap() - c.num_computed_tokens(id).unwrap();
                            let n = u64::from(n).min(left);
                            let before = c.num_computed_tokens(id).unwrap();
                            if c.schedule(id, n, u64::from(ahead)).unwrap() {
                                prop_assert_eq!(c.num_computed_tokens(id).unwrap(), before + n);
                                prop_assert_eq!(c.reserved_pages(id).unwrap(), 0);
                            } else {
                                // Steps 1-2 may have run; a second failing try changes nothing.
                                let snap = (c.page_ids(id).unwrap(), c.tail_available(id).unwrap(), c.pool_stats());
                                prop_assert!(!c.schedule(id, n, u64::from(ahead)).unwrap());
                                let again = (c.page_ids(id).unwrap(), c.tail_available(id).unwrap(), c.pool_stats());
                                prop_assert_eq!(snap, again);
                                prop_assert_eq!(c.num_computed_tokens(id).unwrap(), before);
                            }
                        }
                        Op::Batch => {
                            let live: Vec<RequestIdRef<'static>> =
                                ids.iter().copied().filter(|&r| c.has_request(r)).collect();
                            let ns: Vec<u64> = live
                                .iter()
                                .map(|&r| c.num_tokens(r).unwrap() - c.num_computed_tokens(r).unwrap())
                                .collect();
                            let got = c.schedule_batch(&live, &ns).unwrap();
                            for ((&r, &n), ok) in live.iter().zip(&ns).zip(got) {
                                let done = c.num_computed_tokens(r).unwrap() == c.num_tokens(r).unwrap();
                                prop_assert!(!ok || done || n == 0);
                            }
                        }
                        Op::Reserve(r, t) => {
                            let id = ids[usize::from(r)];
                            if c.has_request(id) {
                                c.reserve(id, u64::from(t)).unwrap();
                            }
                        }
                        Op::Finish(r) => {
                            let id = ids[usize::from(r)];
                            if c.has_request(id) {
                                c.finish(id).unwrap();
                            }
                        }
                        Op::Preempt(r) => {
                            let id = ids[usize::from(r)];
                            if c.has_request(id) {
                                let tokens = c.preempt(id).unwrap();
                                add(&mut c, id, tokens);
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
                    let b = c.budget(None).unwrap();
                    prop_assert!(b <= i128::try_from(c.pool_stats().num_free).unwrap());
                }
                c.take_events();
                for &id in &ids {
                    if c.has_request(id) {
                        c.finish(id).unwrap();
                    }
                }
                let s = c.stats();
                prop_assert_eq!((s.pages_in_use, s.requests), (0, 0));
                prop_assert_eq!(c.budget(None).unwrap(), 29);
                prop_assert_eq!(c.check_invariants(), Ok(()));
            }
        }
    }
}
