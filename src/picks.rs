//! Recent routing decisions shared by the VMs of one Envoy (one per worker thread) through
//! one shared-data record, read before and written after every routing decision.
//!
//! Replication brings each decision to the other threads about a millisecond later: it
//! leaves with the deferred-work timer, after the request went upstream. Two requests of one
//! burst routed on two threads inside that window each saw the same idle worker and both
//! went there (Mooncake conversation, dev window 1200-1999 at speed 12: of 124 pairs of
//! requests sent within 5 ms of each other to one worker, the later one had not seen the
//! earlier one's load in 117). Shared data is read and written under Envoy's lock, so the
//! record closes that window: a thread charges what the others picked moments ago,
//! provisionally, until the full event replaces the charge ([`crate::load::Load`]).
//!
//! A request that ends inside the window is marked ended in the record, by the thread that
//! routed it, in the same way: its end event leaves with the timer too, and a client's next
//! request, on another thread, would otherwise find the last one still in flight there
//! (a CPU-starved Envoy's timers run late: in the e2e thread test, 6 of 40 runs sent a
//! cached 16k prompt elsewhere, its worker looking busy with requests long done).
//!
//! The record is small and bounded: at most [`MAX_PICKS`] picks, none older than
//! [`WINDOW_MS`]. A malformed record (another build, a torn write) decodes to what parses.

use crate::ids::{RequestId, WorkerId};

/// A pick older than this is not read: by then its event has been replicated (p99 well
/// under a millisecond after the timer), or the thread that made it is stuck, and a stale
/// provisional charge would only misplace load.
pub const WINDOW_MS: u64 = 50;
/// Picks kept in the record: the newest, enough for a burst across every thread.
pub const MAX_PICKS: usize = 32;

const VERSION: u8 = 2;
const ENTRY: usize = 8 + 2 + 2 + 4 + 4 + 8 + 1;
const NO_WORKER: u16 = u16::MAX;

/// One routing decision as the other threads need it to charge its load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    pub id: RequestId,
    pub worker: WorkerId,
    pub prefill_worker: Option<WorkerId>,
    /// Prompt tokens the (prefill) worker has to compute.
    pub prefill_tokens: u32,
    /// KV blocks the request will hold on `worker` (prompt and expected output).
    pub blocks: u32,
    pub at_ms: u64,
    /// The request already ended: nothing to charge, and a charge made is released.
    pub ended: bool,
}

pub fn encode(picks: &[Pick]) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + picks.len() * ENTRY);
    out.push(VERSION);
    for p in picks {
        out.extend_from_slice(&p.id.to_le_bytes());
        out.extend_from_slice(&p.worker.to_le_bytes());
        out.extend_from_slice(&p.prefill_worker.unwrap_or(NO_WORKER).to_le_bytes());
        out.extend_from_slice(&p.prefill_tokens.to_le_bytes());
        out.extend_from_slice(&p.blocks.to_le_bytes());
        out.extend_from_slice(&p.at_ms.to_le_bytes());
        out.push(u8::from(p.ended));
    }
    out
}

/// The picks of a record; an unknown version or a torn tail yields what parses before it.
pub fn decode(bytes: &[u8]) -> Vec<Pick> {
    let Some((&VERSION, body)) = bytes.split_first() else {
        return Vec::new();
    };
    body.chunks_exact(ENTRY).filter_map(entry).collect()
}

fn entry(e: &[u8]) -> Option<Pick> {
    let u64_at = |i: usize| Some(u64::from_le_bytes(e.get(i..i + 8)?.try_into().ok()?));
    let u32_at = |i: usize| Some(u32::from_le_bytes(e.get(i..i + 4)?.try_into().ok()?));
    let u16_at = |i: usize| Some(u16::from_le_bytes(e.get(i..i + 2)?.try_into().ok()?));
    let prefill = u16_at(10)?;
    Some(Pick {
        id: u64_at(0)?,
        worker: u16_at(8)?,
        prefill_worker: (prefill != NO_WORKER).then_some(prefill),
        prefill_tokens: u32_at(12)?,
        blocks: u32_at(16)?,
        at_ms: u64_at(20)?,
        ended: *e.get(28)? != 0,
    })
}

/// Whether `p` is recent enough at `now_ms` to be charged.
pub fn fresh(p: &Pick, now_ms: u64) -> bool {
    now_ms.saturating_sub(p.at_ms) <= WINDOW_MS
}

/// The record with `new` added: picks out of the window dropped, the newest `MAX_PICKS`
/// kept.
pub fn merge(record: &[u8], new: Pick, now_ms: u64) -> Vec<u8> {
    let mut picks: Vec<Pick> = decode(record)
        .into_iter()
        .filter(|p| p.id != new.id && fresh(p, now_ms))
        .collect();
    picks.push(new);
    let skip = picks.len().saturating_sub(MAX_PICKS);
    encode(picks.get(skip..).unwrap_or(&[]))
}

/// The record with request `id` marked ended; `None` when it holds no such pick (out of the
/// window already, or pushed out), so nothing needs writing.
pub fn end(record: &[u8], id: RequestId) -> Option<Vec<u8>> {
    let mut picks = decode(record);
    let p = picks.iter_mut().find(|p| p.id == id && !p.ended)?;
    p.ended = true;
    Some(encode(&picks))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pick(id: RequestId, at_ms: u64) -> Pick {
        Pick {
            id,
            worker: 3,
            prefill_worker: id.is_multiple_of(2).then_some(7),
            prefill_tokens: 30_000,
            blocks: 2_004,
            at_ms,
            ended: id.is_multiple_of(3),
        }
    }

    #[test]
    fn a_record_round_trips() {
        let picks = [pick(1 << 32 | 5, 100), pick(2 << 32 | 9, 101)];
        assert_eq!(decode(&encode(&picks)), picks);
        assert_eq!(decode(&encode(&[])), []);
    }

    #[test]
    fn malformed_records_yield_what_parses() {
        let picks = [pick(1, 100), pick(2, 101)];
        let mut bytes = encode(&picks);
        assert_eq!(decode(&bytes[..bytes.len() - 3]), &picks[..1]);
        assert_eq!(decode(&[]), []);
        bytes[0] = 9;
        assert_eq!(decode(&bytes), [], "unknown version");
    }

    #[test]
    fn an_ended_pick_is_marked_once_and_an_absent_one_not_at_all() {
        let rec = encode(&[pick(1, 100), pick(2, 101)]);
        let ended = end(&rec, 2).unwrap_or_default();
        let picks = decode(&ended);
        assert_eq!(
            picks.iter().map(|p| (p.id, p.ended)).collect::<Vec<_>>(),
            [(1, false), (2, true)]
        );
        assert_eq!(end(&ended, 2), None, "already marked");
        assert_eq!(end(&rec, 3), None, "not in the record");
    }

    #[test]
    fn merge_keeps_the_newest_picks_inside_the_window() {
        let mut rec = encode(&[pick(1, 0)]);
        rec = merge(&rec, pick(2, WINDOW_MS), WINDOW_MS);
        assert_eq!(
            decode(&rec).len(),
            2,
            "the first is exactly at the window's edge"
        );
        rec = merge(&rec, pick(3, WINDOW_MS + 1), WINDOW_MS + 1);
        let ids: Vec<_> = decode(&rec).iter().map(|p| p.id).collect();
        assert_eq!(ids, [2, 3]);
        for i in 10..100 {
            rec = merge(&rec, pick(i, WINDOW_MS + 2), WINDOW_MS + 2);
        }
        let kept = decode(&rec);
        assert_eq!(kept.len(), MAX_PICKS);
        assert_eq!(kept.last().map(|p| p.id), Some(99));
        // A pick written again (a retried CAS) is not doubled.
        rec = merge(&rec, pick(99, WINDOW_MS + 2), WINDOW_MS + 2);
        assert_eq!(decode(&rec).iter().filter(|p| p.id == 99).count(), 1);
    }
}
