//! Per-worker LRU lists of index entries.
//!
//! Each worker has its own paged slab of 12-byte nodes `{prev, next, block}` forming an
//! intrusive doubly linked list, most recently used at the head. The worker is not stored in
//! the node: it is implied by the slab and encoded in the node id (`worker << 24 | local`),
//! which is what the block records keep as holders.

use super::blocks::{Pages, NIL};

const LOCAL_BITS: u32 = 24;
const LOCAL_MASK: u32 = (1 << LOCAL_BITS) - 1;
/// Local node indices stay below this so that no node id equals `NIL`, `SPILLED` or `FREE`.
pub(super) const LOCAL_LIMIT: u32 = LOCAL_MASK - 2;
const NODE_PAGE: usize = 1 << 10;

#[inline]
pub(super) fn node_id(w: usize, local: u32) -> u32 {
    ((w as u32) << LOCAL_BITS) | (local & LOCAL_MASK)
}

#[inline]
pub(super) fn worker_of(id: u32) -> usize {
    (id >> LOCAL_BITS) as usize
}

#[inline]
pub(super) fn local_of(id: u32) -> u32 {
    id & LOCAL_MASK
}

/// One (block, worker) entry: a link in its worker's LRU list.
#[derive(Clone, Copy)]
pub(super) struct Node {
    pub(super) prev: u32,
    pub(super) next: u32,
    pub(super) block: u32,
}

const FREE_NODE: Node = Node {
    prev: NIL,
    next: NIL,
    block: NIL,
};

pub(super) struct Worker {
    pub(super) nodes: Pages<Node, NODE_PAGE>,
    /// Slots handed out so far (free ones are on `free`).
    len: u32,
    free: u32,
    /// Most recently used.
    pub(super) head: u32,
    /// Least recently used.
    pub(super) tail: u32,
    /// Stamp of `tail`, so `lookup` can tell per worker whether any of its entries is expired
    /// and skip stamp checks for workers with none.
    pub(super) tail_stamp: u32,
    pub(super) count: u32,
    pub(super) cap: u32,
}

impl Worker {
    pub(super) fn new(cap: u32) -> Self {
        Worker {
            nodes: Pages::new(),
            len: 0,
            free: NIL,
            head: NIL,
            tail: NIL,
            tail_stamp: u32::MAX,
            count: 0,
            cap,
        }
    }

    pub(super) fn unlink(&mut self, l: u32) {
        let Some(n) = self.nodes.get_mut(l) else {
            return;
        };
        let (prev, next) = (n.prev, n.next);
        n.prev = NIL;
        n.next = NIL;
        match self.nodes.get_mut(prev) {
            Some(p) => p.next = next,
            None => self.head = next,
        }
        match self.nodes.get_mut(next) {
            Some(x) => x.prev = prev,
            None => self.tail = prev,
        }
    }

    pub(super) fn push_front(&mut self, l: u32) {
        let old = self.head;
        let Some(n) = self.nodes.get_mut(l) else {
            return;
        };
        n.prev = NIL;
        n.next = old;
        match self.nodes.get_mut(old) {
            Some(h) => h.prev = l,
            None => self.tail = l,
        }
        self.head = l;
    }

    pub(super) fn alloc(&mut self, block: u32) -> Option<u32> {
        let l = if self.free != NIL {
            let l = self.free;
            self.free = self.nodes.get(l)?.next;
            l
        } else {
            if self.len >= LOCAL_LIMIT {
                return None;
            }
            if self.len as usize >= self.nodes.slots() {
                self.nodes.grow(FREE_NODE);
            }
            self.len += 1;
            self.len - 1
        };
        *self.nodes.get_mut(l)? = Node {
            prev: NIL,
            next: NIL,
            block,
        };
        self.push_front(l);
        self.count += 1;
        Some(l)
    }

    /// Moves the LRU node to the front for `block`: returns it and the block it held.
    pub(super) fn recycle_tail(&mut self, block: u32) -> Option<(u32, u32)> {
        let l = self.tail;
        let n = self.nodes.get_mut(l)?;
        let (prev, old) = (n.prev, n.block);
        n.block = block;
        if self.head == l {
            return Some((l, old));
        }
        let head = self.head;
        n.prev = NIL;
        n.next = head;
        if let Some(p) = self.nodes.get_mut(prev) {
            p.next = NIL;
        }
        self.tail = prev;
        if let Some(h) = self.nodes.get_mut(head) {
            h.prev = l;
        }
        self.head = l;
        Some((l, old))
    }

    pub(super) fn release(&mut self, l: u32) {
        self.unlink(l);
        if let Some(n) = self.nodes.get_mut(l) {
            n.block = NIL;
            n.next = self.free;
            self.free = l;
            self.count = self.count.saturating_sub(1);
        }
    }
}
