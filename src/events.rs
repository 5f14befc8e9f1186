//! State changes that every Envoy worker thread's replica must see, and their compact wire
//! form for proxy-wasm shared queues.
//!
//! Each VM applies its own events at once and enqueues them to its peers; a peer applies
//! them in `on_queue_ready`. A message is a version byte, the sender's clock in nanoseconds
//! (so receivers can measure replication delay), then one or more events, so a sender may
//! batch. Decoding never panics: a short or unknown message yields an error and
//! the rest of that message is dropped.

use crate::index::WorkerId;
use crate::load::RequestId;

const VERSION: u8 = 1;
const NO_WORKER: u16 = u16::MAX;
const NO_COUNT: u32 = u32::MAX;

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A routing decision: charge load and record the prompt as cached on the workers.
    Routed {
        id: RequestId,
        now_ms: u64,
        worker: WorkerId,
        prefill_worker: Option<WorkerId>,
        cached_blocks: u32,
        tail_blocks: u32,
        prefill_tokens: u32,
        hashes: Vec<u64>,
    },
    PrefillDone {
        id: RequestId,
    },
    Free {
        id: RequestId,
    },
    Report {
        worker: WorkerId,
        kv_usage: f32,
        waiting: u32,
        running: Option<u32>,
        at_ms: u64,
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeError {
    Empty,
    Version(u8),
    Truncated,
    UnknownTag(u8),
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
        }
    }
}

pub fn encode(sent_ns: u64, events: &[Event]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.push(VERSION);
    put_u64(&mut out, sent_ns);
    for e in events {
        encode_one(e, &mut out);
    }
    out
}

fn encode_one(e: &Event, o: &mut Vec<u8>) {
    match e {
        Event::Routed {
            id,
            now_ms,
            worker,
            prefill_worker,
            cached_blocks,
            tail_blocks,
            prefill_tokens,
            hashes,
        } => {
            o.push(1);
            put_u64(o, *id);
            put_u64(o, *now_ms);
            put_u16(o, *worker);
            put_u16(o, prefill_worker.unwrap_or(NO_WORKER));
            put_u32(o, *cached_blocks);
            put_u32(o, *tail_blocks);
            put_u32(o, *prefill_tokens);
            put_hashes(o, hashes);
        }
        Event::PrefillDone { id } => {
            o.push(2);
            put_u64(o, *id);
        }
        Event::Free { id } => {
            o.push(3);
            put_u64(o, *id);
        }
        Event::Report {
            worker,
            kv_usage,
            waiting,
            running,
            at_ms,
        } => {
            o.push(4);
            put_u16(o, *worker);
            put_u32(o, kv_usage.to_bits());
            put_u32(o, *waiting);
            put_u32(o, running.unwrap_or(NO_COUNT));
            put_u64(o, *at_ms);
        }
        Event::Failed { worker, at_ms } => {
            o.push(5);
            put_u16(o, *worker);
            put_u64(o, *at_ms);
        }
        Event::Recovered { worker } => {
            o.push(6);
            put_u16(o, *worker);
        }
        Event::Forget { worker, hashes } => {
            o.push(7);
            put_u16(o, *worker);
            put_hashes(o, hashes);
        }
        Event::Calibrate { chars_per_token } => {
            o.push(8);
            put_u64(o, chars_per_token.to_bits());
        }
    }
}

/// The sender's clock and the events of one message.
pub fn decode(msg: &[u8]) -> Result<(u64, Vec<Event>), DecodeError> {
    let (&v, rest) = msg.split_first().ok_or(DecodeError::Empty)?;
    if v != VERSION {
        return Err(DecodeError::Version(v));
    }
    let mut r = Reader(rest);
    let sent_ns = r.u64().ok_or(DecodeError::Truncated)?;
    let mut out = Vec::new();
    while let Some(tag) = r.u8() {
        out.push(decode_one(tag, &mut r)?);
    }
    Ok((sent_ns, out))
}

fn decode_one(tag: u8, r: &mut Reader<'_>) -> Result<Event, DecodeError> {
    let t = DecodeError::Truncated;
    Ok(match tag {
        1 => {
            let id = r.u64().ok_or(t)?;
            let now_ms = r.u64().ok_or(t)?;
            let worker = r.u16().ok_or(t)?;
            let pw = r.u16().ok_or(t)?;
            let cached_blocks = r.u32().ok_or(t)?;
            let tail_blocks = r.u32().ok_or(t)?;
            let prefill_tokens = r.u32().ok_or(t)?;
            let hashes = r.hashes().ok_or(t)?;
            let prefill_worker = (pw != NO_WORKER).then_some(pw);
            Event::Routed {
                id,
                now_ms,
                worker,
                prefill_worker,
                cached_blocks,
                tail_blocks,
                prefill_tokens,
                hashes,
            }
        }
        2 => Event::PrefillDone {
            id: r.u64().ok_or(t)?,
        },
        3 => Event::Free {
            id: r.u64().ok_or(t)?,
        },
        4 => {
            let worker = r.u16().ok_or(t)?;
            let kv_usage = f32::from_bits(r.u32().ok_or(t)?);
            let waiting = r.u32().ok_or(t)?;
            let running = r.u32().ok_or(t)?;
            let at_ms = r.u64().ok_or(t)?;
            Event::Report {
                worker,
                kv_usage,
                waiting,
                running: (running != NO_COUNT).then_some(running),
                at_ms,
            }
        }
        5 => Event::Failed {
            worker: r.u16().ok_or(t)?,
            at_ms: r.u64().ok_or(t)?,
        },
        6 => Event::Recovered {
            worker: r.u16().ok_or(t)?,
        },
        7 => Event::Forget {
            worker: r.u16().ok_or(t)?,
            hashes: r.hashes().ok_or(t)?,
        },
        8 => Event::Calibrate {
            chars_per_token: f64::from_bits(r.u64().ok_or(t)?),
        },
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
            Event::Routed {
                id: 1 << 48 | 7,
                now_ms: 123,
                worker: 3,
                prefill_worker: Some(255),
                cached_blocks: 2,
                tail_blocks: 17,
                prefill_tokens: 900,
                hashes: vec![1, u64::MAX, 42],
            },
            Event::Routed {
                id: 2,
                now_ms: 0,
                worker: 0,
                prefill_worker: None,
                cached_blocks: 0,
                tail_blocks: 0,
                prefill_tokens: 0,
                hashes: vec![],
            },
            Event::PrefillDone { id: 9 },
            Event::Free { id: 9 },
            Event::Report {
                worker: 1,
                kv_usage: 0.25,
                waiting: 3,
                running: Some(4),
                at_ms: 77,
            },
            Event::Report {
                worker: 1,
                kv_usage: 0.5,
                waiting: 0,
                running: None,
                at_ms: 78,
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
        ]
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
            decode(&[VERSION, 0, 0, 0, 0, 0, 0, 0, 0, 200]),
            Err(DecodeError::UnknownTag(200))
        );
        // A hash count far beyond the message must not allocate or panic.
        let mut bad = vec![VERSION, 0, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0];
        bad.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&bad), Err(DecodeError::Truncated));
    }
}
