//! Holder sets: which workers hold a block, as (node id, stamp) pairs.
//!
//! Up to two holders sit inline in the block record, the common case. A third holder
//! spills the set into an `Overflow` record (a 256-bit worker set plus the pairs), so a hot
//! shared prefix costs one bitset read per block on lookup, whatever the number of holders.
//! Back to two holders, the set moves inline again and the record is recycled.

use super::blocks::{Block, FREE, NIL, SPILLED};
use super::lru::{local_of, node_id, worker_of};

/// A set of workers, one bit per worker id.
pub(super) type Bits = [u64; 4];

#[inline]
pub(super) fn bit_get(s: &Bits, w: usize) -> bool {
    s.get((w >> 6) & 3)
        .is_some_and(|x| (x >> (w & 63)) & 1 != 0)
}

#[inline]
pub(super) fn bit_set(s: &mut Bits, w: usize) {
    if let Some(x) = s.get_mut((w >> 6) & 3) {
        *x |= 1 << (w & 63);
    }
}

#[inline]
fn bit_clear(s: &mut Bits, w: usize) {
    if let Some(x) = s.get_mut((w >> 6) & 3) {
        *x &= !(1 << (w & 63));
    }
}

#[inline]
pub(super) fn any(s: &Bits) -> bool {
    (s[0] | s[1] | s[2] | s[3]) != 0
}

#[inline]
fn and(a: &Bits, b: &Bits) -> Bits {
    let mut out = *a;
    for (x, y) in out.iter_mut().zip(b) {
        *x &= y;
    }
    out
}

/// Holder set of a block with 3 or more holders: (node id, stamp) pairs plus their workers as
/// a bitset for lookups.
#[derive(Default)]
pub(super) struct Overflow {
    pub(super) bits: Bits,
    pub(super) held: Vec<(u32, u32)>,
}

/// Where worker w's pair sits in `o`, when w holds the block.
#[inline]
fn pair_of(o: &Overflow, w: usize) -> Option<usize> {
    if !bit_get(&o.bits, w) {
        return None;
    }
    o.held.iter().position(|(id, _)| worker_of(*id) == w)
}

/// The overflow records of every spilled block, recycled through a free list.
#[derive(Default)]
pub(super) struct OverflowPool {
    records: Vec<Overflow>,
    free: Vec<u32>,
}

impl OverflowPool {
    /// Node of worker w in the holder set of `blk`.
    pub(super) fn find(&self, blk: &Block, w: usize) -> Option<u32> {
        match blk.b {
            FREE => None,
            SPILLED => {
                let o = self.records.get(blk.a as usize)?;
                let &(id, _) = o.held.get(pair_of(o, w)?)?;
                Some(local_of(id))
            }
            _ => [blk.a, blk.b]
                .into_iter()
                .find(|&id| id != NIL && worker_of(id) == w)
                .map(local_of),
        }
    }

    /// When worker w last touched `blk`.
    pub(super) fn stamp(&self, blk: &Block, w: usize) -> Option<u32> {
        match blk.b {
            FREE => None,
            SPILLED => {
                let o = self.records.get(blk.a as usize)?;
                o.held
                    .iter()
                    .find(|(id, _)| worker_of(*id) == w)
                    .map(|&(_, s)| s)
            }
            _ => {
                if blk.a != NIL && worker_of(blk.a) == w {
                    Some(blk.sa)
                } else if blk.b != NIL && worker_of(blk.b) == w {
                    Some(blk.sb)
                } else {
                    None
                }
            }
        }
    }

    /// If w holds `blk`: refresh its stamp and return its node.
    pub(super) fn touch(&mut self, blk: &mut Block, w: usize, stamp: u32) -> Option<u32> {
        match blk.b {
            FREE => None,
            SPILLED => {
                let o = self.records.get_mut(blk.a as usize)?;
                let k = pair_of(o, w)?;
                let (id, s) = o.held.get_mut(k)?;
                *s = stamp;
                Some(local_of(*id))
            }
            _ => {
                if blk.a != NIL && worker_of(blk.a) == w {
                    blk.sa = stamp;
                    Some(local_of(blk.a))
                } else if blk.b != NIL && worker_of(blk.b) == w {
                    blk.sb = stamp;
                    Some(local_of(blk.b))
                } else {
                    None
                }
            }
        }
    }

    /// Adds node l of worker w (not yet a holder) to the holders of `blk`.
    pub(super) fn add(&mut self, blk: &mut Block, w: usize, l: u32, stamp: u32) -> bool {
        let id = node_id(w, l);
        match blk.b {
            FREE => return false,
            SPILLED => {
                let Some(o) = self.records.get_mut(blk.a as usize) else {
                    return false;
                };
                o.held.push((id, stamp));
                bit_set(&mut o.bits, w);
                return true;
            }
            _ => {}
        }
        if blk.a == NIL {
            (blk.a, blk.sa) = (id, stamp);
            return true;
        }
        if blk.b == NIL {
            (blk.b, blk.sb) = (id, stamp);
            return true;
        }
        let mut o = Overflow {
            bits: [0; 4],
            held: vec![(blk.a, blk.sa), (blk.b, blk.sb), (id, stamp)],
        };
        for &(x, _) in &o.held {
            bit_set(&mut o.bits, worker_of(x));
        }
        let slot = match self.free.pop() {
            Some(i) => match self.records.get_mut(i as usize) {
                Some(s) => {
                    *s = o;
                    i
                }
                None => return false,
            },
            None => {
                let Ok(i) = u32::try_from(self.records.len()) else {
                    return false;
                };
                self.records.push(o);
                i
            }
        };
        blk.a = slot;
        blk.b = SPILLED;
        true
    }

    /// Removes w from the holders of `blk`; true when it has no holder left.
    pub(super) fn remove(&mut self, blk: &mut Block, w: usize) -> bool {
        match blk.b {
            FREE => return false,
            SPILLED => {
                let oi = blk.a;
                let Some(o) = self.records.get_mut(oi as usize) else {
                    return false;
                };
                if let Some(pos) = o.held.iter().position(|(id, _)| worker_of(*id) == w) {
                    o.held.swap_remove(pos);
                    bit_clear(&mut o.bits, w);
                }
                if o.held.len() <= 2 {
                    (blk.a, blk.sa) = o.held.first().copied().unwrap_or((NIL, 0));
                    (blk.b, blk.sb) = o.held.get(1).copied().unwrap_or((NIL, 0));
                    *o = Overflow::default();
                    self.free.push(oi);
                }
            }
            _ => {
                if blk.a != NIL && worker_of(blk.a) == w {
                    (blk.a, blk.sa) = (blk.b, blk.sb);
                    blk.b = NIL;
                } else if blk.b != NIL && worker_of(blk.b) == w {
                    blk.b = NIL;
                }
            }
        }
        blk.a == NIL
    }

    /// Holders of `blk` among `active` whose entry is fresh. Stamps are compared only for
    /// workers in `stale` (those with at least one expired entry).
    #[inline]
    pub(super) fn fresh(&self, blk: &Block, active: &Bits, stale: &Bits, thr: u64) -> Bits {
        let mut out: Bits = [0; 4];
        match blk.b {
            FREE => {}
            SPILLED => {
                let Some(o) = self.records.get(blk.a as usize) else {
                    return out;
                };
                out = and(&o.bits, active);
                if any(&and(&out, stale)) {
                    for &(id, s) in &o.held {
                        if (s as u64) < thr {
                            bit_clear(&mut out, worker_of(id));
                        }
                    }
                }
            }
            _ => {
                for (id, s) in [(blk.a, blk.sa), (blk.b, blk.sb)] {
                    if id == NIL {
                        continue;
                    }
                    let w = worker_of(id);
                    if bit_get(active, w) && (!bit_get(stale, w) || s as u64 >= thr) {
                        bit_set(&mut out, w);
                    }
                }
            }
        }
        out
    }

    /// Moves every stamp s ms back (the index's epoch moved forward by s).
    pub(super) fn rebase(&mut self, s: u32) {
        for o in self.records.iter_mut() {
            for (_, st) in o.held.iter_mut() {
                *st = st.saturating_sub(s);
            }
        }
    }

    pub(super) fn heap_bytes(&self) -> usize {
        let held: usize = self
            .records
            .iter()
            .map(|o| o.held.capacity() * core::mem::size_of::<(u32, u32)>())
            .sum();
        self.records.capacity() * core::mem::size_of::<Overflow>() + held + self.free.capacity() * 4
    }

    #[cfg(test)]
    pub(super) fn record(&self, i: u32) -> Option<&Overflow> {
        self.records.get(i as usize)
    }
}
