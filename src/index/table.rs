//! The block table: an open-addressing set of `u32` values (block slots) keyed by a mixed
//! 64-bit hash, one 64-byte cache line per probe step.
//!
//! The table stores values only, never their keys: callers pass the key's mixed hash and an
//! equality test on values, and growth asks them for a value's hash again (`rehash`). So the
//! table does not know what a value refers to, and the 64-bit hash lives once, in the caller's
//! record.

/// Slots per table line: 12 tags + a spill count + 12 values fill one 64-byte cache line.
const LINE_SLOTS: usize = 12;
/// Lines a probe may walk from a key's home line. A key is never stored further, so finding
/// it needs no more; under a secret hash key an honest table at 7/8 load gets nowhere near
/// this, and a flood of colliding keys gives up here (counted) instead of making every probe
/// of that line walk the table.
pub(super) const MAX_PROBE_LINES: usize = 128;
/// Table lines per key that `warm_probe` reads.
const WARM_LINES: usize = 3;
/// 0x01 in each byte.
const BYTE_ONES: u64 = u64::MAX / 0xff;
const BYTE_LOW7: u64 = BYTE_ONES * 0x7f;
/// The high bits of the tag bytes in `Line::hi`.
const HI_TAG_BITS: u64 = 0x8080_8080;
const SPILL_ONE: u64 = 1 << 32;

/// One cache line of the block table: 12 slots. Tags (0: empty, else 8 bits of the key's
/// hash, never 0) are the bytes of `lo` (slots 0-7) and the low 4 bytes of `hi` (slots 8-11);
/// the top half of `hi` is the spill count: the number of keys whose probe went past this
/// line (home line at or before it, stored after it). A search stops at the first line with
/// no spill, so deletion needs no tombstones. `vals[j]` is the block slot stored in slot j.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line {
    lo: u64,
    hi: u64,
    vals: [u32; LINE_SLOTS],
}

const EMPTY_LINE: Line = Line {
    lo: 0,
    hi: 0,
    vals: [0; LINE_SLOTS],
};

/// High bit of each byte of x that is zero (exact: no false positives).
#[inline]
fn zero_bytes(x: u64) -> u64 {
    let y = (x & BYTE_LOW7).wrapping_add(BYTE_LOW7);
    !(y | x | BYTE_LOW7)
}

/// Slots of a line, as the high bits of their tag bytes.
#[derive(Clone, Copy)]
struct Hits {
    lo: u64,
    hi: u64,
}

impl Iterator for Hits {
    type Item = usize;

    #[inline]
    fn next(&mut self) -> Option<usize> {
        if self.lo != 0 {
            let j = (self.lo.trailing_zeros() >> 3) as usize;
            self.lo &= self.lo - 1;
            Some(j)
        } else if self.hi != 0 {
            let j = (self.hi.trailing_zeros() >> 3) as usize;
            self.hi &= self.hi - 1;
            Some(8 + j)
        } else {
            None
        }
    }
}

impl Line {
    #[inline]
    fn spill(&self) -> u32 {
        (self.hi >> 32) as u32
    }

    /// The slots whose tag is t (t = 0: the empty slots).
    #[inline]
    fn hits(&self, t: u8) -> Hits {
        let b = u64::from(t) * BYTE_ONES;
        Hits {
            lo: zero_bytes(self.lo ^ b),
            hi: zero_bytes(self.hi ^ b) & HI_TAG_BITS,
        }
    }

    /// The slots in use.
    #[inline]
    fn full(&self) -> Hits {
        let e = self.hits(0);
        Hits {
            lo: !e.lo & (BYTE_ONES << 7),
            hi: !e.hi & HI_TAG_BITS,
        }
    }

    #[inline]
    fn set_tag(&mut self, j: usize, t: u8) {
        if j < 8 {
            let shift = 8 * j;
            self.lo = (self.lo & !(0xff << shift)) | (u64::from(t) << shift);
        } else {
            let shift = 8 * (j & 3);
            self.hi = (self.hi & !(0xff << shift)) | (u64::from(t) << shift);
        }
    }
}

#[inline]
fn tag_of(m: u64) -> u8 {
    let t = m as u8;
    t | u8::from(t == 0)
}

pub(super) enum Probe {
    Found(u32),
    Added,
    /// Not found and no room (the table could not grow).
    Full,
}

/// Open-addressing set of block slots keyed by the (mixed) hash of their block, one cache
/// line per probe step: finding, adding or removing a key whose home line is not full reads
/// one line. The line count is not a power of two (the home line is a multiply-high of the
/// hash), so `reserve` sizes the table to what it is asked for. It grows (doubling) past
/// 7/8 load; `reserve` sizes it for 3/4.
pub(super) struct SlotTable {
    lines: Vec<Line>,
    len: usize,
    /// Probes that gave up at `MAX_PROBE_LINES` (an insert refused, or a value lost in a
    /// rebuild; a find that stops there finds nothing that could be stored further).
    gave_up: core::cell::Cell<u64>,
}

impl SlotTable {
    pub(super) fn new() -> Self {
        SlotTable {
            lines: Vec::new(),
            len: 0,
            gave_up: core::cell::Cell::new(0),
        }
    }

    pub(super) fn probes_given_up(&self) -> u64 {
        self.gave_up.get()
    }

    fn give_up(&self) {
        self.gave_up.set(self.gave_up.get().saturating_add(1));
    }

    /// Lines a probe walks at most.
    #[inline]
    fn probe_limit(&self) -> usize {
        self.lines.len().min(MAX_PROBE_LINES)
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(super) fn allocation_size(&self) -> usize {
        self.lines.capacity() * core::mem::size_of::<Line>()
    }

    /// Lines needed to hold n keys at 3/4 load.
    fn lines_for(n: usize) -> usize {
        n.div_ceil(LINE_SLOTS * 3 / 4).max(1)
    }

    #[inline]
    fn home(&self, m: u64) -> usize {
        ((u128::from(m) * self.lines.len() as u128) >> 64) as usize
    }

    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 >= self.lines.len() {
            0
        } else {
            i + 1
        }
    }

    /// Reads m's home line and returns a word of it, so that a loop of calls on independent
    /// keys has their cache misses in flight together (the caller hands the result to
    /// `black_box`).
    #[inline]
    pub(super) fn warm(&self, m: u64) -> u32 {
        self.lines.get(self.home(m)).map_or(0, Line::spill)
    }

    /// Reads what `find` of m reads after the home line: the caller's records that its tag
    /// matches (`read` loads one and returns a word of it) and, when the home line spilled,
    /// the next lines (up to `WARM_LINES` in all).
    #[inline]
    pub(super) fn warm_probe(&self, m: u64, read: impl Fn(u32) -> u64) -> u64 {
        let t = tag_of(m);
        let mut i = self.home(m);
        let mut acc = 0;
        for _ in 0..WARM_LINES {
            let Some(line) = self.lines.get(i) else {
                break;
            };
            for j in line.hits(t) {
                if let Some(&v) = line.vals.get(j) {
                    acc ^= read(v);
                }
            }
            if line.spill() == 0 {
                break;
            }
            i = self.next(i);
        }
        acc
    }

    /// First value stored under m for which `eq` holds.
    #[inline]
    pub(super) fn find(&self, m: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        let t = tag_of(m);
        let mut i = self.home(m);
        for _ in 0..self.probe_limit() {
            let line = self.lines.get(i)?;
            for j in line.hits(t) {
                if let Some(&v) = line.vals.get(j) {
                    if eq(v) {
                        return Some(v);
                    }
                }
            }
            if line.spill() == 0 {
                return None;
            }
            i = self.next(i);
        }
        None
    }

    /// The value under m for which `eq` holds, or else stores v under m.
    #[inline]
    pub(super) fn find_or_insert(
        &mut self,
        m: u64,
        v: u32,
        mut eq: impl FnMut(u32) -> bool,
        rehash: impl Fn(u32) -> u64,
    ) -> Probe {
        let t = tag_of(m);
        let n = self.probe_limit();
        let home = self.home(m);
        let mut i = home;
        let mut steps = 0usize;
        // First empty slot on the probe path: (line, slot, lines before it).
        let mut vacant = None;
        while let Some(line) = self.lines.get(i) {
            for j in line.hits(t) {
                if let Some(&x) = line.vals.get(j) {
                    if eq(x) {
                        return Probe::Found(x);
                    }
                }
            }
            if vacant.is_none() {
                vacant = line.hits(0).next().map(|j| (i, j, steps));
            }
            if line.spill() == 0 {
                break;
            }
            steps += 1;
            if steps >= n {
                break;
            }
            i = self.next(i);
        }
        let grow = (self.len + 1) * 8 > self.lines.len() * LINE_SLOTS * 7;
        let Some((at, j, steps)) = vacant.filter(|_| !grow) else {
            // Growing, or no empty slot before the end of the key's probe: the slow way.
            return if self.insert(m, v, rehash) {
                Probe::Added
            } else {
                Probe::Full
            };
        };
        if let Some(line) = self.lines.get_mut(at) {
            line.set_tag(j, t);
            if let Some(val) = line.vals.get_mut(j) {
                *val = v;
            }
        }
        self.count_spill(home, steps, true);
        self.len += 1;
        Probe::Added
    }

    /// Stores v under m; the caller knows that no equal key is present. `rehash` gives the
    /// mixed hash of a stored value, for growth. False only if the table cannot grow.
    #[inline]
    fn insert(&mut self, m: u64, v: u32, rehash: impl Fn(u32) -> u64) -> bool {
        if (self.len + 1) * 8 > self.lines.len() * LINE_SLOTS * 7 {
            let want = Self::lines_for(self.len + 1).max(self.lines.len() * 2);
            self.rebuild(want, rehash);
        }
        self.place(m, v)
    }

    #[inline]
    fn place(&mut self, m: u64, v: u32) -> bool {
        let home = self.home(m);
        let mut i = home;
        let mut steps = 0usize;
        loop {
            let Some(line) = self.lines.get_mut(i) else {
                return false;
            };
            if let Some(j) = line.hits(0).next() {
                line.set_tag(j, tag_of(m));
                if let Some(val) = line.vals.get_mut(j) {
                    *val = v;
                }
                break;
            }
            steps += 1;
            if steps >= self.probe_limit() {
                self.give_up();
                return false;
            }
            i = self.next(i);
        }
        self.count_spill(home, steps, true);
        self.len += 1;
        true
    }

    /// Walks the probe path from line `home` until `hit` succeeds on a line and returns how
    /// many lines it went past. Gives up after a line with no spill (no key of this path
    /// lies beyond it) unless `to_end`, and after every line.
    #[inline]
    fn walk_mut(
        &mut self,
        home: usize,
        to_end: bool,
        mut hit: impl FnMut(&mut Line) -> bool,
    ) -> Option<usize> {
        let mut i = home;
        let mut steps = 0usize;
        loop {
            let line = self.lines.get_mut(i)?;
            if hit(line) {
                return Some(steps);
            }
            if !to_end && line.spill() == 0 {
                return None;
            }
            steps += 1;
            if steps >= self.lines.len().min(MAX_PROBE_LINES) {
                return None;
            }
            i = self.next(i);
        }
    }

    /// A key stored `steps` lines past its home line is counted in the spill of each line
    /// it passed: `add` when it is stored, not when it is removed.
    #[inline]
    fn count_spill(&mut self, home: usize, steps: usize, add: bool) {
        let mut i = home;
        for _ in 0..steps {
            if let Some(line) = self.lines.get_mut(i) {
                if add {
                    line.hi = line.hi.wrapping_add(SPILL_ONE);
                } else if line.spill() > 0 {
                    line.hi -= SPILL_ONE;
                }
            }
            i = self.next(i);
        }
    }

    /// Removes value v stored under m; false when it is not there.
    #[inline]
    pub(super) fn remove(&mut self, m: u64, v: u32) -> bool {
        let t = tag_of(m);
        let home = self.home(m);
        let removed = self.walk_mut(home, false, |line| {
            let found = line.hits(t).find(|&j| line.vals.get(j) == Some(&v));
            if let Some(j) = found {
                line.set_tag(j, 0);
            }
            found.is_some()
        });
        let Some(steps) = removed else {
            return false;
        };
        self.count_spill(home, steps, false);
        self.len -= 1;
        true
    }

    /// Makes room for n keys in total at 3/4 load.
    pub(super) fn reserve(&mut self, n: usize, rehash: impl Fn(u32) -> u64) {
        let want = Self::lines_for(n);
        if want > self.lines.len() {
            self.rebuild(want, rehash);
        }
    }

    fn rebuild(&mut self, lines: usize, rehash: impl Fn(u32) -> u64) {
        let old = core::mem::replace(&mut self.lines, vec![EMPTY_LINE; lines]);
        self.len = 0;
        for line in &old {
            for j in line.full() {
                if let Some(&v) = line.vals.get(j) {
                    self.place(rehash(v), v);
                }
            }
        }
    }

    #[cfg(test)]
    pub(super) fn values(&self) -> impl Iterator<Item = u32> + '_ {
        self.lines
            .iter()
            .flat_map(|l| l.full().map(move |j| l.vals[j]))
    }
}

#[cfg(test)]
#[cfg(not(target_arch = "wasm32"))]
#[path = "table_tests.rs"]
mod tests;
