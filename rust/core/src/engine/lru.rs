//! An intrusive O(1) LRU list over a fixed range of node ids, shared by the device pool's free
//! list ([`crate::engine::pool`]) and the host tier's eviction list ([`crate::engine::host`]).
//!
//! The list can hold the nodes `1..=capacity`; node 0 is its sentinel (`next` is the front,
//! `prev` the back), never a member. The links live in one flat vector indexed by node, so
//! every operation is a few array writes and none allocates. The list keeps its length but
//! not its membership: callers know which nodes are on it (the pool: the pages of count 0;
//! the host tier: the findable pages no load reads) and only unlink members and push
//! non-members. The pool's page ids are nodes as they are (page 0 is the null page, never
//! free); the host tier's page `h` is node `h + 1`.

use std::collections::TryReserveError;

/// The links of one node.
#[derive(Clone, Copy, Debug, Default)]
struct Link {
    prev: u32,
    next: u32,
}

/// From `at` (a member or `sentinel`), the last of the nodes that follow it for which `older`
/// holds (`at` itself if none).
fn skip_forward(links: &[Link], mut at: u32, sentinel: u32, mut older: impl FnMut(u32) -> bool) -> u32 {
    loop {
        let next = links[at as usize].next;
        if next == sentinel || !older(next) {
            return at;
        }
        at = next;
    }
}

/// From the back of the list of `sentinel`, the first member for which `older` holds
/// (`sentinel` if none).
fn skip_backward(links: &[Link], sentinel: u32, mut older: impl FnMut(u32) -> bool) -> u32 {
    let mut at = links[sentinel as usize].prev;
    while at != sentinel && !older(at) {
        at = links[at as usize].prev;
    }
    at
}

/// Link `node` (on no list) in right after `at` (a member or a sentinel).
fn link_after(links: &mut [Link], at: u32, node: u32) {
    let next = links[at as usize].next;
    links[node as usize] = Link { prev: at, next };
    links[at as usize].next = node;
    links[next as usize].prev = node;
}

/// A doubly-linked list of node ids `1..=capacity`, front first; node 0 is the sentinel.
#[derive(Clone, Debug)]
pub struct LruList {
    /// Links per node; `links[0]` is the sentinel.
    links: Vec<Link>,
    len: usize,
}

impl LruList {
    /// An empty list that can hold the nodes `1..=capacity`.
    pub fn empty(capacity: u32) -> Result<Self, TryReserveError> {
        let n = capacity as usize + 1;
        let mut links = Vec::new();
        links.try_reserve_exact(n)?;
        links.resize(n, Link::default());
        Ok(Self { links, len: 0 })
    }

    /// A list holding every node `1..=capacity`, in order.
    pub fn filled(capacity: u32) -> Result<Self, TryReserveError> {
        let mut list = Self::empty(capacity)?;
        for node in 1..=capacity {
            list.links[node as usize] = Link {
                prev: node - 1,
                next: if node == capacity { 0 } else { node + 1 },
            };
        }
        // Front node 1 and back node `capacity`, or both the sentinel when empty.
        list.links[0] = Link {
            prev: capacity,
            next: capacity.min(1),
        };
        list.len = capacity as usize;
        Ok(list)
    }

    /// Number of nodes on the list.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the list holds no node.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The front node (next to evict), if any.
    #[inline]
    pub fn front(&self) -> Option<u32> {
        let front = self.links[0].next;
        (front != 0).then_some(front)
    }

    /// The node after `node` (a member), or `None` at the back.
    #[inline]
    pub fn next(&self, node: u32) -> Option<u32> {
        let next = self.links[node as usize].next;
        (next != 0).then_some(next)
    }

    /// The node before `node` (a member), or 0 at the front.
    #[inline]
    pub fn prev_or_front(&self, node: u32) -> u32 {
        self.links[node as usize].prev
    }

    /// Insert `node` (in range, not on the list) after `anchor` (a member, or 0: the front) and
    /// after the members that follow it for which `older` holds, searching forward. O(members
    /// passed).
    pub fn insert_after_from(&mut self, anchor: u32, node: u32, older: impl FnMut(u32) -> bool) {
        let at = skip_forward(&self.links, anchor, 0, older);
        link_after(&mut self.links, at, node);
        self.len += 1;
    }

    /// Insert `node` (in range, not on the list) behind the members for which `older` holds,
    /// searching from the back: after the last member, from the back, for which `older` is
    /// true (at the front if none). O(members passed).
    pub fn insert_behind(&mut self, node: u32, older: impl FnMut(u32) -> bool) {
        let at = skip_backward(&self.links, 0, older);
        link_after(&mut self.links, at, node);
        self.len += 1;
    }

    /// Remove `node`, which must be on the list.
    #[inline]
    pub fn unlink(&mut self, node: u32) {
        let Link { prev, next } = self.links[node as usize];
        self.links[prev as usize].next = next;
        self.links[next as usize].prev = prev;
        self.len -= 1;
    }

    /// Append `node` (in range, not on the list) at the back.
    #[inline]
    pub fn push_back(&mut self, node: u32) {
        let tail = self.links[0].prev;
        self.links[node as usize] = Link { prev: tail, next: 0 };
        self.links[tail as usize].next = node;
        self.links[0].prev = node;
        self.len += 1;
    }

    /// Insert `node` (in range, not on the list) at the front.
    #[inline]
    pub fn push_front(&mut self, node: u32) {
        let head = self.links[0].next;
        self.links[node as usize] = Link { prev: 0, next: head };
        self.links[head as usize].prev = node;
        self.links[0].next = node;
        self.len += 1;
    }

    /// Remove and return the front node, if any.
    #[inline]
    pub fn pop_front(&mut self) -> Option<u32> {
        let front = self.front()?;
        self.unlink(front);
        Some(front)
    }

    /// Remove the first `n` nodes (`n <= len`) and append them to `out`, front first.
    ///
    /// It walks the `n` nodes reading only their `next` links and cuts them off at once, so a
    /// caller's per-node work afterwards (the pool's key eviction and counts) does not wait
    /// behind each link.
    #[inline]
    pub fn pop_front_into(&mut self, out: &mut Vec<u32>, n: usize) {
        debug_assert!(n <= self.len, "pop_front_into({n}) from a list of {}", self.len);
        out.reserve(n);
        let mut head = self.links[0].next;
        for _ in 0..n {
            out.push(head);
            head = self.links[head as usize].next;
        }
        self.links[0].next = head;
        self.links[head as usize].prev = 0;
        self.len -= n;
    }

    /// The nodes front first.
    pub fn iter(&self) -> Iter<'_> {
        Iter {
            list: self,
            at: self.links[0].next,
            left: self.len,
        }
    }

    /// Check the links and the length; returns membership per node id (index 0, the
    /// sentinel, is never a member) or a description of the first violation, naming the
    /// list `what`.
    pub fn check(&self, what: &str) -> Result<Vec<bool>, String> {
        let mut member = vec![false; self.links.len()];
        let mut seen = 0usize;
        let mut prev = 0u32;
        let mut at = self.links[0].next;
        while at != 0 {
            let Some(slot) = member.get_mut(at as usize) else {
                return Err(format!("{what} links to node {at}, out of range"));
            };
            if seen >= self.len || *slot {
                return Err(format!("{what} is longer than its length {}", self.len));
            }
            *slot = true;
            if self.links[at as usize].prev != prev {
                return Err(format!("{what} link of node {at} is broken"));
            }
            prev = at;
            at = self.links[at as usize].next;
            seen += 1;
        }
        if seen != self.len || self.links[0].prev != prev {
            return Err(format!("{what} holds {seen} nodes but its length is {}", self.len));
        }
        Ok(member)
    }
}

impl<'a> IntoIterator for &'a LruList {
    type Item = u32;
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

/// Iterator over an [`LruList`], front first.
pub struct Iter<'a> {
    list: &'a LruList,
    at: u32,
    left: usize,
}

impl Iterator for Iter<'_> {
    type Item = u32;

    #[inline]
    fn next(&mut self) -> Option<u32> {
        if self.at == 0 || self.left == 0 {
            return None;
        }
        let node = self.at;
        self.at = self.list.links[node as usize].next;
        self.left -= 1;
        Some(node)
    }
}

/// Several doubly-linked lists over the node ids `1..=capacity` sharing one link array, each
/// node on at most one of them at a time (the arena's per-group lists of free and of cached
/// pages: a page is on one list or none). List `k`'s sentinel is node `capacity + 1 + k`.
/// One link per node whatever the number of lists: 8 bytes a node where one [`LruList`] per
/// list would take 8 per node per list.
#[derive(Clone, Debug)]
pub struct LruLists {
    /// Links per node; the sentinels follow the nodes.
    links: Vec<Link>,
    /// Per list, its length.
    lens: Vec<usize>,
    /// Node id of list 0's sentinel (`capacity + 1`).
    first_sentinel: u32,
}

impl LruLists {
    /// `lists` empty lists over the nodes `1..=capacity` (`capacity + lists` must fit `u32`;
    /// the callers' ids are at most 2^31 - 1 and their lists a few).
    pub fn empty(capacity: u32, lists: usize) -> Result<Self, TryReserveError> {
        let first_sentinel = capacity + 1;
        let n = first_sentinel as usize + lists;
        debug_assert!(
            u32::try_from(n).is_ok(),
            "LruLists: {lists} lists past {capacity} nodes"
        );
        let mut links = Vec::new();
        links.try_reserve_exact(n)?;
        links.resize(n, Link::default());
        for k in 0..lists {
            let sentinel = first_sentinel + u32::try_from(k).unwrap_or(u32::MAX);
            links[sentinel as usize] = Link {
                prev: sentinel,
                next: sentinel,
            };
        }
        Ok(Self {
            links,
            lens: vec![0; lists],
            first_sentinel,
        })
    }

    #[inline]
    #[allow(
        clippy::cast_possible_truncation,
        reason = "list < lens.len(), whose sentinels fit u32 (built by `empty`)"
    )]
    fn sentinel(&self, list: usize) -> u32 {
        self.first_sentinel + list as u32
    }

    /// Number of nodes on `list`.
    #[inline]
    pub fn len(&self, list: usize) -> usize {
        self.lens[list]
    }

    /// The front node of `list`, if any.
    #[inline]
    pub fn front(&self, list: usize) -> Option<u32> {
        let sentinel = self.sentinel(list);
        let front = self.links[sentinel as usize].next;
        (front != sentinel).then_some(front)
    }

    /// Remove `node`, which must be on `list`.
    #[inline]
    pub fn unlink(&mut self, list: usize, node: u32) {
        let Link { prev, next } = self.links[node as usize];
        self.links[prev as usize].next = next;
        self.links[next as usize].prev = prev;
        self.lens[list] -= 1;
    }

    /// The node before `node` (a member of `list`), or 0 at the front.
    #[inline]
    pub fn prev_or_front(&self, list: usize, node: u32) -> u32 {
        let prev = self.links[node as usize].prev;
        if prev == self.sentinel(list) {
            0
        } else {
            prev
        }
    }

    /// Insert `node` (on no list) into `list` after `anchor` (a member, or 0: the front) and
    /// after the members that follow it for which `older` holds, searching forward. O(members
    /// passed).
    pub fn insert_after_from(&mut self, list: usize, anchor: u32, node: u32, older: impl FnMut(u32) -> bool) {
        let sentinel = self.sentinel(list);
        let from = if anchor == 0 { sentinel } else { anchor };
        let at = skip_forward(&self.links, from, sentinel, older);
        link_after(&mut self.links, at, node);
        self.lens[list] += 1;
    }

    /// Insert `node` (on no list) into `list` behind the members for which `older` holds,
    /// searching from the back (at the front if none). O(members passed).
    pub fn insert_behind(&mut self, list: usize, node: u32, older: impl FnMut(u32) -> bool) {
        let sentinel = self.sentinel(list);
        let at = skip_backward(&self.links, sentinel, older);
        link_after(&mut self.links, at, node);
        self.lens[list] += 1;
    }

    /// Append `node` (on no list) at the back of `list`.
    #[inline]
    pub fn push_back(&mut self, list: usize, node: u32) {
        let sentinel = self.sentinel(list);
        let tail = self.links[sentinel as usize].prev;
        self.links[node as usize] = Link {
            prev: tail,
            next: sentinel,
        };
        self.links[tail as usize].next = node;
        self.links[sentinel as usize].prev = node;
        self.lens[list] += 1;
    }

    /// Insert `node` (on no list) at the front of `list`.
    #[inline]
    pub fn push_front(&mut self, list: usize, node: u32) {
        let sentinel = self.sentinel(list);
        let head = self.links[sentinel as usize].next;
        self.links[node as usize] = Link {
            prev: sentinel,
            next: head,
        };
        self.links[head as usize].prev = node;
        self.links[sentinel as usize].next = node;
        self.lens[list] += 1;
    }

    /// The nodes of `list`, front first.
    pub fn iter(&self, list: usize) -> ListsIter<'_> {
        let sentinel = self.sentinel(list);
        ListsIter {
            links: &self.links,
            sentinel,
            at: self.links[sentinel as usize].next,
            left: self.lens[list],
        }
    }

    /// Check `list`'s links and length; returns membership per node id (index 0 and the
    /// sentinels never members) or a description of the first violation, naming it `what`.
    pub fn check(&self, list: usize, what: &str) -> Result<Vec<bool>, String> {
        let sentinel = self.sentinel(list);
        let mut member = vec![false; self.first_sentinel as usize];
        let mut seen = 0usize;
        let mut prev = sentinel;
        let mut at = self.links[sentinel as usize].next;
        while at != sentinel {
            let Some(slot) = member.get_mut(at as usize).filter(|_| at != 0) else {
                return Err(format!("{what} links to node {at}, out of range"));
            };
            if seen >= self.lens[list] || *slot {
                return Err(format!("{what} is longer than its length {}", self.lens[list]));
            }
            *slot = true;
            if self.links[at as usize].prev != prev {
                return Err(format!("{what} link of node {at} is broken"));
            }
            prev = at;
            at = self.links[at as usize].next;
            seen += 1;
        }
        if seen != self.lens[list] || self.links[sentinel as usize].prev != prev {
            return Err(format!(
                "{what} holds {seen} nodes but its length is {}",
                self.lens[list]
            ));
        }
        Ok(member)
    }
}

/// Iterator over one list of an [`LruLists`], front first.
pub struct ListsIter<'a> {
    links: &'a [Link],
    sentinel: u32,
    at: u32,
    left: usize,
}

impl Iterator for ListsIter<'_> {
    type Item = u32;

    #[inline]
    fn next(&mut self) -> Option<u32> {
        if self.at == self.sentinel || self.left == 0 {
            return None;
        }
        let node = self.at;
        self.at = self.links[node as usize].next;
        self.left -= 1;
        Some(node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(list: &LruList) -> Vec<u32> {
        list.iter().collect()
    }

    #[test]
    fn lists_share_links_and_keep_their_orders() {
        let mut lists = LruLists::empty(6, 3).unwrap();
        lists.push_back(0, 3);
        lists.push_back(1, 1);
        lists.push_front(0, 5);
        lists.push_back(2, 6);
        lists.push_back(1, 2);
        let all = |l: &LruLists| (0..3).map(|k| l.iter(k).collect::<Vec<_>>()).collect::<Vec<_>>();
        assert_eq!(all(&lists), vec![vec![5, 3], vec![1, 2], vec![6]]);
        assert_eq!((lists.front(0), lists.front(1), lists.len(2)), (Some(5), Some(1), 1));
        // A node moves from one list to another.
        lists.unlink(0, 3);
        lists.push_front(1, 3);
        lists.unlink(2, 6);
        assert_eq!(all(&lists), vec![vec![5], vec![3, 1, 2], vec![]]);
        assert_eq!(lists.front(2), None);
        assert_eq!(
            lists.check(1, "l").unwrap(),
            vec![false, true, true, true, false, false, false]
        );
        for k in 0..3 {
            lists.check(k, "l").unwrap();
        }
    }

    #[test]
    fn insert_behind_places_a_node_after_the_last_older_member() {
        // Nodes 1..=3 aged 10, 20, 30, oldest first; a node of age 25 goes behind 20, one of 5
        // to the front, one of 40 to the back, one of 30 behind the 30 already there.
        let age = |m: u32| [0u64, 10, 20, 30, 0, 25, 5, 40, 30][m as usize];
        let mut list = LruList::empty(8).unwrap();
        for node in 1..=3 {
            list.push_back(node);
        }
        for node in 5..=8 {
            list.insert_behind(node, |m| age(m) <= age(node));
        }
        assert_eq!(order(&list), vec![6, 1, 2, 5, 3, 8, 7]);
        list.check("l").unwrap();
        let mut lists = LruLists::empty(8, 2).unwrap();
        for node in 1..=3 {
            lists.push_back(1, node);
        }
        for node in [5, 6] {
            lists.insert_behind(1, node, |m| age(m) <= age(node));
        }
        assert_eq!(lists.iter(1).collect::<Vec<_>>(), vec![6, 1, 2, 5, 3]);
        assert_eq!(lists.len(0), 0);
        lists.check(1, "l").unwrap();
        // From an anchor, forward: node 8 (30) from 1 passes 2, 5, 3 (all <= 30); node 7 (40)
        // from the front passes everything; the previous entry of each, 0 at the front.
        lists.insert_after_from(1, 1, 8, |m| age(m) <= age(8));
        lists.insert_after_from(1, 0, 7, |m| age(m) <= age(7));
        assert_eq!(lists.iter(1).collect::<Vec<_>>(), vec![6, 1, 2, 5, 3, 8, 7]);
        assert_eq!((lists.prev_or_front(1, 6), lists.prev_or_front(1, 5)), (0, 2));
        lists.check(1, "l").unwrap();
        let mut list = LruList::empty(8).unwrap();
        for node in [6, 1, 3] {
            list.push_back(node);
        }
        list.insert_after_from(6, 2, |m| age(m) <= age(2));
        list.insert_after_from(0, 5, |m| age(m) <= age(5));
        assert_eq!(order(&list), vec![6, 1, 2, 5, 3]);
        assert_eq!((list.prev_or_front(6), list.prev_or_front(3)), (0, 5));
        list.check("l").unwrap();
    }

    #[test]
    fn filled_and_empty_lists() {
        let list = LruList::filled(4).unwrap();
        assert_eq!((order(&list), list.len(), list.front()), (vec![1, 2, 3, 4], 4, Some(1)));
        assert_eq!(list.check("l").unwrap(), vec![false, true, true, true, true]);
        for list in [LruList::filled(0).unwrap(), LruList::empty(3).unwrap()] {
            assert!(list.is_empty() && list.front().is_none() && order(&list).is_empty());
            list.check("l").unwrap();
        }
    }

    #[test]
    fn push_unlink_and_pop_keep_lru_order() {
        let mut list = LruList::empty(5).unwrap();
        list.push_back(3);
        list.push_back(1);
        list.push_front(5);
        list.push_back(2);
        assert_eq!(order(&list), vec![5, 3, 1, 2]);
        // Unlink from the middle, the front and the back.
        list.unlink(1);
        list.unlink(5);
        list.unlink(2);
        assert_eq!((order(&list), list.len()), (vec![3], 1));
        list.push_back(4);
        assert_eq!(list.next(3), Some(4));
        assert_eq!(list.next(4), None);
        assert_eq!(list.pop_front(), Some(3));
        assert_eq!(list.pop_front(), Some(4));
        assert_eq!(list.pop_front(), None);
        list.check("l").unwrap();
    }

    #[test]
    fn pop_front_into_cuts_a_prefix() {
        let mut list = LruList::filled(5).unwrap();
        let mut out = vec![9];
        list.pop_front_into(&mut out, 0);
        list.pop_front_into(&mut out, 2);
        assert_eq!((out.as_slice(), order(&list)), (&[9, 1, 2][..], vec![3, 4, 5]));
        list.check("l").unwrap();
        list.pop_front_into(&mut out, 3);
        assert_eq!((out.len(), list.len(), list.front()), (6, 0, None));
        list.check("l").unwrap();
        list.push_front(2);
        assert_eq!(order(&list), vec![2]);
        list.check("l").unwrap();
    }

    #[test]
    fn check_reports_broken_links_and_lengths() {
        let mut list = LruList::filled(3).unwrap();
        list.len = 2;
        assert!(list.check("free list").unwrap_err().starts_with("free list is longer"));
        list.len = 4;
        assert!(list.check("l").unwrap_err().contains("holds 3 nodes"));
        let mut list = LruList::filled(3).unwrap();
        list.links[2].prev = 3;
        assert_eq!(list.check("l").unwrap_err(), "l link of node 2 is broken");
        let mut list = LruList::filled(3).unwrap();
        list.links[3].next = 9;
        assert!(list.check("l").unwrap_err().contains("out of range"));
    }
}

#[cfg(test)]
mod properties {
    use proptest::prelude::*;

    use super::LruList;

    #[derive(Clone, Debug)]
    enum Op {
        PushBack(u32),
        PushFront(u32),
        Unlink(u32),
        PopFront,
        PopFrontInto(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1u32..=8).prop_map(Op::PushBack),
            (1u32..=8).prop_map(Op::PushFront),
            (1u32..=8).prop_map(Op::Unlink),
            Just(Op::PopFront),
            (0usize..4).prop_map(Op::PopFrontInto),
        ]
    }

    proptest! {
        /// Random operations agree with a `Vec` model (members only unlinked, non-members only
        /// pushed, as the callers guarantee) and keep the links consistent.
        #[test]
        fn agrees_with_a_vec_model(ops in proptest::collection::vec(op(), 0..80)) {
            let mut list = LruList::empty(8).unwrap();
            let mut model: Vec<u32> = Vec::new();
            for op in ops {
                match op {
                    Op::PushBack(n) if !model.contains(&n) => {
                        list.push_back(n);
                        model.push(n);
                    }
                    Op::PushFront(n) if !model.contains(&n) => {
                        list.push_front(n);
                        model.insert(0, n);
                    }
                    Op::Unlink(n) if model.contains(&n) => {
                        list.unlink(n);
                        model.retain(|&m| m != n);
                    }
                    Op::PopFront => {
                        let want = (!model.is_empty()).then(|| model.remove(0));
                        prop_assert_eq!(list.pop_front(), want);
                    }
                    Op::PopFrontInto(k) if k <= model.len() => {
                        let mut out = Vec::new();
                        list.pop_front_into(&mut out, k);
                        prop_assert_eq!(out, model.drain(..k).collect::<Vec<_>>());
                    }
                    _ => {}
                }
                prop_assert_eq!(list.iter().collect::<Vec<_>>(), model.clone());
                prop_assert_eq!(list.len(), model.len());
                prop_assert_eq!(list.front(), model.first().copied());
                let member = list.check("l").map_err(TestCaseError::fail)?;
                for node in 0..=8u32 {
                    prop_assert_eq!(member[node as usize], model.contains(&node));
                }
            }
        }
    }
}
