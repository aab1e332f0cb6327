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
//! The paths are kept as a radix tree. The hashes chain (a page's hash fixes every page
//! before it), so a hash sits at one place in the tree, and the first hash of an edge names
//! the edge. Each node holds its edge (the hashes from its parent's end to its own), how many
//! remembered checkpoints end there and how many lie in its subtree; a node whose subtree holds
//! none is removed with its edge at once, so a hash is held exactly when it lies on an edge.
//! Remembering walks the path down from the root comparing hashes (an edge split where the
//! path leaves it) and adds one to the counts of the nodes above: no per-page hash-map work,
//! the pages a request shares with remembered paths cost one comparison each. Forgetting
//! subtracts one up the nodes and releases the edges of the nodes left empty, top first (the
//! path's order). Nothing scans the pool.

use hashbrown::HashMap;
use rustc_hash::FxBuildHasher;

use crate::engine::hash::{ContentHash, GroupKey};

/// The root: the empty path.
const ROOT: u32 = 0;

/// A node of the tree of remembered paths.
#[derive(Clone, Debug, Default)]
struct Node {
    /// The base-page hashes from the parent's end to this node's.
    edge: Vec<ContentHash>,
    /// Where the node's path ends, in base pages.
    end: usize,
    parent: u32,
    /// Remembered checkpoints whose path ends here.
    here: u32,
    /// Remembered checkpoints whose path ends here or below (never 0 but at the root).
    below: u32,
}

/// The remembered checkpoints' paths as a radix tree of base-page hashes.
#[derive(Clone, Debug)]
pub struct PathCounts {
    nodes: Vec<Node>,
    /// Indices of removed nodes, for reuse.
    spare: Vec<u32>,
    /// Per first hash of an edge: its node (the hashes chain, so the hash names the edge).
    edges: HashMap<ContentHash, u32, FxBuildHasher>,
    /// Per remembered checkpoint: the node its path ends at.
    keys: HashMap<GroupKey, u32, FxBuildHasher>,
}

impl Default for PathCounts {
    fn default() -> Self {
        Self {
            nodes: vec![Node::default()],
            spare: Vec::new(),
            edges: HashMap::default(),
            keys: HashMap::default(),
        }
    }
}

impl PathCounts {
    #[inline]
    fn node(&self, i: u32) -> &Node {
        &self.nodes[i as usize]
    }

    #[inline]
    fn node_mut(&mut self, i: u32) -> &mut Node {
        &mut self.nodes[i as usize]
    }

    fn add_node(&mut self, node: Node) -> u32 {
        if let Some(i) = self.spare.pop() {
            self.nodes[i as usize] = node;
            return i;
        }
        self.nodes.push(node);
        u32::try_from(self.nodes.len() - 1).unwrap_or_else(|_| unreachable!("one node per remembered path or split"))
    }

    /// The node where `path` ends, made by splitting an edge or adding a leaf where needed.
    fn insert_path(&mut self, path: &[ContentHash]) -> u32 {
        let mut at = ROOT;
        loop {
            let end = self.node(at).end;
            if end == path.len() {
                return at;
            }
            let Some(&child) = self.edges.get(&path[end]) else {
                let leaf = Node {
                    edge: path[end..].to_vec(),
                    end: path.len(),
                    parent: at,
                    here: 0,
                    below: 0,
                };
                let leaf = self.add_node(leaf);
                self.edges.insert(path[end], leaf);
                return leaf;
            };
            let rest = &path[end..];
            let edge = &self.node(child).edge;
            let common = edge.iter().zip(rest).take_while(|(a, b)| a == b).count();
            if common == edge.len() {
                at = child;
                continue;
            }
            // The path leaves (or ends inside) the child's edge: split it at `common` (>= 1,
            // the first hashes are equal) into `mid` above and the child below.
            let tail = self.node_mut(child).edge.split_off(common);
            let head = std::mem::replace(&mut self.node_mut(child).edge, tail);
            let below = self.node(child).below;
            let mid = self.add_node(Node {
                edge: head,
                end: end + common,
                parent: at,
                here: 0,
                below,
            });
            self.node_mut(child).parent = mid;
            self.edges.insert(path[end], mid);
            let first = self.node(child).edge[0];
            self.edges.insert(first, child);
            at = mid;
        }
    }

    /// Remember checkpoint `key` with the path `hashes[..len]` (`len` capped at the hashes).
    /// A key already remembered keeps its first path; returns whether it was added.
    pub fn remember(&mut self, key: GroupKey, hashes: &[ContentHash], len: usize) -> bool {
        if self.keys.contains_key(&key) {
            return false;
        }
        let node = self.insert_path(&hashes[..len.min(hashes.len())]);
        self.keys.insert(key, node);
        self.node_mut(node).here += 1;
        let mut at = node;
        loop {
            let n = self.node_mut(at);
            n.below += 1;
            if at == ROOT {
                break;
            }
            at = n.parent;
        }
        true
    }

    /// Forget checkpoint `key`'s path; `on_unheld` gets each hash no remembered path holds
    /// any more, in path order. Nothing happens for a key that is not remembered.
    pub fn forget(&mut self, key: &GroupKey, mut on_unheld: impl FnMut(&ContentHash)) {
        let Some(node) = self.keys.remove(key) else {
            return;
        };
        self.node_mut(node).here -= 1;
        let mut at = node;
        loop {
            let n = self.node_mut(at);
            n.below -= 1;
            if at == ROOT {
                break;
            }
            at = n.parent;
        }
        // The nodes left empty form one chain up from `node` (an empty node has no children:
        // each was removed when it emptied); release their edges top first.
        let mut dead = Vec::new();
        let mut at = node;
        while at != ROOT && self.node(at).below == 0 {
            dead.push(at);
            at = self.node(at).parent;
        }
        for &i in dead.iter().rev() {
            let edge = std::mem::take(&mut self.node_mut(i).edge);
            self.edges.remove(&edge[0]);
            for hash in &edge {
                on_unheld(hash);
            }
            self.spare.push(i);
        }
    }

    /// How many leading hashes of `hashes` some remembered path holds (the held hashes of a
    /// path are a prefix of it: the hashes chain).
    pub fn held_len(&self, hashes: &[ContentHash]) -> usize {
        let mut at = ROOT;
        loop {
            let end = self.node(at).end;
            let Some(&child) = hashes.get(end).and_then(|h| self.edges.get(h)) else {
                return end;
            };
            let edge = &self.node(child).edge;
            let common = edge.iter().zip(&hashes[end..]).take_while(|(a, b)| a == b).count();
            if common < edge.len() {
                return end + common;
            }
            at = child;
        }
    }

    /// Whether checkpoint `key` is remembered.
    #[inline]
    pub fn remembers(&self, key: &GroupKey) -> bool {
        self.keys.contains_key(key)
    }

    /// How many checkpoints are remembered.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no checkpoint is remembered.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
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

    fn held(counts: &PathCounts, hashes: &[ContentHash]) -> Vec<ContentHash> {
        hashes[..counts.held_len(hashes)].to_vec()
    }

    #[test]
    fn a_hash_is_held_until_the_last_path_through_it_is_forgotten() {
        let mut counts = PathCounts::default();
        let turn1 = [h(1), h(2), h(3)];
        let turn2 = [h(1), h(2), h(3), h(4), h(5)];
        assert!(counts.remember(key(10), &turn1, 2)); // [h1, h2]
        assert!(counts.remember(key(20), &turn2, 9)); // capped: all five
        assert!(!counts.remember(key(20), &turn1, 1)); // the first path stays
        assert_eq!(counts.held_len(&turn2), 5);
        assert_eq!(counts.held_len(&[h(1), h(6)]), 1);
        let mut unheld = Vec::new();
        counts.forget(&key(20), |x| unheld.push(*x));
        assert_eq!(unheld, vec![h(3), h(4), h(5)]); // h1, h2 still on turn 1's path
        counts.forget(&key(20), |_| panic!("forgotten twice"));
        counts.forget(&key(10), |x| unheld.push(*x));
        assert_eq!(unheld, vec![h(3), h(4), h(5), h(1), h(2)]);
        assert!(counts.is_empty() && counts.edges.is_empty());
        assert_eq!(counts.node(ROOT).below, 0);
    }

    #[test]
    fn paths_that_part_split_an_edge_and_an_empty_branch_goes_top_first() {
        let mut counts = PathCounts::default();
        let a = [h(1), h(2), h(3), h(4)];
        let b = [h(1), h(2), h(7), h(8)];
        counts.remember(key(10), &a, 4);
        counts.remember(key(20), &b, 4); // splits [h1..h4] after h2
        counts.remember(key(30), &a, 1); // ends inside the [h1, h2] edge: splits it again
        assert_eq!(held(&counts, &b), b.to_vec());
        assert_eq!(counts.held_len(&[h(1), h(2), h(9)]), 2);
        let mut unheld = Vec::new();
        counts.forget(&key(10), |x| unheld.push(*x));
        assert_eq!(unheld, vec![h(3), h(4)]);
        counts.forget(&key(20), |x| unheld.push(*x));
        // [h2] (the split's upper part, no checkpoint ends there) goes before [h7, h8].
        assert_eq!(unheld, vec![h(3), h(4), h(2), h(7), h(8)]);
        assert_eq!(counts.held_len(&a), 1, "key 30 still holds h1");
        counts.forget(&key(30), |x| unheld.push(*x));
        assert_eq!(unheld.last(), Some(&h(1)));
        assert!(counts.edges.is_empty() && counts.keys.is_empty());
        // Removed nodes are reused: root, the two leaves and two splits were made.
        assert_eq!(counts.nodes.len(), 5);
        counts.remember(key(40), &b, 4);
        assert_eq!(counts.nodes.len(), 5);
    }
}
