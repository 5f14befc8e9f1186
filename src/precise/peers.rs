//! Other gateways' routing decisions (shared through kvroute-relay over NATS): which of their
//! events a gateway adopts, and the request ids they get here.
//!
//! A request id is unique only within its gateway (replica member id and a counter), so a
//! peer's ids are moved into a space of their own: the top 24 bits name the peer (top bit
//! set, which local ids never have), the low 40 bits are the peer's id mixed. That keeps two
//! gateways' requests apart and lets a gateway that is gone be purged by its prefix.

use crate::events::Event;
use crate::ids::{mix, RequestId};
use xxhash_rust::xxh3::xxh3_64;

const LOW_BITS: u32 = 40;
const LOW_MASK: u64 = (1 << LOW_BITS) - 1;

/// The id prefix of a peer gateway's requests (24 bits, top bit set).
pub fn peer_tag(gateway: &str) -> u64 {
    0x80_0000 | (xxh3_64(gateway.as_bytes()) & 0x7F_FFFF)
}

/// Whether `id` belongs to the peer with `tag`.
pub fn is_peer_request(id: RequestId, tag: u64) -> bool {
    id >> LOW_BITS == tag
}

fn peer_id(tag: u64, id: RequestId) -> RequestId {
    (tag << LOW_BITS) | (mix(id) & LOW_MASK)
}

/// The events of a peer gateway this gateway applies, with ids moved into the peer's space.
/// Decisions and what followed them (first byte, end, failures, load reports) are shared;
/// cache state from engines is not (each gateway has its own relay for that), nor is the
/// peer's chars-per-token calibration.
pub fn adopt(events: Vec<Event>, tag: u64) -> Vec<Event> {
    events
        .into_iter()
        .filter_map(|e| {
            Some(match e {
                Event::Routed(mut r) => {
                    r.id = peer_id(tag, r.id);
                    Event::Routed(r)
                }
                Event::PrefillDone { id } => Event::PrefillDone {
                    id: peer_id(tag, id),
                },
                Event::Confirmed { id } => Event::Confirmed {
                    id: peer_id(tag, id),
                },
                Event::Free { id } => Event::Free {
                    id: peer_id(tag, id),
                },
                e @ (Event::Report { .. }
                | Event::Failed { .. }
                | Event::Recovered { .. }
                | Event::Forget { .. }) => e,
                Event::Calibrate { .. }
                | Event::EngineStored { .. }
                | Event::EngineRemoved { .. }
                | Event::EngineCleared { .. }
                | Event::EngineFeed { .. }
                | Event::PeerGone { .. } => return None,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::NewRequest;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn peer_ids_live_apart_from_local_ids_and_from_each_other() {
        let (a, b) = (peer_tag("gw-a"), peer_tag("gw-b"));
        assert_ne!(a, b);
        // A local id: replica member id in the high 32 bits (small), counter below.
        let local: RequestId = (7 << 32) | 99;
        let evs = vec![
            Event::Routed(NewRequest {
                id: local,
                worker: 1,
                prefill_worker: None,
                blocks: vec![5],
                cached_blocks: 0,
                tail_blocks: 0,
                prefill_tokens: 10,
                now_ms: 1,
            }),
            Event::Free { id: local },
            Event::Calibrate {
                chars_per_token: 4.0,
            },
            Event::EngineCleared { worker: 1 },
            Event::Recovered { worker: 1 },
        ];
        let from_a = adopt(evs.clone(), a);
        let from_b = adopt(evs, b);
        assert_eq!(from_a.len(), 3, "calibration and engine state stay home");
        let ids = |v: &[Event]| -> Vec<RequestId> {
            v.iter()
                .filter_map(|e| match e {
                    Event::Routed(r) => Some(r.id),
                    Event::Free { id } => Some(*id),
                    _ => None,
                })
                .collect()
        };
        let (ia, ib) = (ids(&from_a), ids(&from_b));
        assert_eq!(ia[0], ia[1], "the same request keeps one id");
        assert_ne!(ia[0], ib[0]);
        assert!(is_peer_request(ia[0], a) && !is_peer_request(ia[0], b));
        assert!(!is_peer_request(local, a));
        assert_eq!(from_a[2], Event::Recovered { worker: 1 });
    }
}
