//! What a token-level request knows: its prompt hashed into base pages ([`Prompt`], built
//! before the engine is locked) and, once added, its token state (tokens, chained hashes of
//! full base pages, position, registration progress).

use std::sync::Arc;

use super::hash::{hash_pages, ContentHash, GroupKey};
use super::pool::Place;
use crate::error::{CoreError, CoreResult};

/// The token state of a request created by `add_request`.
#[derive(Clone, Debug, Default)]
pub(super) struct TokenState {
    /// Prompt plus appended tokens.
    pub(super) tokens: Vec<u32>,
    /// Chained content hash of every full base page of `tokens`.
    pub(super) hashes: Vec<ContentHash>,
    /// Extra keys hashed into every page.
    pub(super) extra_keys: Arc<[String]>,
    /// Tokens computed so far (the request's position).
    pub(super) computed: u64,
    /// Base pages below this were passed to register (or claimed, hence already keyed).
    pub(super) registered: usize,
    /// `schedule_batch` scratch: tokens the batch being validated asks of this request.
    pub(super) pending: u64,
    /// While the position is below this, scheduling registers and reclaims nothing (the
    /// decode fast path of `schedule`); 0 until the first schedule works it out.
    pub(super) fast_until: u64,
    /// The branch point (SPEC 13.5c): where the prompt left the cached path beyond its hit,
    /// a multiple of the state grain at which a chunk ends to write a checkpoint; 0 if none.
    pub(super) branch: u64,
    /// Tokens of the prompt the request was added with: its end is never a state checkpoint,
    /// and beyond it decode keeps only its latest (SPEC 13.5b, d).
    pub(super) prompt_len: u64,
    /// The state slots of the last `schedule` (models with one state group): see
    /// [`StepSlots`].
    pub(super) step: Option<StepSlots>,
    /// The latest checkpoint decode wrote (its page and key): SPEC 13.5d keeps one, the
    /// previous is dropped when the next is written.
    pub(super) decode_checkpoint: Option<(u32, GroupKey)>,
    /// SPEC 13.8b (`reuse`, arena storage): the eviction stamp of the request's first decode
    /// checkpoint once free, the date every later one takes (rewriting it a grain on is no
    /// use of the cache), and whether the latest one was dated yet.
    pub(super) decode_since: Option<u64>,
    pub(super) decode_dated: bool,
    /// Where the request's previous decode checkpoint sat in the eviction order when it was
    /// dropped: where the next one goes, a hint for dating it.
    pub(super) decode_place: Option<Place>,
    /// The checkpoints written while computing the prompt (page, key, tokens), for the
    /// `reuse` policy at finish (SPEC 13.8; empty under `lru`).
    pub(super) prompt_checkpoints: Vec<(u32, GroupKey, u64)>,
}

/// What the last `schedule` of a token-level request did to its state group (SPEC 13.4):
/// `n` tokens, the state read from pool page `read` (0: the null slot) and written to `write`
/// (the same page when the working page stayed or moved, a new one after a checkpoint).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct StepSlots {
    pub(super) n: u64,
    pub(super) read: u32,
    pub(super) write: u32,
}

/// A prompt hashed into base pages for a cache with a given base page size. Built (and
/// hashed) before the cache is locked, so the bindings can hash without holding the lock.
/// Tokens and hashes are shared (`Arc`): the admission memo hands out copies for free.
#[derive(Clone, Debug)]
pub struct Prompt {
    pub(super) tokens: Arc<[u32]>,
    pub(super) hashes: Arc<[ContentHash]>,
    pub(super) extra_keys: Arc<[String]>,
    pub(super) base: u64,
}

impl Prompt {
    /// Hash every full base page of `tokens` (chained, `extra_keys` on every page, as
    /// `hash_pages(tokens, base_page_size, extra_keys=...)`).
    pub fn new(tokens: Vec<u32>, extra_keys: Vec<String>, base_page_size: u64) -> CoreResult<Self> {
        if base_page_size == 0 {
            return Err(CoreError::invalid("base_page_size must be > 0, got 0"));
        }
        // A base page larger than usize holds more tokens than any prompt: no full page.
        let hashes = match usize::try_from(base_page_size) {
            Ok(page) => hash_pages(&tokens, page, &[], &extra_keys)?,
            Err(_) => Vec::new(),
        };
        Ok(Self {
            tokens: Arc::from(tokens),
            hashes: Arc::from(hashes),
            extra_keys: Arc::from(extra_keys),
            base: base_page_size,
        })
    }

    /// The prompt `memo` holds, if it is this one (same tokens, extra keys and base page
    /// size): a scheduler probes, sizes and then adds one prompt (`prefix_hit_tokens`,
    /// `pages_needed_to_admit`, `add_request`), and only the first call has to hash it.
    /// Comparing costs a memcmp of the tokens, hashing a SHA-256 per page.
    pub fn recall(memo: Option<&Prompt>, tokens: &[u32], extra_keys: &[String], base_page_size: u64) -> Option<Self> {
        memo.filter(|last| last.base == base_page_size && *last.tokens == *tokens && *last.extra_keys == *extra_keys)
            .cloned()
    }

    /// [`Prompt::recall`], else [`Prompt::new`]; `memo` is left holding this prompt.
    pub fn new_memoized(
        tokens: Vec<u32>,
        extra_keys: Vec<String>,
        base_page_size: u64,
        memo: &mut Option<Prompt>,
    ) -> CoreResult<Self> {
        if let Some(known) = Self::recall(memo.as_ref(), &tokens, &extra_keys, base_page_size) {
            return Ok(known);
        }
        let prompt = Self::new(tokens, extra_keys, base_page_size)?;
        *memo = Some(prompt.clone());
        Ok(prompt)
    }

    /// The prompt's tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The content hashes of its full base pages.
    pub fn hashes(&self) -> &[ContentHash] {
        &self.hashes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::testing::*;

    #[test]
    fn a_memoized_prompt_has_the_hashes_of_a_fresh_one() {
        let extra = vec!["lora-a".to_owned()];
        let mut memo = None;
        let first = Prompt::new_memoized(toks(0..13), extra.clone(), 4, &mut memo).unwrap();
        assert_eq!(first.hashes(), &hash_pages(&toks(0..13), 4, &[], &extra).unwrap()[..]);
        let again = Prompt::new_memoized(toks(0..13), extra.clone(), 4, &mut memo).unwrap();
        assert_eq!(again.hashes(), first.hashes());
        // Any difference (tokens, extra keys, base page size) hashes afresh.
        let other_tokens = Prompt::new_memoized(toks(1..14), extra.clone(), 4, &mut memo).unwrap();
        assert_eq!(
            other_tokens.hashes(),
            &hash_pages(&toks(1..14), 4, &[], &extra).unwrap()[..]
        );
        let no_keys = Prompt::new_memoized(toks(1..14), Vec::new(), 4, &mut memo).unwrap();
        assert_eq!(
            no_keys.hashes(),
            &hash_pages::<&str>(&toks(1..14), 4, &[], &[]).unwrap()[..]
        );
        let base_two = Prompt::new_memoized(toks(1..14), Vec::new(), 2, &mut memo).unwrap();
        assert_eq!(
            base_two.hashes(),
            &hash_pages::<&str>(&toks(1..14), 2, &[], &[]).unwrap()[..]
        );
    }
}
