//! Whole hybrid prefixes (SPEC 13.8, the `reuse` policy with one state group): a prompt can
//! resume at a boundary `t` only while every full-attention page of `[0, t)` and the state
//! checkpoint at `t` are cached, so a cached full-attention page that lies on the path of no
//! kept checkpoint can never be hit, and it holds memory a live prefix could use.
//!
//! [`PathCounts`] remembers, for every checkpoint a finished request left in the cache, its
//! path: the base-page hashes of `[0, t)` (shared with the request's other checkpoints), and
//! for every base-page hash how many remembered paths hold it. The coordinator drops the key
//! of a free full-attention page whose hash no path holds: at a request's finish (its pages
//! that no kept checkpoint needs), and when a checkpoint leaves the cache (evicted, dropped or
//! cleared: the pages only its path held). Each operation costs O(path length), the same
//! order as registering those pages; nothing scans the pool.

use std::sync::Arc;

use hashbrown::HashMap;
use rustc_hash::FxBuildHasher;

use crate::engine::hash::{ContentHash, GroupKey};

/// The remembered checkpoints' paths and, per base-page hash, how many paths hold it.
#[derive(Clone, Debug, Default)]
pub struct PathCounts {
    /// Per checkpoint key: the request's base-page hashes and how many of them the path holds.
    paths: HashMap<GroupKey, (Arc<[ContentHash]>, usize), FxBuildHasher>,
    /// Per base-page hash: the remembered paths holding it (never 0: the entry is removed).
    holders: HashMap<ContentHash, u32, FxBuildHasher>,
}

impl PathCounts {
    /// Remember checkpoint `key` with the path `hashes[..len]` (`len` capped at the hashes).
    /// A key already remembered keeps its first path; returns whether it was added.
    pub fn remember(&mut self, key: GroupKey, hashes: &Arc<[ContentHash]>, len: usize) -> bool {
        if self.paths.contains_key(&key) {
            return false;
        }
        let len = len.min(hashes.len());
        for hash in &hashes[..len] {
            let count = self.holders.entry(*hash).or_insert(0);
            *count = count.saturating_add(1);
        }
        self.paths.insert(key, (Arc::clone(hashes), len));
        true
    }

    /// Forget checkpoint `key`'s path; `on_unheld` gets each hash no remembered path holds
    /// any more, in path order. Nothing happens for a key that is not remembered.
    pub fn forget(&mut self, key: &GroupKey, mut on_unheld: impl FnMut(&ContentHash)) {
        let Some((hashes, len)) = self.paths.remove(key) else {
            return;
        };
        for hash in &hashes[..len] {
            if let Some(count) = self.holders.get_mut(hash) {
                *count -= 1;
                if *count == 0 {
                    self.holders.remove(hash);
                    on_unheld(hash);
                }
            }
        }
    }

    /// Whether some remembered path holds `hash`.
    #[inline]
    pub fn holds(&self, hash: &ContentHash) -> bool {
        self.holders.contains_key(hash)
    }

    /// Whether checkpoint `key` is remembered.
    #[inline]
    pub fn remembers(&self, key: &GroupKey) -> bool {
        self.paths.contains_key(key)
    }

    /// How many checkpoints are remembered.
    pub fn len(&self) -> usize {
        self.paths.len()
    }

    /// Whether no checkpoint is remembered.
    pub fn is_empty(&self) -> bool {
        self.paths.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> ContentHash {
        [i; 32]
    }

    fn key(i: u8) -> GroupKey {
        GroupKey {
            hash: [i; 32],
            group: 0,
        }
    }

    #[test]
    fn a_hash_is_held_until_the_last_path_through_it_is_forgotten() {
        let mut counts = PathCounts::default();
        let turn1: Arc<[ContentHash]> = Arc::from(vec![h(1), h(2), h(3)]);
        let turn2: Arc<[ContentHash]> = Arc::from(vec![h(1), h(2), h(3), h(4), h(5)]);
        assert!(counts.remember(key(10), &turn1, 2)); // [h1, h2]
        assert!(counts.remember(key(20), &turn2, 9)); // capped: all five
        assert!(!counts.remember(key(20), &turn1, 1)); // the first path stays
        assert!(counts.holds(&h(3)) && !counts.holds(&h(6)));
        let mut unheld = Vec::new();
        counts.forget(&key(20), |x| unheld.push(*x));
        assert_eq!(unheld, vec![h(3), h(4), h(5)]); // h1, h2 still on turn 1's path
        counts.forget(&key(20), |_| panic!("forgotten twice"));
        counts.forget(&key(10), |x| unheld.push(*x));
        assert_eq!(unheld, vec![h(3), h(4), h(5), h(1), h(2)]);
        assert!(counts.is_empty() && counts.holders.is_empty());
    }
}
