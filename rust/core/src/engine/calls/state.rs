//! The state slots of a step (SPEC 13.4-13.5): for each scheduled request of a model with a
//! state group, the slot its step reads the state from and the slot it writes the state to.
//!
//! A state group keeps the state after a range's last token in the page of that token's slot
//! and leaves the slots before it holes (the `group` module). A request holds one working
//! page: when a step passes into a new slot, the working page moves there, unless it holds a
//! checkpoint (a key: a chunk ended on the grain within the prompt), in which case a new page
//! is taken and the checkpoint stays. `schedule` records, per request, the page the step reads
//! (the state after its computed tokens before the step: the working page, the checkpoint a
//! prefix hit restored, or the null slot, all zeros, for a fresh request) and the page it
//! writes. When the two differ the runner copies the read slot into the write slot before the
//! step (a fresh request copies zeros) and runs the step in place on the write slot; the read
//! slot is left as it was.

use crate::engine::group::GroupKind;
use crate::engine::FlatCache;
use crate::error::{CoreError, CoreResult};

impl FlatCache {
    /// The read and write state slots (page ids of the state group's view) of the requests in
    /// `slots` as their last `schedule` left them, which gave them `ns[i]` new tokens.
    /// Everything is checked first: the lengths, the model's one state group, each slot
    /// holding a token-level request, `ns[i]` at most its computed tokens and equal to what
    /// its last schedule gave it.
    pub fn state_slots(&self, slots: &[u64], ns: &[u64]) -> CoreResult<(Vec<i32>, Vec<i32>)> {
        const METHOD: &str = "state_slots";
        if slots.len() != ns.len() {
            return Err(CoreError::invalid(format!(
                "num_new_tokens has {} entries but slots has {}",
                ns.len(),
                slots.len()
            )));
        }
        let Some(g) = self.coord.single_state_group() else {
            let states = self.coord.specs().iter().filter(|s| s.kind == GroupKind::State).count();
            return Err(CoreError::invalid(format!(
                "{METHOD}: the model must have exactly one state group, it has {states}"
            )));
        };
        let base = self.coord.pool().group_base(g);
        let view = |page: u32| i32::try_from(page.saturating_sub(base)).unwrap_or(i32::MAX);
        let (mut read, mut write) = (Vec::with_capacity(slots.len()), Vec::with_capacity(slots.len()));
        for (&slot, &n) in slots.iter().zip(ns) {
            let at = self.token_slot(METHOD, slot)?;
            let state = self.entries[at].tokens.as_ref();
            let computed = state.map_or(0, |s| s.computed);
            if n > computed {
                return Err(CoreError::invalid(format!(
                    "{METHOD}: num_new_tokens {n} exceeds the {computed} computed tokens of request {} \
                     (call it after schedule, with the same counts)",
                    self.labeled(at)
                )));
            }
            match state.and_then(|s| s.step) {
                Some(step) if step.n == n => {
                    // The null page is 0 in every view.
                    read.push(if step.read == 0 { 0 } else { view(step.read) });
                    write.push(if step.write == 0 { 0 } else { view(step.write) });
                }
                step => {
                    let last = step.map_or_else(|| "no schedule yet".to_owned(), |s| format!("its last gave {}", s.n));
                    return Err(CoreError::invalid(format!(
                        "{METHOD}: num_new_tokens {n} is not what the last schedule of request {} gave \
                         it ({last})",
                        self.labeled(at)
                    )));
                }
            }
        }
        Ok((read, write))
    }
}

#[cfg(test)]
mod tests {
    use crate::engine::group::GroupKind;
    use crate::engine::pool::ArenaGeometry;
    use crate::engine::testing::*;
    use crate::engine::{CacheOptions, FlatCache};

    /// Full attention (P = 4, 40-byte pages: 3 per 120-byte unit) and one state group
    /// (P = G = 8, a slot is a unit) over 8 units (unit 0 null).
    fn arena() -> FlatCache {
        let geometry = ArenaGeometry {
            unit_bytes: 120,
            num_units: 8,
            page_bytes: vec![40, 120],
        };
        let specs = vec![spec("full", GroupKind::Full, 4), spec("state", GroupKind::State, 8)];
        FlatCache::with_arena(specs, &geometry, CacheOptions::default()).unwrap()
    }

    #[test]
    fn a_chunk_takes_one_state_slot_and_its_end_on_a_boundary_is_a_checkpoint() {
        let mut c = arena();
        let (s, hit) = add(&mut c, A, toks(0..20));
        assert_eq!(hit, 0);
        // 16 tokens: 4 full pages from units 1 and 2 (ids 3u .. 3u + 2 of the full view);
        // one state slot (unit 3) for the slot of token 15, slot 0 left a hole.
        assert!(sched(&mut c, s, 16, 0).unwrap());
        assert_eq!(c.page_ids_in(s).unwrap(), vec![vec![3, 4, 5, 6], vec![0, 3]]);
        assert_eq!(c.state_slots(&[s], &[16]).unwrap(), (vec![0], vec![3]));
        // The next 4 tokens: the state after token 15 (slot 3, a checkpoint at 16 now) is read,
        // the state after token 19 written to a new slot (unit 4).
        assert!(sched(&mut c, s, 4, 0).unwrap());
        assert_eq!(c.page_ids_in(s).unwrap(), vec![vec![3, 4, 5, 6, 7], vec![0, 3, 4]]);
        assert_eq!(c.state_slots(&[s], &[4]).unwrap(), (vec![3], vec![4]));
        c.check_invariants().unwrap();
        c.finish(&[s]).unwrap();
        c.check_invariants().unwrap();
        // A prompt sharing the 20 tokens: the full pages match 20 tokens (capped at 23 // 4
        // base pages), the deepest checkpoint on the path is 16: the hit.
        let (sb, hit) = add(&mut c, B, toks(0..24));
        assert_eq!(hit, 16);
        assert_eq!(c.page_ids_in(sb).unwrap(), vec![vec![3, 4, 5, 6], vec![0, 3]]);
        assert!(sched(&mut c, sb, 8, 0).unwrap());
        let (read, write) = c.state_slots(&[sb], &[8]).unwrap();
        assert_eq!(read, vec![3], "the step starts from the checkpoint");
        assert_ne!(write[0], 3, "and never writes into it");
        c.check_invariants().unwrap();
    }

    #[test]
    fn state_slots_checks_its_arguments() {
        let mut c = arena();
        let (s, _) = add(&mut c, A, toks(0..8));
        assert!(sched(&mut c, s, 4, 0).unwrap());
        assert!(c.state_slots(&[s], &[4, 1]).is_err());
        assert!(c.state_slots(&[s], &[5]).is_err(), "more than the computed tokens");
        assert!(c.state_slots(&[s + 1], &[0]).is_err(), "a free slot");
        assert!(c.schedule(&[s], &[1], 1).is_err(), "lookahead with a state group");
        let mut plain = hybrid(16);
        let (p, _) = add(&mut plain, A, toks(0..8));
        assert!(plain.state_slots(&[p], &[0]).is_err(), "no state group");
    }

    #[test]
    fn the_arena_refuses_what_it_cannot_serve() {
        let specs = || vec![spec("full", GroupKind::Full, 4), spec("state", GroupKind::State, 8)];
        let geometry = |page_bytes: Vec<u64>| ArenaGeometry {
            unit_bytes: 120,
            num_units: 8,
            page_bytes,
        };
        // A state page that is not the unit, a group count that differs, host pages that
        // name another number of groups or add up past the host page ids.
        assert!(FlatCache::with_arena(specs(), &geometry(vec![40, 100]), CacheOptions::default()).is_err());
        assert!(FlatCache::with_arena(specs(), &geometry(vec![40]), CacheOptions::default()).is_err());
        let options = CacheOptions::default();
        assert!(FlatCache::with_arena_host_pages(specs(), &geometry(vec![40, 120]), options, &[1]).is_err());
        let huge = CacheOptions {
            host_pages: 1 << 31,
            ..CacheOptions::default()
        };
        assert!(FlatCache::with_arena(specs(), &geometry(vec![40, 120]), huge).is_err());
        let no_reuse = CacheOptions {
            reuse_uncached_first: false,
            ..CacheOptions::default()
        };
        assert!(FlatCache::with_arena(specs(), &geometry(vec![40, 120]), no_reuse).is_err());
        // Two state groups would need two slots per unit.
        let two = vec![spec("a", GroupKind::State, 8), spec("b", GroupKind::State, 8)];
        assert!(FlatCache::with_arena(two, &geometry(vec![120, 120]), CacheOptions::default()).is_err());
    }
}
