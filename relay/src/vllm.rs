//! Builders of vLLM-format payloads (array or map form), for tests, the benchmark and fake
//! engines. Encodings follow msgspec's: array_like structs as arrays with the tag first, plain
//! tagged structs as maps with the tag under `type`.

use crate::msgpack::Writer;

/// An engine block hash as vLLM may send it.
#[derive(Debug, Clone, PartialEq)]
pub enum Hash {
    Int(i64),
    Bytes(Vec<u8>),
}

#[derive(Debug, Clone, PartialEq)]
pub enum Ev {
    Stored {
        hashes: Vec<Hash>,
        parent: Option<Hash>,
        tokens: Vec<u32>,
        block_size: u32,
        lora_name: Option<String>,
    },
    Removed(Vec<Hash>),
    Cleared,
}

fn hash(w: &mut Writer, h: &Hash) {
    match h {
        Hash::Int(i) => w.int(*i),
        Hash::Bytes(b) => w.bin(b),
    };
}

fn hashes(w: &mut Writer, hs: &[Hash]) {
    w.array(hs.len());
    for h in hs {
        hash(w, h);
    }
}

fn event(w: &mut Writer, e: &Ev, map: bool) {
    match e {
        Ev::Stored {
            hashes: hs,
            parent,
            tokens,
            block_size,
            lora_name,
        } => {
            if map {
                w.map(8).str("type").str("BlockStored").str("block_hashes");
            } else {
                w.array(8).str("BlockStored");
            }
            hashes(w, hs);
            if map {
                w.str("parent_block_hash");
            }
            match parent {
                Some(p) => hash(w, p),
                None => {
                    w.nil();
                }
            }
            if map {
                w.str("token_ids");
            }
            w.array(tokens.len());
            for t in tokens {
                w.uint(u64::from(*t));
            }
            if map {
                w.str("block_size");
            }
            w.uint(u64::from(*block_size));
            if map {
                w.str("lora_id");
            }
            w.nil();
            if map {
                w.str("medium");
            }
            w.str("GPU");
            if map {
                w.str("lora_name");
            }
            match lora_name {
                Some(n) => w.str(n),
                None => w.nil(),
            };
        }
        Ev::Removed(hs) => {
            if map {
                w.map(3).str("type").str("BlockRemoved").str("block_hashes");
                hashes(w, hs);
                w.str("medium").str("GPU");
            } else {
                w.array(3).str("BlockRemoved");
                hashes(w, hs);
                w.str("GPU");
            }
        }
        Ev::Cleared => {
            if map {
                w.map(1).str("type").str("AllBlocksCleared");
            } else {
                w.array(1).str("AllBlocksCleared");
            }
        }
    }
}

/// A KVEventBatch payload: `[ts, events]` (array form) or `{"ts":..,"events":..}` (map form).
pub fn batch(events: &[Ev], map: bool) -> Vec<u8> {
    let mut w = Writer::new();
    if map {
        w.map(2).str("ts").float(1.5).str("events");
    } else {
        w.array(2).float(1.5);
    }
    w.array(events.len());
    for e in events {
        event(&mut w, e, map);
    }
    w.buf
}

/// `n` chained blocks of `block_size` tokens (ids from `first_token`), engine hashes from
/// `first_hash` on, as one BlockStored event.
pub fn chain(
    parent: Option<i64>,
    first_hash: i64,
    n: usize,
    block_size: u32,
    first_token: u32,
) -> Ev {
    Ev::Stored {
        hashes: (0..n as i64).map(|i| Hash::Int(first_hash + i)).collect(),
        parent: parent.map(Hash::Int),
        tokens: (0..n as u32 * block_size)
            .map(|i| first_token + i)
            .collect(),
        block_size,
        lora_name: None,
    }
}
