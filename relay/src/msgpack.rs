//! A small zero-copy MessagePack reader (only what KV event batches need) and a writer used
//! by tests, the benchmark and fake engines. The reader never panics on malformed input: every
//! read is bounds-checked and returns `None` on garbage.

/// One decoded scalar or container header.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value<'a> {
    Nil,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    /// Array header: the next `n` values are its items.
    Array(usize),
    /// Map header: the next `2n` values are its keys and values.
    Map(usize),
    /// Extension type (skipped by the decoder).
    Ext(i8, &'a [u8]),
}

/// Cursor over a MessagePack buffer.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// Nesting limit for `skip`, so hostile input cannot recurse deeply.
const MAX_DEPTH: u32 = 64;

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }

    fn u8(&mut self) -> Option<u8> {
        let b = *self.buf.get(self.pos)?;
        self.pos += 1;
        Some(b)
    }

    fn be<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    fn len16(&mut self) -> Option<usize> {
        Some(u16::from_be_bytes(self.be()?) as usize)
    }

    fn len32(&mut self) -> Option<usize> {
        usize::try_from(u32::from_be_bytes(self.be()?)).ok()
    }

    /// The length of a format that comes in 8-, 16- and 32-bit variants on consecutive
    /// markers: `variant` 0, 1 or 2.
    fn len_of(&mut self, variant: u8) -> Option<usize> {
        match variant {
            0 => Some(usize::from(self.u8()?)),
            1 => self.len16(),
            _ => self.len32(),
        }
    }

    /// A container header must not announce more items than bytes left (each item takes at
    /// least one byte), so a hostile length cannot make callers allocate huge buffers.
    fn container(&self, n: usize, per_item: usize) -> Option<usize> {
        (n.saturating_mul(per_item) <= self.remaining()).then_some(n)
    }

    /// Reads the next value (for containers, only the header).
    pub fn read(&mut self) -> Option<Value<'a>> {
        let b = self.u8()?;
        Some(match b {
            0x00..=0x7f => Value::Int(i128::from(b)),
            0x80..=0x8f => Value::Map(self.container(usize::from(b & 0x0f), 2)?),
            0x90..=0x9f => Value::Array(self.container(usize::from(b & 0x0f), 1)?),
            0xa0..=0xbf => Value::Str(self.take(usize::from(b & 0x1f))?),
            0xc0 => Value::Nil,
            0xc2 => Value::Bool(false),
            0xc3 => Value::Bool(true),
            0xc4..=0xc6 => {
                let n = self.len_of(b - 0xc4)?;
                Value::Bin(self.take(n)?)
            }
            0xc7..=0xc9 => {
                let n = self.len_of(b - 0xc7)?;
                let t = i8::from_be_bytes(self.be()?);
                Value::Ext(t, self.take(n)?)
            }
            0xca => Value::Float(f64::from(f32::from_be_bytes(self.be()?))),
            0xcb => Value::Float(f64::from_be_bytes(self.be()?)),
            0xcc => Value::Int(i128::from(self.u8()?)),
            0xcd => Value::Int(i128::from(u16::from_be_bytes(self.be()?))),
            0xce => Value::Int(i128::from(u32::from_be_bytes(self.be()?))),
            0xcf => Value::Int(i128::from(u64::from_be_bytes(self.be()?))),
            0xd0 => Value::Int(i128::from(i8::from_be_bytes(self.be()?))),
            0xd1 => Value::Int(i128::from(i16::from_be_bytes(self.be()?))),
            0xd2 => Value::Int(i128::from(i32::from_be_bytes(self.be()?))),
            0xd3 => Value::Int(i128::from(i64::from_be_bytes(self.be()?))),
            0xd4..=0xd8 => {
                let t = i8::from_be_bytes(self.be()?);
                let n = 1usize << (b - 0xd4);
                Value::Ext(t, self.take(n)?)
            }
            0xd9..=0xdb => {
                let n = self.len_of(b - 0xd9)?;
                Value::Str(self.take(n)?)
            }
            // Arrays and maps have no 8-bit variant: 0xdc and 0xde are the 16-bit ones.
            0xdc | 0xdd => {
                let n = self.len_of(b - 0xdb)?;
                Value::Array(self.container(n, 1)?)
            }
            0xde | 0xdf => {
                let n = self.len_of(b - 0xdd)?;
                Value::Map(self.container(n, 2)?)
            }
            0xe0..=0xff => Value::Int(i128::from(b as i8)),
            0xc1 => return None,
        })
    }

    /// Skips one whole value (with everything nested in it).
    pub fn skip(&mut self) -> Option<()> {
        self.skip_depth(0)
    }

    fn skip_depth(&mut self, depth: u32) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        match self.read()? {
            Value::Array(n) => {
                for _ in 0..n {
                    self.skip_depth(depth + 1)?;
                }
            }
            Value::Map(n) => {
                for _ in 0..n.saturating_mul(2) {
                    self.skip_depth(depth + 1)?;
                }
            }
            _ => {}
        }
        Some(())
    }

    /// Skips `n` values.
    pub fn skip_n(&mut self, n: usize) -> Option<()> {
        for _ in 0..n {
            self.skip()?;
        }
        Some(())
    }
}

/// Minimal MessagePack writer (always the compact encodings msgpack encoders choose).
#[derive(Debug, Default, Clone)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn new() -> Self {
        Writer::default()
    }

    pub fn nil(&mut self) -> &mut Self {
        self.buf.push(0xc0);
        self
    }

    pub fn bool(&mut self, v: bool) -> &mut Self {
        self.buf.push(if v { 0xc3 } else { 0xc2 });
        self
    }

    pub fn uint(&mut self, v: u64) -> &mut Self {
        if v < 0x80 {
            self.buf.push(v as u8);
        } else if v <= 0xff {
            self.buf.extend_from_slice(&[0xcc, v as u8]);
        } else if v <= 0xffff {
            self.buf.push(0xcd);
            self.buf.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= 0xffff_ffff {
            self.buf.push(0xce);
            self.buf.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            self.buf.push(0xcf);
            self.buf.extend_from_slice(&v.to_be_bytes());
        }
        self
    }

    pub fn int(&mut self, v: i64) -> &mut Self {
        if v >= 0 {
            return self.uint(v as u64);
        }
        if v >= -32 {
            self.buf.push(v as i8 as u8);
        } else {
            self.buf.push(0xd3);
            self.buf.extend_from_slice(&v.to_be_bytes());
        }
        self
    }

    pub fn float(&mut self, v: f64) -> &mut Self {
        self.buf.push(0xcb);
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub fn str(&mut self, s: &str) -> &mut Self {
        let n = s.len();
        if n < 32 {
            self.buf.push(0xa0 | n as u8);
        } else {
            self.len_of(n, 0xd9);
        }
        self.buf.extend_from_slice(s.as_bytes());
        self
    }

    pub fn bin(&mut self, b: &[u8]) -> &mut Self {
        self.len_of(b.len(), 0xc4);
        self.buf.extend_from_slice(b);
        self
    }

    pub fn array(&mut self, n: usize) -> &mut Self {
        self.header(n, 0x90, 0xdc, 0xdd)
    }

    pub fn map(&mut self, n: usize) -> &mut Self {
        self.header(n, 0x80, 0xde, 0xdf)
    }

    /// `n` in the smallest of a format's 8-, 16- and 32-bit variants, whose markers are
    /// `marker8` and the two after it.
    fn len_of(&mut self, n: usize, marker8: u8) {
        if n <= 0xff {
            self.buf.extend_from_slice(&[marker8, n as u8]);
        } else if n <= 0xffff {
            self.buf.push(marker8 + 1);
            self.buf.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.buf.push(marker8 + 2);
            self.buf.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }

    fn header(&mut self, n: usize, fix: u8, b16: u8, b32: u8) -> &mut Self {
        if n < 16 {
            self.buf.push(fix | n as u8);
        } else if n <= 0xffff {
            self.buf.push(b16);
            self.buf.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.buf.push(b32);
            self.buf.extend_from_slice(&(n as u32).to_be_bytes());
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each length is written in its smallest variant and read back whole.
    #[test]
    fn lengths_round_trip_across_variant_boundaries() {
        // (n, str marker, bin marker, array marker; the map marker is the array's + 2)
        for (n, s8, b8, a16) in [
            (31, 0xbf, 0xc4, 0xdc),
            (32, 0xd9, 0xc4, 0xdc),
            (255, 0xd9, 0xc4, 0xdc),
            (256, 0xda, 0xc5, 0xdc),
            (65535, 0xda, 0xc5, 0xdc),
            (65536, 0xdb, 0xc6, 0xdd),
        ] {
            let (s, b) = ("s".repeat(n), vec![1u8; n]);
            let mut w = Writer::new();
            w.str(&s);
            let at_bin = w.buf.len();
            w.bin(&b);
            let at_array = w.buf.len();
            w.array(n);
            for _ in 0..n {
                w.nil();
            }
            let at_map = w.buf.len();
            w.map(n);
            for _ in 0..2 * n {
                w.nil();
            }
            let markers = [w.buf[0], w.buf[at_bin], w.buf[at_array], w.buf[at_map]];
            assert_eq!(markers, [s8, b8, a16, a16 + 2], "n = {n}");
            let mut r = Reader::new(&w.buf);
            assert_eq!(r.read(), Some(Value::Str(s.as_bytes())), "n = {n}");
            assert_eq!(r.read(), Some(Value::Bin(&b)), "n = {n}");
            assert_eq!(r.read(), Some(Value::Array(n)), "n = {n}");
            assert_eq!(r.skip_n(n), Some(()));
            assert_eq!(r.read(), Some(Value::Map(n)), "n = {n}");
            assert_eq!(r.skip_n(2 * n), Some(()));
            assert_eq!(r.remaining(), 0);
        }
    }

    #[test]
    fn ext_lengths_of_each_width() {
        for buf in [
            &[0xc7, 2, 5, 7, 8][..],
            &[0xc8, 0, 2, 5, 7, 8],
            &[0xc9, 0, 0, 0, 2, 5, 7, 8],
        ] {
            let mut r = Reader::new(buf);
            assert_eq!(r.read(), Some(Value::Ext(5, &[7, 8])), "{buf:02x?}");
            assert_eq!(r.remaining(), 0);
        }
        // A length past the end is garbage, not a panic.
        assert_eq!(Reader::new(&[0xc8, 0xff, 0xff, 5]).read(), None);
    }
}
