//! Block records and the paged slabs that hold them.
//!
//! A block record is 24 bytes: the block's 64-bit hash and its holder set, two holders
//! inline (the common case) or a pointer to an overflow record (see `holders`). Slots are
//! recycled through a free list threaded through `Block::a`.

/// No node, no block, no holder.
pub(super) const NIL: u32 = u32::MAX;
/// In `Block::b`: the holders live in overflow record number `Block::a`.
pub(super) const SPILLED: u32 = u32::MAX - 1;
/// In `Block::b`: the slot is free (`Block::a` links the free list).
pub(super) const FREE: u32 = u32::MAX - 2;
pub(super) const BLOCK_PAGE: usize = 1 << 12;

/// Inline: `a`, `b` are holder node ids (`NIL` when absent, `a` filled first) touched at
/// `sa`, `sb`. Spilled: `a` = overflow record, `b` = `SPILLED`. Free: `b` = `FREE`, `a` = next
/// free slot.
#[derive(Clone, Copy)]
pub(super) struct Block {
    pub(super) hash: u64,
    pub(super) a: u32,
    pub(super) b: u32,
    pub(super) sa: u32,
    pub(super) sb: u32,
}

pub(super) const FREE_BLOCK: Block = Block {
    hash: 0,
    a: NIL,
    b: FREE,
    sa: 0,
    sb: 0,
};

impl Block {
    /// A live record for hash h, without holders yet.
    pub(super) fn new(hash: u64) -> Self {
        Block {
            hash,
            a: NIL,
            b: NIL,
            sa: 0,
            sb: 0,
        }
    }

    pub(super) fn is_free(&self) -> bool {
        self.b == FREE
    }
}

/// Fixed-size pages addressed by a u32 index.
pub(super) struct Pages<T, const LEN: usize> {
    pages: Vec<Box<[T; LEN]>>,
}

impl<T: Copy, const LEN: usize> Pages<T, LEN> {
    pub(super) fn new() -> Self {
        Pages { pages: Vec::new() }
    }

    /// `LEN` is a power of two, so the offset in a page needs no bounds check.
    #[inline]
    pub(super) fn get(&self, i: u32) -> Option<&T> {
        let page = self.pages.get(i as usize / LEN)?;
        page.get(i as usize % LEN)
    }

    #[inline]
    pub(super) fn get_mut(&mut self, i: u32) -> Option<&mut T> {
        let page = self.pages.get_mut(i as usize / LEN)?;
        page.get_mut(i as usize % LEN)
    }

    pub(super) fn slots(&self) -> usize {
        self.pages.len() * LEN
    }

    pub(super) fn grow(&mut self, fill: T) {
        if let Ok(page) = vec![fill; LEN].into_boxed_slice().try_into() {
            self.pages.push(page);
        }
    }

    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.pages.iter_mut().flat_map(|p| p.iter_mut())
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.pages.len() * LEN * core::mem::size_of::<T>()
            + self.pages.capacity() * core::mem::size_of::<Box<[T; LEN]>>()
    }
}
