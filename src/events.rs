//! State changes that every Envoy worker thread's replica must see, and their compact wire
//! form for proxy-wasm shared queues.
//!
//! Each VM applies its own events at once and enqueues them to its peers; a peer applies
//! them in `on_queue_ready`. A message is a version byte, the sender's clock in nanoseconds
//! (so receivers can measure replication delay), then one or more events, so a sender may
//! batch. Since version 2 every event is framed as tag, payload length (u32), payload, so a
//! receiver skips an event it cannot read (unknown tag, bad payload) and keeps the rest of
//! the batch; version 1 messages (unframed) are still read, up to their first bad event.
//! Decoding never panics.

use crate::ids::{RequestId, WorkerId};
use crate::load::{NewRequest, Report};
use crate::lora::LoraReport;

const VERSION: u8 = 2;
/// The message format this build writes; part of the replication group's name.
pub const WIRE_VERSION: u8 = VERSION;
/// Unframed events: read for compatibility, never written.
const VERSION_UNFRAMED: u8 = 1;
const NO_WORKER: u16 = u16::MAX;
const NO_COUNT: u32 = u32::MAX;

/// Wire tags of the events; part of the message format, never renumbered.
const TAG_ROUTED: u8 = 1;
const TAG_PREFILL_DONE: u8 = 2;
const TAG_FREE: u8 = 3;
const TAG_REPORT: u8 = 4;
const TAG_FAILED: u8 = 5;
const TAG_RECOVERED: u8 = 6;
const TAG_FORGET: u8 = 7;
const TAG_CALIBRATE: u8 = 8;
const TAG_CONFIRMED: u8 = 9;
const TAG_ENGINE_STORED: u8 = 10;
const TAG_ENGINE_REMOVED: u8 = 11;
const TAG_ENGINE_CLEARED: u8 = 12;
const TAG_ENGINE_FEED: u8 = 13;
const TAG_PEER_GONE: u8 = 14;
const TAG_HINTED: u8 = 15;
const TAG_TEXT_TOKENS: u8 = 16;
const TAG_LORA: u8 = 17;

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A routing decision: charge load and record the prompt as cached on the workers.
    Routed(NewRequest),
    PrefillDone {
        id: RequestId,
    },
    /// The request's worker answered 2xx: its prompt's blocks are in the worker's cache.
    /// Until then they are speculative, and a request that ends without it leaves nothing.
    Confirmed {
        id: RequestId,
    },
    Free {
        id: RequestId,
    },
    /// A worker's own load report.
    Report {
        worker: WorkerId,
        report: Report,
    },
    Failed {
        worker: WorkerId,
        at_ms: u64,
    },
    Recovered {
        worker: WorkerId,
    },
    /// The worker does not hold these blocks (its request failed before computing them).
    Forget {
        worker: WorkerId,
        hashes: Vec<u64>,
    },
    /// New chars-per-token estimate for text prompts.
    Calibrate {
        chars_per_token: f64,
    },
    /// Precise mode: the engine itself reports holding these blocks (from kvroute-relay).
    EngineStored {
        worker: WorkerId,
        hashes: Vec<u64>,
    },
    /// Precise mode: the engine evicted these blocks.
    EngineRemoved {
        worker: WorkerId,
        hashes: Vec<u64>,
    },
    /// Precise mode: the engine holds nothing from before (cache reset, restart, a gap in
    /// its events that could not be repaired).
    EngineCleared {
        worker: WorkerId,
    },
    /// The relay's stream does (`on`) or no longer does describe this worker's cache; while
    /// it does, the engine's events are the index's truth and picks stay speculative.
    EngineFeed {
        worker: WorkerId,
        on: bool,
    },
    /// Another gateway is gone: release the requests it charged (ids under `tag`, see
    /// `precise::peers`).
    PeerGone {
        tag: u64,
    },
    /// A request with a client hint (`prompt_cache_key`, session header) went to `worker`:
    /// the hint's virtual block ([`crate::hashing::hint_hash`]) is there now, and nowhere
    /// else.
    Hinted {
        worker: WorkerId,
        hash: u64,
    },
    /// Text blocks and the engine blocks they end in, learned from a tokenize answer (see
    /// `twins`): `text[i]` ends in `tokens[i]`.
    TextTokens {
        text: Vec<u64>,
        tokens: Vec<u64>,
    },
    /// A worker's LoRA adapters as its metrics report them (`crate::lora`).
    Lora {
        worker: WorkerId,
        report: LoraReport,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeError {
    Empty,
    Version(u8),
    Truncated,
    UnknownTag(u8),
    /// A value no sender produces (a non-finite or negative load or calibration figure).
    Invalid,
}

impl core::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            DecodeError::Empty => write!(f, "empty replication message"),
            DecodeError::Version(v) => {
                write!(f, "replication message version {v}, expected {VERSION}")
            }
            DecodeError::Truncated => write!(f, "truncated replication message"),
            DecodeError::UnknownTag(t) => write!(f, "unknown replication event tag {t}"),
            DecodeError::Invalid => write!(f, "invalid value in a replication event"),
        }
    }
}

pub fn encode(sent_ns: u64, events: &[Event]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.push(VERSION);
    put_u64(&mut out, sent_ns);
    for e in events {
        out.push(e.tag());
        let at = out.len();
        put_u32(&mut out, 0);
        encode_one(e, &mut out);
        let len = u32::try_from(out.len() - at - 4).unwrap_or(u32::MAX);
        if let Some(slot) = out.get_mut(at..at + 4) {
            slot.copy_from_slice(&len.to_le_bytes());
        }
    }
    out
}

impl Event {
    fn tag(&self) -> u8 {
        match self {
            Event::Routed(_) => TAG_ROUTED,
            Event::PrefillDone { .. } => TAG_PREFILL_DONE,
            Event::Confirmed { .. } => TAG_CONFIRMED,
            Event::Free { .. } => TAG_FREE,
            Event::Report { .. } => TAG_REPORT,
            Event::Failed { .. } => TAG_FAILED,
            Event::Recovered { .. } => TAG_RECOVERED,
            Event::Forget { .. } => TAG_FORGET,
            Event::Calibrate { .. } => TAG_CALIBRATE,
            Event::EngineStored { .. } => TAG_ENGINE_STORED,
            Event::EngineRemoved { .. } => TAG_ENGINE_REMOVED,
            Event::EngineCleared { .. } => TAG_ENGINE_CLEARED,
            Event::EngineFeed { .. } => TAG_ENGINE_FEED,
            Event::PeerGone { .. } => TAG_PEER_GONE,
            Event::Hinted { .. } => TAG_HINTED,
            Event::TextTokens { .. } => TAG_TEXT_TOKENS,
            Event::Lora { .. } => TAG_LORA,
        }
    }
}

fn encode_one(e: &Event, o: &mut Vec<u8>) {
    match e {
        Event::Routed(r) => {
            put_u64(o, r.id);
            put_u64(o, r.now_ms);
            put_u16(o, r.worker);
            put_u16(o, r.prefill_worker.unwrap_or(NO_WORKER));
            put_u32(o, r.cached_blocks);
            put_u32(o, r.tail_blocks);
            put_u32(o, r.prefill_tokens);
            put_hashes(o, &r.blocks);
            // Last, and only when set: requests for the base model encode as before.
            if r.adapter != 0 {
                put_u64(o, r.adapter);
            }
        }
        Event::PrefillDone { id } | Event::Free { id } | Event::Confirmed { id } => put_u64(o, *id),
        Event::Report { worker, report } => {
            put_u16(o, *worker);
            put_u32(o, report.kv_usage.to_bits());
            put_u32(o, report.waiting);
            put_u32(o, report.running.unwrap_or(NO_COUNT));
            put_u64(o, report.at_ms);
        }
        Event::Failed { worker, at_ms } => {
            put_u16(o, *worker);
            put_u64(o, *at_ms);
        }
        Event::Recovered { worker } => put_u16(o, *worker),
        Event::Forget { worker, hashes }
        | Event::EngineStored { worker, hashes }
        | Event::EngineRemoved { worker, hashes } => {
            put_u16(o, *worker);
            put_hashes(o, hashes);
        }
        Event::Calibrate { chars_per_token } => put_u64(o, chars_per_token.to_bits()),
        Event::Lora { worker, report } => {
            put_u16(o, *worker);
            put_u32(o, report.max_lora.unwrap_or(NO_COUNT));
            put_hashes(o, &report.running);
            put_hashes(o, &report.waiting);
        }
        Event::EngineCleared { worker } => put_u16(o, *worker),
        Event::EngineFeed { worker, on } => {
            put_u16(o, *worker);
            o.push(u8::from(*on));
        }
        Event::PeerGone { tag } => put_u64(o, *tag),
        Event::Hinted { worker, hash } => {
            put_u16(o, *worker);
            put_u64(o, *hash);
        }
        Event::TextTokens { text, tokens } => {
            put_hashes(o, text);
            put_hashes(o, tokens);
        }
    }
}

/// What a gateway tells other gateways (see `precise::peers`): its own decisions and their
/// end. Health, load reports, forgetting and calibration are each gateway's own observation;
/// engine state comes from each gateway's own relay.
fn shared_with_peers(tag: u8) -> bool {
    matches!(
        tag,
        TAG_ROUTED | TAG_PREFILL_DONE | TAG_CONFIRMED | TAG_FREE
    )
}

/// Whether `e` is of a kind a gateway shares with other gateways.
pub fn is_peer_event(e: &Event) -> bool {
    shared_with_peers(e.tag())
}

/// A replication message of this process cut down to what other gateways are told: only
/// the frames [`is_peer_event`] keeps, copied without decoding, and split so that no message
/// carries more than `max_routed` decisions (receivers refuse a message with more). Empty
/// when nothing is left; an unframed or unreadable message yields nothing.
pub fn peer_messages(msg: &[u8], max_routed: usize) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let (Some(&VERSION), Some(head)) = (msg.first(), msg.get(..9)) else {
        return out;
    };
    let mut r = Reader(msg.get(9..).unwrap_or_default());
    let mut cur: Vec<u8> = Vec::new();
    let mut routed = 0;
    while let Some(tag) = r.u8() {
        let Some(len) = r.u32() else { break };
        let Some(body) = r.take(len as usize) else {
            break;
        };
        if !shared_with_peers(tag) {
            continue;
        }
        if tag == TAG_ROUTED {
            if routed == max_routed.max(1) {
                out.push(core::mem::take(&mut cur));
                routed = 0;
            }
            routed += 1;
        }
        if cur.is_empty() {
            cur.extend_from_slice(head);
        }
        cur.push(tag);
        put_u32(&mut cur, len);
        cur.extend_from_slice(body);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// One message as received: what could be read and how many events could not.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    pub sent_ns: u64,
    pub events: Vec<Event>,
    /// Events skipped as unreadable (an unframed message counts its unread rest as one).
    pub skipped: u32,
    /// Why the first skipped event was skipped.
    pub first_error: Option<DecodeError>,
}

/// Reads a message event by event; an error only when its header is unusable.
pub fn decode_counted(msg: &[u8]) -> Result<Decoded, DecodeError> {
    let (&v, rest) = msg.split_first().ok_or(DecodeError::Empty)?;
    if v != VERSION && v != VERSION_UNFRAMED {
        return Err(DecodeError::Version(v));
    }
    let mut r = Reader(rest);
    let sent_ns = r.u64().ok_or(DecodeError::Truncated)?;
    let mut d = Decoded {
        sent_ns,
        events: Vec::new(),
        skipped: 0,
        first_error: None,
    };
    let skip = |d: &mut Decoded, e: DecodeError| {
        d.skipped += 1;
        d.first_error.get_or_insert(e);
    };
    while let Some(tag) = r.u8() {
        if v == VERSION_UNFRAMED {
            match decode_one(tag, &mut r, false) {
                Ok(e) => d.events.push(e),
                Err(e) => {
                    skip(&mut d, e);
                    break;
                }
            }
            continue;
        }
        let Some(body) = r.u32().and_then(|n| r.take(n as usize)) else {
            skip(&mut d, DecodeError::Truncated);
            break;
        };
        let mut one = Reader(body);
        match decode_one(tag, &mut one, true) {
            Ok(e) if one.0.is_empty() => d.events.push(e),
            Ok(_) => skip(&mut d, DecodeError::Truncated),
            Err(e) => skip(&mut d, e),
        }
    }
    Ok(d)
}

/// The sender's clock and the readable events of one message; an error when the message
/// is unusable or none of its events could be read.
pub fn decode(msg: &[u8]) -> Result<(u64, Vec<Event>), DecodeError> {
    let d = decode_counted(msg)?;
    match d.first_error {
        Some(e) if d.events.is_empty() => Err(e),
        _ => Ok((d.sent_ns, d.events)),
    }
}

/// `framed`: `r` holds exactly this event's payload (version 2), so optional trailing
/// fields can be told from the next event.
fn decode_one(tag: u8, r: &mut Reader<'_>, framed: bool) -> Result<Event, DecodeError> {
    let t = DecodeError::Truncated;
    Ok(match tag {
        TAG_ROUTED => {
            let id = r.u64().ok_or(t)?;
            let now_ms = r.u64().ok_or(t)?;
            let worker = r.u16().ok_or(t)?;
            let pw = r.u16().ok_or(t)?;
            let cached_blocks = r.u32().ok_or(t)?;
            let tail_blocks = r.u32().ok_or(t)?;
            let prefill_tokens = r.u32().ok_or(t)?;
            let blocks = r.hashes().ok_or(t)?;
            Event::Routed(NewRequest {
                id,
                worker,
                prefill_worker: (pw != NO_WORKER).then_some(pw),
                blocks,
                cached_blocks,
                tail_blocks,
                prefill_tokens,
                now_ms,
                adapter: if framed { r.u64().unwrap_or(0) } else { 0 },
            })
        }
        TAG_PREFILL_DONE => Event::PrefillDone {
            id: r.u64().ok_or(t)?,
        },
        TAG_CONFIRMED => Event::Confirmed {
            id: r.u64().ok_or(t)?,
        },
        TAG_FREE => Event::Free {
            id: r.u64().ok_or(t)?,
        },
        TAG_REPORT => {
            let worker = r.u16().ok_or(t)?;
            let kv_usage = f32::from_bits(r.u32().ok_or(t)?);
            // NaN would poison every cost comparison that reads the report.
            if !(kv_usage.is_finite() && kv_usage >= 0.0) {
                return Err(DecodeError::Invalid);
            }
            let waiting = r.u32().ok_or(t)?;
            let running = r.u32().ok_or(t)?;
            let at_ms = r.u64().ok_or(t)?;
            Event::Report {
                worker,
                report: Report {
                    kv_usage,
                    waiting,
                    running: (running != NO_COUNT).then_some(running),
                    at_ms,
                },
            }
        }
        TAG_FAILED => Event::Failed {
            worker: r.u16().ok_or(t)?,
            at_ms: r.u64().ok_or(t)?,
        },
        TAG_RECOVERED => Event::Recovered {
            worker: r.u16().ok_or(t)?,
        },
        TAG_FORGET => Event::Forget {
            worker: r.u16().ok_or(t)?,
            hashes: r.hashes().ok_or(t)?,
        },
        TAG_CALIBRATE => {
            let chars_per_token = f64::from_bits(r.u64().ok_or(t)?);
            if !chars_per_token.is_finite() {
                return Err(DecodeError::Invalid);
            }
            Event::Calibrate { chars_per_token }
        }
        TAG_ENGINE_STORED => Event::EngineStored {
            worker: r.u16().ok_or(t)?,
            hashes: r.hashes().ok_or(t)?,
        },
        TAG_ENGINE_REMOVED => Event::EngineRemoved {
            worker: r.u16().ok_or(t)?,
            hashes: r.hashes().ok_or(t)?,
        },
        TAG_ENGINE_CLEARED => Event::EngineCleared {
            worker: r.u16().ok_or(t)?,
        },
        TAG_ENGINE_FEED => {
            let worker = r.u16().ok_or(t)?;
            let on = match r.u8().ok_or(t)? {
                0 => false,
                1 => true,
                _ => return Err(DecodeError::Invalid),
            };
            Event::EngineFeed { worker, on }
        }
        TAG_PEER_GONE => Event::PeerGone {
            tag: r.u64().ok_or(t)?,
        },
        TAG_HINTED => Event::Hinted {
            worker: r.u16().ok_or(t)?,
            hash: r.u64().ok_or(t)?,
        },
        TAG_TEXT_TOKENS => {
            let text = r.hashes().ok_or(t)?;
            let tokens = r.hashes().ok_or(t)?;
            if text.len() != tokens.len() {
                return Err(DecodeError::Invalid);
            }
            Event::TextTokens { text, tokens }
        }
        TAG_LORA => {
            let worker = r.u16().ok_or(t)?;
            let max = r.u32().ok_or(t)?;
            Event::Lora {
                worker,
                report: LoraReport {
                    max_lora: (max != NO_COUNT).then_some(max),
                    running: r.hashes().ok_or(t)?,
                    waiting: r.hashes().ok_or(t)?,
                },
            }
        }
        other => return Err(DecodeError::UnknownTag(other)),
    })
}

fn put_u16(o: &mut Vec<u8>, v: u16) {
    o.extend_from_slice(&v.to_le_bytes());
}
fn put_u32(o: &mut Vec<u8>, v: u32) {
    o.extend_from_slice(&v.to_le_bytes());
}
fn put_u64(o: &mut Vec<u8>, v: u64) {
    o.extend_from_slice(&v.to_le_bytes());
}
fn put_hashes(o: &mut Vec<u8>, hs: &[u64]) {
    put_u32(o, u32::try_from(hs.len()).unwrap_or(u32::MAX));
    o.reserve(hs.len() * 8);
    for h in hs.iter().take(u32::MAX as usize) {
        put_u64(o, *h);
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).and_then(|b| b.first().copied())
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2)
            .and_then(|b| b.try_into().ok())
            .map(u16::from_le_bytes)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    }
    fn hashes(&mut self) -> Option<Vec<u64>> {
        let n = self.u32()? as usize;
        // Check the length against the bytes present before allocating.
        let bytes = self.take(n.checked_mul(8)?)?;
        Some(
            bytes
                .chunks_exact(8)
                .filter_map(|c| c.try_into().ok())
                .map(u64::from_le_bytes)
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn all() -> Vec<Event> {
        vec![
            Event::Routed(NewRequest {
                id: 1 << 48 | 7,
                now_ms: 123,
                worker: 3,
                prefill_worker: Some(255),
                cached_blocks: 2,
                tail_blocks: 17,
                prefill_tokens: 900,
                blocks: vec![1, u64::MAX, 42],
                adapter: 0,
            }),
            Event::Routed(NewRequest {
                id: 2,
                now_ms: 0,
                worker: 0,
                prefill_worker: None,
                cached_blocks: 0,
                tail_blocks: 0,
                prefill_tokens: 0,
                blocks: vec![],
                adapter: 0,
            }),
            Event::PrefillDone { id: 9 },
            Event::Confirmed { id: 9 },
            Event::Free { id: 9 },
            Event::Report {
                worker: 1,
                report: Report {
                    kv_usage: 0.25,
                    waiting: 3,
                    running: Some(4),
                    at_ms: 77,
                },
            },
            Event::Report {
                worker: 1,
                report: Report {
                    kv_usage: 0.5,
                    waiting: 0,
                    running: None,
                    at_ms: 78,
                },
            },
            Event::Failed {
                worker: 2,
                at_ms: 5,
            },
            Event::Recovered { worker: 2 },
            Event::Forget {
                worker: 4,
                hashes: vec![5, 6],
            },
            Event::Calibrate {
                chars_per_token: 4.25,
            },
            Event::EngineStored {
                worker: 1,
                hashes: vec![u64::MAX, 0],
            },
            Event::EngineRemoved {
                worker: 2,
                hashes: vec![],
            },
            Event::EngineCleared { worker: 3 },
            Event::EngineFeed {
                worker: 3,
                on: true,
            },
            Event::EngineFeed {
                worker: 0,
                on: false,
            },
            Event::PeerGone { tag: 0x80_1234 },
            Event::Hinted {
                worker: 2,
                hash: u64::MAX - 1,
            },
            Event::TextTokens {
                text: vec![1, 2],
                tokens: vec![3, u64::MAX],
            },
        ]
    }

    /// The bytes on the wire, written out by hand: peers of different builds may share a
    /// queue during a rolling reload, so the format must not drift with refactors.
    #[test]
    fn wire_format_is_fixed() {
        let evs = [
            Event::Routed(NewRequest {
                id: 7,
                now_ms: 9,
                worker: 3,
                prefill_worker: None,
                cached_blocks: 2,
                tail_blocks: 1,
                prefill_tokens: 5,
                blocks: vec![0xAB],
                adapter: 0,
            }),
            Event::Report {
                worker: 2,
                report: Report {
                    kv_usage: 0.5,
                    waiting: 3,
                    running: None,
                    at_ms: 11,
                },
            },
        ];
        let hex: String = encode(0x0102, &evs)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            hex,
            "02\
             0201000000000000\
             01\
             2c000000\
             0700000000000000\
             0900000000000000\
             0300\
             ffff\
             02000000\
             01000000\
             05000000\
             01000000\
             ab00000000000000\
             04\
             16000000\
             0200\
             0000003f\
             03000000\
             ffffffff\
             0b00000000000000"
        );
    }

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// Version 1 (unframed) messages from an older build are still read.
    #[test]
    fn unframed_version_1_is_still_read() {
        let v1 = unhex(concat!(
            "01",
            "0201000000000000",
            "03",
            "0900000000000000",
            "06",
            "0500",
            "c8",
            "0100"
        ));
        let d = decode_counted(&v1).unwrap();
        assert_eq!(d.sent_ns, 0x0102);
        assert_eq!(
            d.events,
            vec![Event::Free { id: 9 }, Event::Recovered { worker: 5 }]
        );
        assert_eq!(
            (d.skipped, d.first_error),
            (1, Some(DecodeError::UnknownTag(200)))
        );
    }

    /// One bad event (unknown tag from a newer build, or a payload that does not match its
    /// tag) costs only itself, not the batch.
    #[test]
    fn a_bad_event_is_skipped_and_counted() {
        let good = encode(5, &[Event::Free { id: 1 }]);
        let mut msg = good.clone();
        // Unknown tag 200 with a 3-byte payload.
        msg.extend_from_slice(&[200, 3, 0, 0, 0, 1, 2, 3]);
        // A Free whose payload is one byte short.
        msg.extend_from_slice(&[TAG_FREE, 7, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7]);
        // A Recovered with a trailing byte.
        msg.extend_from_slice(&[TAG_RECOVERED, 3, 0, 0, 0, 4, 0, 9]);
        msg.extend_from_slice(&good[9..]);
        let d = decode_counted(&msg).unwrap();
        assert_eq!(d.events, vec![Event::Free { id: 1 }, Event::Free { id: 1 }]);
        assert_eq!(d.skipped, 3);
        assert_eq!(d.first_error, Some(DecodeError::UnknownTag(200)));
        assert_eq!(decode(&msg).unwrap().1.len(), 2);
    }

    #[test]
    fn non_finite_figures_are_skipped_not_applied() {
        let report = |kv_usage| Event::Report {
            worker: 1,
            report: Report {
                kv_usage,
                waiting: 0,
                running: None,
                at_ms: 1,
            },
        };
        let msg = encode(
            1,
            &[
                report(f32::NAN),
                Event::Calibrate {
                    chars_per_token: f64::INFINITY,
                },
                report(0.5),
            ],
        );
        let d = decode_counted(&msg).unwrap();
        assert_eq!(d.events, vec![report(0.5)]);
        assert_eq!(d.skipped, 2);
        assert_eq!(d.first_error, Some(DecodeError::Invalid));
    }

    #[test]
    fn peer_messages_keep_decisions_and_their_end_only() {
        let evs = all();
        let msgs = peer_messages(&encode(42, &evs), 1);
        let back: Vec<Event> = msgs
            .iter()
            .flat_map(|m| {
                let (sent, evs) = decode(m).unwrap();
                assert_eq!(sent, 42);
                evs
            })
            .collect();
        let want: Vec<Event> = evs.into_iter().filter(is_peer_event).collect();
        assert_eq!(back, want);
        assert_eq!(
            want.len(),
            5,
            "two decisions, prefill done, confirmed, free"
        );
        // At most one decision per message here: the two decisions went out apart.
        assert_eq!(msgs.len(), 2);
        for m in &msgs {
            let n = decode(m)
                .unwrap()
                .1
                .iter()
                .filter(|e| matches!(e, Event::Routed(_)))
                .count();
            assert!(n <= 1);
        }
        // Nothing to share, or nothing readable: nothing sent.
        let health = encode(1, &[Event::Recovered { worker: 1 }]);
        assert!(peer_messages(&health, 64).is_empty());
        assert!(peer_messages(&[], 64).is_empty());
        assert!(peer_messages(&[VERSION_UNFRAMED, 0, 0, 0, 0, 0, 0, 0, 0], 64).is_empty());
    }

    #[test]
    fn roundtrip_adapter_events() {
        let evs = vec![
            Event::Routed(NewRequest {
                id: 3,
                now_ms: 1,
                worker: 1,
                prefill_worker: None,
                cached_blocks: 0,
                tail_blocks: 2,
                prefill_tokens: 10,
                blocks: vec![4],
                adapter: 0xADA,
            }),
            Event::Lora {
                worker: 1,
                report: LoraReport {
                    max_lora: Some(2),
                    running: vec![7, 8],
                    waiting: vec![],
                },
            },
            Event::Lora {
                worker: 0,
                report: LoraReport::default(),
            },
        ];
        let msg = encode(42, &evs);
        assert_eq!(decode(&msg), Ok((42, evs.clone())));
        for end in 0..msg.len() {
            let _ = decode(&msg[..end]);
        }
        // Unframed (version 1) decisions never carry an adapter: the next event's bytes
        // are not taken for one.
        let mut plain = evs[0].clone();
        if let Event::Routed(r) = &mut plain {
            r.adapter = 0;
        }
        let mut v1 = vec![VERSION_UNFRAMED];
        v1.extend_from_slice(&42u64.to_le_bytes());
        for e in [
            &plain,
            &Event::Free {
                id: 0x0102_0304_0506_0708,
            },
        ] {
            v1.push(e.tag());
            encode_one(e, &mut v1);
        }
        assert_eq!(
            decode(&v1),
            Ok((
                42,
                vec![
                    plain,
                    Event::Free {
                        id: 0x0102_0304_0506_0708
                    }
                ]
            ))
        );
    }

    #[test]
    fn roundtrip_every_event() {
        let evs = all();
        assert_eq!(decode(&encode(42, &evs)), Ok((42, evs)));
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let msg = encode(7, &all());
        for n in 0..msg.len() {
            let r = decode(&msg[..n]);
            // A cut exactly between events decodes the events before it.
            if let Ok((_, evs)) = r {
                assert!(evs.len() < all().len());
            }
        }
        assert_eq!(decode(&[]), Err(DecodeError::Empty));
        assert_eq!(decode(&[9, 1]), Err(DecodeError::Version(9)));
        assert_eq!(decode(&[VERSION, 1, 2]), Err(DecodeError::Truncated));
        assert_eq!(
            decode(&[VERSION, 0, 0, 0, 0, 0, 0, 0, 0, 200, 0, 0, 0, 0]),
            Err(DecodeError::UnknownTag(200))
        );
        // A frame or hash count far beyond the message must not allocate or panic.
        let mut bad = vec![VERSION, 0, 0, 0, 0, 0, 0, 0, 0, 7];
        bad.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&bad), Err(DecodeError::Truncated));
        let mut bad = vec![VERSION, 0, 0, 0, 0, 0, 0, 0, 0, 7, 10, 0, 0, 0, 0, 0];
        bad.extend_from_slice(&u32::MAX.to_le_bytes());
        bad.extend_from_slice(&[0; 4]);
        assert_eq!(decode(&bad), Err(DecodeError::Truncated));
    }
}
