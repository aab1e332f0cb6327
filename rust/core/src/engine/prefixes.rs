//! Whole hybrid prefixes (SPEC 13.8, the `reuse` policy with one state group): a prompt can
//! resume at a boundary `t` only while every full-attention page of `[0, t)` and the state
//! checkpoint at `t` are cached, so a cached full-attention page that lies on the path of no
//! kept checkpoint can never be hit, and it holds memory a live prefix could use.
//!
//! [`PathCounts`] remembers, for every checkpoint a finished request left in the cache, its
//! path: the base-page hashes of `[0, t)`. The coordinator drops the key of a free
//! full-attention page whose hash no remembered path holds: at a request's finish (its pages
//! that no kept checkpoint needs), and when a checkpoint leaves the cache (evicted, dropped or
//! cleared: the pages only its path held).
//!
//! The paths form a tree. A checkpoint remembered with a *parent* (a remembered checkpoint
//! whose path is a prefix of its own: the one its request resumed from, or that request's
//! previous kept checkpoint) is a node that stores only its own segment of the path,
//! `[parent's end, t)`; a node without one stores `[0, t)`. Per base-page hash, a count of the
//! live nodes whose segment holds it. A forgotten checkpoint whose node still has children
//! stays as a ghost (its segment lies on their paths) until the last child goes; then its
//! segment is released and its parent is looked at in turn. So a hash is held exactly when
//! some remembered checkpoint's path holds it, and remembering or forgetting costs the
//! segment's length (the pages the request computed itself), not the path's: a conversation's
//! tenth turn pays for its own tokens, not for the nine before it. Nothing scans the pool.

use hashbrown::HashMap;
use rustc_hash::FxBuildHasher;

use crate::engine::hash::{ContentHash, GroupKey};

/// One remembered (or ghost) checkpoint: its segment of the path and its place in the tree.
#[derive(Clone, Debug)]
struct Node {
    /// The base-page hashes of the node's segment of the path, `[parent's end, end)` (a copy
    /// of the request's: O(segment)).
    segment: Box<[ContentHash]>,
    /// Where the path ends, in base pages.
    end: usize,
    parent: Option<GroupKey>,
    /// Live nodes whose parent this is.
    children: u32,
    /// Whether the checkpoint is remembered (else a ghost kept for its children).
    remembered: bool,
}

/// The remembered checkpoints' paths, as a tree of segments, and per base-page hash how many
/// live segments hold it.
#[derive(Clone, Debug, Default)]
pub struct PathCounts {
    /// Per checkpoint key: its node (remembered, or a ghost with children).
    nodes: HashMap<GroupKey, Node, FxBuildHasher>,
    /// Per base-page hash: the live segments holding it (never 0: the entry is removed).
    holders: HashMap<ContentHash, u32, FxBuildHasher>,
}

impl PathCounts {
    /// Remember checkpoint `key` with the path `hashes[..len]` (`len` capped at the hashes),
    /// below `parent` when that is a live node whose path ends within `len` (its path is then
    /// a prefix of this one: the hashes chain). A key already remembered keeps its first path;
    /// a ghost is remembered again as it was. Returns whether it was added.
    pub fn remember(&mut self, key: GroupKey, hashes: &[ContentHash], len: usize, parent: Option<GroupKey>) -> bool {
        if let Some(node) = self.nodes.get_mut(&key) {
            let added = !node.remembered;
            node.remembered = true;
            return added;
        }
        let len = len.min(hashes.len());
        let parent = parent.filter(|p| p != &key && self.nodes.get(p).is_some_and(|n| n.end <= len));
        let start = match parent.and_then(|p| self.nodes.get_mut(&p)) {
            Some(node) => {
                node.children = node.children.saturating_add(1);
                node.end
            }
            None => 0,
        };
        let segment: Box<[ContentHash]> = hashes[start..len].into();
        for hash in &segment {
            let count = self.holders.entry(*hash).or_insert(0);
            *count = count.saturating_add(1);
        }
        let node = Node {
            segment,
            end: len,
            parent,
            children: 0,
            remembered: true,
        };
        self.nodes.insert(key, node);
        true
    }

    /// Forget checkpoint `key`'s path; `on_unheld` gets each hash no remembered path holds
    /// any more, in path order. Nothing happens for a key that is not remembered.
    pub fn forget(&mut self, key: &GroupKey, mut on_unheld: impl FnMut(&ContentHash)) {
        match self.nodes.get_mut(key) {
            Some(node) if node.remembered => node.remembered = false,
            _ => return,
        }
        // The nodes that die, deepest first: this one (unless children keep it as a ghost),
        // then each ghost parent whose last child it was.
        let mut dead = Vec::new();
        let mut at = Some(*key);
        while let Some(k) = at {
            let Some(node) = self.nodes.get(&k) else { break };
            if node.remembered || node.children > 0 {
                break;
            }
            let node = self.nodes.remove(&k).unwrap_or_else(|| unreachable!("looked up above"));
            at = node.parent;
            if let Some(parent) = at.and_then(|p| self.nodes.get_mut(&p)) {
                parent.children -= 1;
            }
            dead.push(node);
        }
        // Released top segment first: the path's order.
        for node in dead.iter().rev() {
            for hash in &node.segment {
                if let Some(count) = self.holders.get_mut(hash) {
                    *count -= 1;
                    if *count == 0 {
                        self.holders.remove(hash);
                        on_unheld(hash);
                    }
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
        self.nodes.get(key).is_some_and(|n| n.remembered)
    }

    /// Whether checkpoint `key` has a node (remembered, or a ghost kept for its children):
    /// a later checkpoint on its path can be remembered below it.
    #[inline]
    pub fn has_node(&self, key: &GroupKey) -> bool {
        self.nodes.contains_key(key)
    }

    /// How many nodes there are (remembered checkpoints and ghosts).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether no checkpoint is remembered (nor kept as a ghost).
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
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
        let turn1 = [h(1), h(2), h(3)];
        let turn2 = [h(1), h(2), h(3), h(4), h(5)];
        assert!(counts.remember(key(10), &turn1, 2, None)); // [h1, h2]
        assert!(counts.remember(key(20), &turn2, 9, None)); // capped: all five
        assert!(!counts.remember(key(20), &turn1, 1, None)); // the first path stays
        assert!(counts.holds(&h(3)) && !counts.holds(&h(6)));
        let mut unheld = Vec::new();
        counts.forget(&key(20), |x| unheld.push(*x));
        assert_eq!(unheld, vec![h(3), h(4), h(5)]); // h1, h2 still on turn 1's path
        counts.forget(&key(20), |_| panic!("forgotten twice"));
        counts.forget(&key(10), |x| unheld.push(*x));
        assert_eq!(unheld, vec![h(3), h(4), h(5), h(1), h(2)]);
        assert!(counts.is_empty() && counts.holders.is_empty());
    }

    #[test]
    fn a_child_stores_its_segment_and_keeps_a_forgotten_parent_as_a_ghost() {
        let mut counts = PathCounts::default();
        let path = [h(1), h(2), h(3), h(4), h(5)];
        assert!(counts.remember(key(10), &path, 2, None));
        assert!(counts.remember(key(20), &path, 4, Some(key(10))));
        // A parent that is not a node, or whose path is longer, is ignored: the whole path.
        assert!(counts.remember(key(30), &path, 1, Some(key(20))));
        assert_eq!(
            *counts.nodes[&key(20)].segment,
            [h(3), h(4)],
            "only [h3, h4] is the child's"
        );
        assert_eq!(*counts.nodes[&key(30)].segment, [h(1)]);
        assert_eq!(
            counts.holders[&h(1)],
            2,
            "key 10 and key 30; key 20 does not count it again"
        );
        let mut unheld = Vec::new();
        counts.forget(&key(10), |x| unheld.push(*x));
        assert!(
            unheld.is_empty() && counts.holds(&h(2)),
            "a ghost: key 20's path holds h2"
        );
        assert!(!counts.remembers(&key(10)) && counts.has_node(&key(10)));
        counts.forget(&key(20), |x| unheld.push(*x));
        // The ghost goes with its last child; the path's order, h1 still held by key 30.
        assert_eq!(unheld, vec![h(2), h(3), h(4)]);
        assert!(!counts.has_node(&key(10)));
        counts.forget(&key(30), |x| unheld.push(*x));
        assert_eq!(unheld, vec![h(2), h(3), h(4), h(1)]);
        assert!(counts.is_empty() && counts.holders.is_empty());
    }

    #[test]
    fn a_ghost_remembered_again_keeps_its_children() {
        let mut counts = PathCounts::default();
        let path = [h(1), h(2), h(3)];
        counts.remember(key(10), &path, 1, None);
        counts.remember(key(20), &path, 3, Some(key(10)));
        counts.forget(&key(10), |_| panic!("a ghost releases nothing"));
        assert!(counts.remember(key(10), &path, 1, None), "remembered again");
        let mut unheld = Vec::new();
        counts.forget(&key(20), |x| unheld.push(*x));
        assert_eq!(unheld, vec![h(2), h(3)], "key 10 is remembered: h1 stays");
        counts.forget(&key(10), |x| unheld.push(*x));
        assert_eq!(unheld, vec![h(2), h(3), h(1)]);
    }
}
