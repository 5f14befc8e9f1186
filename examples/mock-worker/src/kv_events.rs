//! vLLM's KV cache events (`--kv-events-config '{"enable_kv_cache_events": true, ...}'` with
//! the "zmq" publisher), published by the mock from its real cache model.
//!
//! Wire format, as read in vLLM's `vllm/distributed/kv_events.py` (`ZmqEventPublisher`):
//! - PUB socket, one multipart message per batch: `[topic, seq, payload]`; `topic` is the
//!   configured string (vLLM default `""`), `seq` an 8-byte big-endian counter starting at 0,
//!   `payload` the msgspec msgpack encoding of a `KVEventBatch`.
//! - Optional ROUTER replay socket: a request arrives as `[identity, "", start_seq]` (from a
//!   REQ, or a DEALER that sends the empty delimiter itself); every buffered batch with
//!   `seq >= start_seq` goes back as `[identity, "", seq, payload]`, then an end marker
//!   `[identity, "", -1 as 8-byte signed big-endian, ""]`. The buffer keeps the last
//!   `buffer_steps` batches (vLLM default 10000). Other frame counts are ignored.
//! - One batch per scheduler step holding all that step's events; `ts` is `time.time()`.
//!
//! Payload encodings across vLLM versions (all msgspec `omit_defaults=True`, `tag=True`: the
//! tag is the class name). msgspec omits defaulted fields only from maps: an `array_like`
//! struct writes every field, a defaulted one as nil (checked with msgspec 0.22).
//! - v0.9 (first version): everything `array_like`. `KVEventBatch = [ts, events]`;
//!   `BlockStored = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
//!   lora_id]`; `BlockRemoved = ["BlockRemoved", block_hashes]`; `AllBlocksCleared =
//!   ["AllBlocksCleared"]`.
//! - Later: `medium` (e.g. "GPU") appended to BlockStored and BlockRemoved; the batch got a
//!   third field `data_parallel_rank` (default None, but the publisher fills in its DP rank,
//!   so a real server sends `[ts, events, 0]`); then `lora_name` after `medium` in
//!   BlockStored: `[tag, hashes, parent, token_ids, block_size, lora_id, medium, lora_name]`,
//!   what the mock writes by default.
//! - 2026 (still positional): `extra_keys` (PR #33304), `group_idx`, `kv_cache_spec_kind`,
//!   `kv_cache_spec_sliding_window` appended to BlockStored and `group_idx` to BlockRemoved,
//!   all defaulted, so written as trailing nils when unset.
//! - vLLM PR #42892 (June 2026, e.g. v0.26) dropped `array_like` from the events: each event
//!   is a map with the tag under `"type"` and named fields (defaulted ones omitted when unset),
//!   inside the still positional batch; the mock's `--kv-events-format map`. The newest
//!   source read also drops `array_like` from the batch (a map `{ts, events,
//!   data_parallel_rank}`); the mock does not write that form.
//!
//! Block hashes are msgpack uints (vLLM's `ExternalBlockHash` is `int | bytes`; sha256
//! hashing sends bytes). Decoders should accept every form above; tests/fixtures holds
//! msgspec's bytes for each.
//!
//! Sources read: vllm-project/vllm `vllm/distributed/kv_events.py` at b4e69e0a (v0.9 era) and
//! 0181ea31 (2026 main), `vllm/config/kv_events.py` at 00634b8a,
//! `examples/online_serving/kv_events_subscriber.py` at 0ef0f426.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// One KV cache event, as the mock's cache produces it.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        /// The tokens of all the stored blocks, concatenated.
        token_ids: Vec<u32>,
        block_size: usize,
    },
    BlockRemoved {
        block_hashes: Vec<u64>,
    },
    AllBlocksCleared,
}

/// The events of one scheduler step.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    /// vLLM's publisher sets its data-parallel rank (0 for a single engine).
    pub data_parallel_rank: Option<i64>,
}

impl Batch {
    pub fn now(events: Vec<KvEvent>) -> Batch {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        Batch {
            ts,
            events,
            data_parallel_rank: Some(0),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Format {
    /// Positional events (`array_like`), vLLM before PR #42892.
    Array,
    /// Events as maps with a `"type"` tag, vLLM after PR #42892 (batch still positional).
    Map,
    /// What vLLM 0.32 sends (checked against it, tests/e2e/test_vllm_diff.py): `Map` plus
    /// `extra_keys` (one nil per block), `group_idx` 0 and `kv_cache_spec_kind`
    /// "full_attention" in BlockStored, `group_idx` 0 in BlockRemoved; replay answers carry
    /// the topic frame (`["", topic, seq, payload]`, end `["", "", -1, ""]`); no
    /// AllBlocksCleared at start-up, and a reset's goes out with the engine's next step.
    #[default]
    Vllm032,
}

impl Format {
    pub fn parse(s: &str) -> Option<Format> {
        match s {
            "array" => Some(Format::Array),
            "map" => Some(Format::Map),
            "vllm-0.32" => Some(Format::Vllm032),
            _ => None,
        }
    }

    /// The mock's behaviour before vLLM 0.32 was checked: AllBlocksCleared as the first
    /// batch and at once on a reset, replay answers without the topic frame.
    pub fn legacy(self) -> bool {
        self != Format::Vllm032
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Format::Array => "array",
            Format::Map => "map",
            Format::Vllm032 => "vllm-0.32",
        })
    }
}

const MEDIUM_GPU: &str = "GPU";

// Writes into a Vec<u8> cannot fail.
fn uint(o: &mut Vec<u8>, v: u64) {
    let _ = rmp::encode::write_uint(o, v);
}
fn sint(o: &mut Vec<u8>, v: i64) {
    // msgspec writes non-negative Python ints in the uint family, negative ones as int.
    if v >= 0 {
        uint(o, v as u64);
    } else {
        let _ = rmp::encode::write_sint(o, v);
    }
}
fn str_(o: &mut Vec<u8>, s: &str) {
    let _ = rmp::encode::write_str(o, s);
}
fn arr(o: &mut Vec<u8>, n: usize) {
    let _ = rmp::encode::write_array_len(o, n as u32);
}
fn map(o: &mut Vec<u8>, n: usize) {
    let _ = rmp::encode::write_map_len(o, n as u32);
}
fn nil(o: &mut Vec<u8>) {
    let _ = rmp::encode::write_nil(o);
}
fn opt_uint(o: &mut Vec<u8>, v: Option<u64>) {
    match v {
        Some(v) => uint(o, v),
        None => nil(o),
    }
}
fn uints(o: &mut Vec<u8>, vs: impl ExactSizeIterator<Item = u64>) {
    arr(o, vs.len());
    for v in vs {
        uint(o, v);
    }
}

/// msgspec's msgpack encoding of a `KVEventBatch` (floats always as float64).
pub fn encode(b: &Batch, format: Format) -> Vec<u8> {
    let mut o = Vec::with_capacity(64);
    arr(&mut o, 2 + usize::from(b.data_parallel_rank.is_some()));
    let _ = rmp::encode::write_f64(&mut o, b.ts);
    arr(&mut o, b.events.len());
    for e in &b.events {
        match format {
            Format::Array => encode_array(&mut o, e),
            Format::Map => encode_map(&mut o, e, false),
            Format::Vllm032 => encode_map(&mut o, e, true),
        }
    }
    if let Some(r) = b.data_parallel_rank {
        sint(&mut o, r);
    }
    o
}

fn encode_array(o: &mut Vec<u8>, e: &KvEvent) {
    match e {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
        } => {
            // [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
            //  lora_name]
            arr(o, 8);
            str_(o, "BlockStored");
            uints(o, block_hashes.iter().copied());
            opt_uint(o, *parent_block_hash);
            uints(o, token_ids.iter().map(|&t| u64::from(t)));
            uint(o, *block_size as u64);
            nil(o);
            str_(o, MEDIUM_GPU);
            nil(o);
        }
        KvEvent::BlockRemoved { block_hashes } => {
            arr(o, 3);
            str_(o, "BlockRemoved");
            uints(o, block_hashes.iter().copied());
            str_(o, MEDIUM_GPU);
        }
        KvEvent::AllBlocksCleared => {
            arr(o, 1);
            str_(o, "AllBlocksCleared");
        }
    }
}

/// `v032`: with the defaulted fields vLLM 0.32 sets (see `Format::Vllm032`).
fn encode_map(o: &mut Vec<u8>, e: &KvEvent, v032: bool) {
    match e {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
        } => {
            // msgspec puts the tag first, then the fields in order; fields without a default
            // are always written, defaulted ones only when set.
            map(o, if v032 { 11 } else { 8 });
            str_(o, "type");
            str_(o, "BlockStored");
            str_(o, "block_hashes");
            uints(o, block_hashes.iter().copied());
            str_(o, "parent_block_hash");
            opt_uint(o, *parent_block_hash);
            str_(o, "token_ids");
            uints(o, token_ids.iter().map(|&t| u64::from(t)));
            str_(o, "block_size");
            uint(o, *block_size as u64);
            str_(o, "lora_id");
            nil(o);
            str_(o, "medium");
            str_(o, MEDIUM_GPU);
            str_(o, "lora_name");
            nil(o);
            if v032 {
                str_(o, "extra_keys");
                arr(o, block_hashes.len());
                for _ in block_hashes {
                    nil(o);
                }
                str_(o, "group_idx");
                uint(o, 0);
                str_(o, "kv_cache_spec_kind");
                str_(o, "full_attention");
            }
        }
        KvEvent::BlockRemoved { block_hashes } => {
            map(o, if v032 { 4 } else { 3 });
            str_(o, "type");
            str_(o, "BlockRemoved");
            str_(o, "block_hashes");
            uints(o, block_hashes.iter().copied());
            str_(o, "medium");
            str_(o, MEDIUM_GPU);
            if v032 {
                str_(o, "group_idx");
                uint(o, 0);
            }
        }
        KvEvent::AllBlocksCleared => {
            map(o, 1);
            str_(o, "type");
            str_(o, "AllBlocksCleared");
        }
    }
}

/// vLLM's replay end marker: sequence -1.
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// Where the publisher listens, as bound (port 0 resolved).
#[derive(Debug, Clone)]
pub struct Endpoints {
    pub publish: String,
    pub replay: Option<String>,
}

/// The publisher's settings (from `Config`).
#[derive(Debug, Clone)]
pub struct Settings {
    pub endpoint: String,
    pub replay: Option<String>,
    pub topic: String,
    pub buffer: usize,
    pub format: Format,
}

/// Batches the engine hands over without waiting; beyond this the engine drops them (and
/// counts them) rather than block.
pub const QUEUE: usize = 4096;

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// vLLM accepts `tcp://*:PORT` for a wildcard bind.
fn bind_addr(endpoint: &str) -> String {
    endpoint.replacen("tcp://*:", "tcp://0.0.0.0:", 1)
}

/// Binds the sockets and spawns the publisher (and replay) tasks on the current runtime.
pub async fn start(
    s: Settings,
    rx: mpsc::Receiver<Batch>,
) -> Result<Endpoints, Box<dyn std::error::Error + Send + Sync>> {
    let mut publisher = zeromq::PubSocket::new();
    let publish = publisher
        .bind(&bind_addr(&s.endpoint))
        .await
        .map_err(|e| format!("--kv-events {}: {e}", s.endpoint))?
        .to_string();
    let buffer: Buffer = Arc::new(Mutex::new(VecDeque::with_capacity(s.buffer.min(1024))));
    let replay = match &s.replay {
        Some(ep) => {
            let mut router = zeromq::RouterSocket::new();
            let bound = router
                .bind(&bind_addr(ep))
                .await
                .map_err(|e| format!("--kv-events-replay {ep}: {e}"))?
                .to_string();
            // vLLM 0.32 puts the topic frame in replay answers; the older mock did not.
            let topic = (!s.format.legacy()).then(|| Bytes::from(s.topic.clone().into_bytes()));
            tokio::spawn(serve_replay(router, buffer.clone(), topic));
            Some(bound)
        }
        None => None,
    };
    tokio::spawn(publish_loop(publisher, rx, s, buffer));
    Ok(Endpoints { publish, replay })
}

async fn publish_loop(
    mut publisher: zeromq::PubSocket,
    mut rx: mpsc::Receiver<Batch>,
    s: Settings,
    buffer: Buffer,
) {
    let topic = Bytes::from(s.topic.clone().into_bytes());
    let mut seq: u64 = 0;
    while let Some(batch) = rx.recv().await {
        let payload = Bytes::from(encode(&batch, s.format));
        let msg = ZmqMessage::try_from(vec![
            topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload.clone(),
        ])
        .expect("three frames");
        // PUB drops for subscribers whose queue is full, as ZeroMQ specifies; it never waits.
        if let Err(e) = publisher.send(msg).await {
            eprintln!("mock-worker: kv events: publish failed: {e}");
        }
        if s.buffer > 0 {
            let mut b = buffer.lock().unwrap();
            if b.len() == s.buffer {
                b.pop_front();
            }
            b.push_back((seq, payload));
        }
        seq += 1;
    }
}

async fn serve_replay(mut router: zeromq::RouterSocket, buffer: Buffer, topic: Option<Bytes>) {
    loop {
        let Ok(req) = router.recv().await else {
            continue;
        };
        let frames = req.into_vec();
        // [identity, "", start_seq]: anything else is ignored, as vLLM does.
        let [id, delim, start] = frames.as_slice() else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
            continue;
        };
        let start = u64::from_be_bytes(start);
        let items: Vec<(u64, Bytes)> = buffer
            .lock()
            .unwrap()
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        let reply = |topic: Option<Bytes>, seq: Bytes, payload: Bytes| {
            let mut frames = vec![id.clone(), delim.clone()];
            frames.extend(topic);
            frames.extend([seq, payload]);
            ZmqMessage::try_from(frames).expect("frames")
        };
        let mut ok = true;
        for (seq, payload) in items {
            if router
                .send(reply(
                    topic.clone(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                ))
                .await
                .is_err()
            {
                ok = false;
                break;
            }
        }
        if ok {
            let _ = router
                .send(reply(
                    topic.as_ref().map(|_| Bytes::new()),
                    Bytes::from_static(&END_SEQ),
                    Bytes::new(),
                ))
                .await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_marker_is_minus_one() {
        assert_eq!(END_SEQ, [0xff; 8]);
        assert_eq!(bind_addr("tcp://*:5557"), "tcp://0.0.0.0:5557");
    }

    #[test]
    fn small_values_use_the_smallest_msgpack_forms() {
        let b = Batch {
            ts: 0.5,
            events: vec![KvEvent::AllBlocksCleared],
            data_parallel_rank: None,
        };
        let mut want = vec![0x92, 0xcb];
        want.extend_from_slice(&0.5f64.to_be_bytes());
        want.extend_from_slice(&[0x91, 0x91, 0xb0]);
        want.extend_from_slice(b"AllBlocksCleared");
        assert_eq!(encode(&b, Format::Array), want);
    }
}
