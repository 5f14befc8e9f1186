//! Decoder for vLLM's KV cache event batches (`vllm/distributed/kv_events.py`).
//!
//! Wire facts (checked against vLLM's source):
//! - A batch is a msgspec struct `KVEventBatch { ts: float, events: [...],
//!   data_parallel_rank: int | None = None }`; older vLLM encodes it `array_like`
//!   (`[ts, events, dp_rank?]`), newer vLLM as a map (`{"ts":..,"events":..}`), and
//!   `omit_defaults` drops `data_parallel_rank` when it is unset.
//! - Events are tagged unions: array form `["BlockStored", block_hashes, parent_block_hash,
//!   token_ids, block_size, lora_id, medium, lora_name, extra_keys?, ...]`,
//!   `["BlockRemoved", block_hashes, medium, group_idx?]`, `["AllBlocksCleared"]`; map form
//!   `{"type": "BlockStored", "block_hashes": .., ...}` (msgspec's default tag field `type`).
//! - Block hashes are `bytes | int` depending on the version (`ExternalBlockHash`).
//!
//! The decoder is tolerant: either form, fields missing at the end, extra fields, unknown
//! event tags (skipped and counted). Bytes hashes become u64 keys through xxh3.

use crate::msgpack::{Reader, Value};
use xxhash_rust::xxh3::xxh3_64;

/// One `BlockStored` event. Hashes are engine hashes folded to u64 (see `engine_key`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Stored<'a> {
    pub block_hashes: Vec<u64>,
    pub parent: Option<u64>,
    pub token_ids: Vec<u32>,
    /// Tokens per block; `None` when the event omitted it.
    pub block_size: Option<u32>,
    pub lora_name: Option<&'a str>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event<'a> {
    Stored(Stored<'a>),
    Removed(Vec<u64>),
    Cleared,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Batch<'a> {
    pub ts: f64,
    pub events: Vec<Event<'a>>,
    pub data_parallel_rank: Option<i64>,
    /// Events with a tag this decoder does not know (skipped).
    pub unknown_events: u32,
}

/// Why a batch could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeError(pub &'static str);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

type R<T> = Result<T, DecodeError>;

fn need<T>(v: Option<T>, what: &'static str) -> R<T> {
    v.ok_or(DecodeError(what))
}

/// An engine block hash as a u64 key: ints as their 64-bit two's complement, bytes through
/// xxh3-64.
pub fn engine_key_int(v: i128) -> u64 {
    v as u64
}

pub fn engine_key_bytes(b: &[u8]) -> u64 {
    xxh3_64(b)
}

/// Decodes one batch payload.
pub fn decode_batch(payload: &[u8]) -> R<Batch<'_>> {
    let mut r = Reader::new(payload);
    let mut batch = Batch::default();
    match need(r.read(), "truncated batch")? {
        Value::Array(n) => {
            for i in 0..n {
                match i {
                    0 => batch.ts = read_f64(&mut r)?,
                    1 => read_events(&mut r, &mut batch)?,
                    2 => batch.data_parallel_rank = read_opt_i64(&mut r)?,
                    _ => need(r.skip(), "truncated batch field")?,
                }
            }
            if n < 2 {
                return Err(DecodeError("batch without events"));
            }
        }
        Value::Map(n) => {
            let mut saw_events = false;
            for _ in 0..n {
                match read_key(&mut r)? {
                    b"ts" => batch.ts = read_f64(&mut r)?,
                    b"events" => {
                        read_events(&mut r, &mut batch)?;
                        saw_events = true;
                    }
                    b"data_parallel_rank" => batch.data_parallel_rank = read_opt_i64(&mut r)?,
                    _ => need(r.skip(), "truncated batch field")?,
                }
            }
            if !saw_events {
                return Err(DecodeError("batch without events"));
            }
        }
        _ => return Err(DecodeError("batch is neither array nor map")),
    }
    Ok(batch)
}

fn read_key<'a>(r: &mut Reader<'a>) -> R<&'a [u8]> {
    match need(r.read(), "truncated key")? {
        Value::Str(s) => Ok(s),
        _ => Err(DecodeError("map key is not a string")),
    }
}

fn read_f64(r: &mut Reader<'_>) -> R<f64> {
    match need(r.read(), "truncated number")? {
        Value::Float(f) => Ok(f),
        Value::Int(i) => Ok(i as f64),
        _ => Err(DecodeError("expected a number")),
    }
}

fn read_opt_i64(r: &mut Reader<'_>) -> R<Option<i64>> {
    match need(r.read(), "truncated int")? {
        Value::Nil => Ok(None),
        Value::Int(i) => Ok(i64::try_from(i).ok()),
        _ => Err(DecodeError("expected an int")),
    }
}

fn read_opt_u32(r: &mut Reader<'_>) -> R<Option<u32>> {
    match need(r.read(), "truncated int")? {
        Value::Nil => Ok(None),
        Value::Int(i) => u32::try_from(i)
            .map(Some)
            .map_err(|_| DecodeError("int out of range")),
        _ => Err(DecodeError("expected an int")),
    }
}

fn read_opt_str<'a>(r: &mut Reader<'a>) -> R<Option<&'a str>> {
    match need(r.read(), "truncated string")? {
        Value::Nil => Ok(None),
        Value::Str(s) => std::str::from_utf8(s)
            .map(Some)
            .map_err(|_| DecodeError("string is not utf-8")),
        _ => Err(DecodeError("expected a string")),
    }
}

fn hash_of(v: Value<'_>) -> R<Option<u64>> {
    match v {
        Value::Nil => Ok(None),
        Value::Int(i) => Ok(Some(engine_key_int(i))),
        Value::Bin(b) | Value::Str(b) => Ok(Some(engine_key_bytes(b))),
        _ => Err(DecodeError("block hash is neither int nor bytes")),
    }
}

fn read_opt_hash(r: &mut Reader<'_>) -> R<Option<u64>> {
    hash_of(need(r.read(), "truncated hash")?)
}

/// A list (nil reads as empty) of items read by `item`; the messages name what is missing.
fn read_list<'a, T>(
    r: &mut Reader<'a>,
    truncated: &'static str,
    not_list: &'static str,
    mut item: impl FnMut(&mut Reader<'a>) -> R<T>,
) -> R<Vec<T>> {
    let n = match need(r.read(), truncated)? {
        Value::Array(n) => n,
        Value::Nil => return Ok(Vec::new()),
        _ => return Err(DecodeError(not_list)),
    };
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(item(r)?);
    }
    Ok(out)
}

fn read_hashes(r: &mut Reader<'_>) -> R<Vec<u64>> {
    read_list(
        r,
        "truncated hash list",
        "block_hashes is not a list",
        |r| {
            need(
                hash_of(need(r.read(), "truncated hash")?)?,
                "null block hash",
            )
        },
    )
}

fn read_tokens(r: &mut Reader<'_>) -> R<Vec<u32>> {
    read_list(
        r,
        "truncated token list",
        "token_ids is not a list",
        |r| match need(r.read(), "truncated token id")? {
            Value::Int(i) => u32::try_from(i).map_err(|_| DecodeError("bad token id")),
            _ => Err(DecodeError("token id is not an int")),
        },
    )
}

/// Fields of any event, filled by name (map form) or position (array form).
#[derive(Default)]
struct Fields<'a> {
    stored: Stored<'a>,
}

const STORED_FIELDS: &[&[u8]] = &[
    b"block_hashes",
    b"parent_block_hash",
    b"token_ids",
    b"block_size",
    b"lora_id",
    b"medium",
    b"lora_name",
];
const REMOVED_FIELDS: &[&[u8]] = &[b"block_hashes", b"medium"];

impl<'a> Fields<'a> {
    fn set(&mut self, name: &[u8], r: &mut Reader<'a>) -> R<()> {
        let s = &mut self.stored;
        match name {
            b"block_hashes" => s.block_hashes = read_hashes(r)?,
            b"parent_block_hash" => s.parent = read_opt_hash(r)?,
            b"token_ids" => s.token_ids = read_tokens(r)?,
            b"block_size" => s.block_size = read_opt_u32(r)?,
            b"lora_name" => s.lora_name = read_opt_str(r)?,
            _ => need(r.skip(), "truncated event field")?,
        }
        Ok(())
    }
}

enum Tag {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

fn tag_of(s: &[u8]) -> Tag {
    match s {
        b"BlockStored" => Tag::Stored,
        b"BlockRemoved" => Tag::Removed,
        b"AllBlocksCleared" => Tag::Cleared,
        _ => Tag::Unknown,
    }
}

fn read_events<'a>(r: &mut Reader<'a>, batch: &mut Batch<'a>) -> R<()> {
    let n = match need(r.read(), "truncated event list")? {
        Value::Array(n) => n,
        _ => return Err(DecodeError("events is not a list")),
    };
    batch.events.reserve(n);
    for _ in 0..n {
        match read_event(r)? {
            Some(e) => batch.events.push(e),
            None => batch.unknown_events = batch.unknown_events.saturating_add(1),
        }
    }
    Ok(())
}

fn read_event<'a>(r: &mut Reader<'a>) -> R<Option<Event<'a>>> {
    let mut f = Fields::default();
    let tag = match need(r.read(), "truncated event")? {
        Value::Array(n) => {
            if n == 0 {
                return Err(DecodeError("empty event"));
            }
            let tag = match need(r.read(), "truncated event tag")? {
                Value::Str(s) => tag_of(s),
                _ => return Err(DecodeError("event tag is not a string")),
            };
            let names = match tag {
                Tag::Stored => STORED_FIELDS,
                Tag::Removed => REMOVED_FIELDS,
                _ => &[],
            };
            for i in 0..n - 1 {
                match names.get(i) {
                    Some(name) => f.set(name, r)?,
                    None => need(r.skip(), "truncated event field")?,
                }
            }
            tag
        }
        Value::Map(n) => {
            let mut tag = None;
            for _ in 0..n {
                let key = read_key(r)?;
                if key == b"type" {
                    match need(r.read(), "truncated event tag")? {
                        Value::Str(s) => tag = Some(tag_of(s)),
                        _ => return Err(DecodeError("event tag is not a string")),
                    }
                } else {
                    f.set(key, r)?;
                }
            }
            need(tag, "event without a type")?
        }
        _ => return Err(DecodeError("event is neither array nor map")),
    };
    Ok(match tag {
        Tag::Stored => Some(Event::Stored(f.stored)),
        Tag::Removed => Some(Event::Removed(f.stored.block_hashes)),
        Tag::Cleared => Some(Event::Cleared),
        Tag::Unknown => None,
    })
}
