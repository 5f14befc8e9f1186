//! The bodies of kvroute-relay's fuzz targets: the decoders of what engines, gateways and
//! other relays send it. Shared by the libFuzzer binaries (`fuzz_targets/relay_*.rs`) and by
//! the native corpus replay in `make test` (`relay/tests/fuzz_corpus.rs`), which include this
//! file as a module.
//!
//! The relay's readers are async; here they read from memory, where every read is ready at
//! once, so each future is polled once (with a no-op waker) and must be finished.

use bytes::Bytes;
use kvroute::precise::wire::{Update, WatchRequest};
use kvroute_relay::decode::{decode_batch, Event};
use kvroute_relay::index::{Counts, DeltaBuilder, EngineIndex};
use kvroute_relay::msgpack::{Reader, Value};
use kvroute_relay::share::{PeerEvent, Share, ShareMsg};
use kvroute_relay::zmtp::Dealer;
use prost::Message as _;
use std::collections::{HashSet, VecDeque};
use std::convert::Infallible;
use std::future::Future;
use std::pin::{pin, Pin};
use std::task::{Context, Poll, Waker};
use tonic::codec::{Codec, ProstCodec};

include!("relay_targets.rs");

/// Runs the named relay target on one input; `false` for an unknown name.
pub fn run(target: &str, data: &[u8]) -> bool {
    let body: fn(&[u8]) = match target {
        "relay_zmtp" => relay_zmtp,
        "relay_msgpack" => relay_msgpack,
        "relay_vllm" => relay_vllm,
        "relay_watch" => relay_watch,
        "relay_nats" => relay_nats,
        _ => return false,
    };
    body(data);
    true
}

/// Polls a future over in-memory I/O once: it must not wait.
fn ready<T>(f: impl Future<Output = T>) -> T {
    match pin!(f).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("waits on bytes that are all in memory"),
    }
}

/// `zmtp::Dealer` against a replay peer whose bytes are `data`: handshake, then a replay.
pub fn relay_zmtp(data: &[u8]) {
    let io = tokio::io::BufStream::new(tokio::io::join(data, tokio::io::sink()));
    let got = ready(async {
        let mut d = Dealer::handshake(io).await?;
        d.replay(0).await
    });
    match got {
        Ok(items) => {
            // 64-byte greeting, READY, and per batch at least two 2-byte frame headers and
            // the 8-byte sequence number.
            assert!(data.len() >= 64 + items.len() * 12);
            let payload: usize = items.iter().map(|(_, p)| p.len()).sum();
            assert!(
                payload <= data.len(),
                "{payload} payload bytes from {}",
                data.len()
            );
            assert!(items.iter().all(|(seq, _)| *seq != u64::MAX));
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}

/// `msgpack::Reader`: value by value, then whole values skipped. Every read makes progress
/// and no container announces more items than bytes left.
pub fn relay_msgpack(data: &[u8]) {
    let mut r = Reader::new(data);
    while r.remaining() > 0 {
        let before = r.remaining();
        match r.read() {
            None => break,
            Some(Value::Array(n)) => assert!(n <= r.remaining()),
            Some(Value::Map(n)) => assert!(n.saturating_mul(2) <= r.remaining()),
            Some(Value::Str(s) | Value::Bin(s) | Value::Ext(_, s)) => {
                assert!(s.len() < before)
            }
            Some(_) => {}
        }
        assert!(r.remaining() < before, "read made no progress");
    }
    let mut r = Reader::new(data);
    while r.remaining() > 0 {
        let before = r.remaining();
        if r.skip().is_none() {
            break;
        }
        assert!(r.remaining() < before, "skip made no progress");
    }
}

/// `decode::decode_batch`, then the batch applied to small indexes (block sizes 1 and 4, at
/// most 16 blocks) the way the engine task does. The index stays within its bound, and a
/// gateway applying the published delta holds exactly what the index holds, copies of a
/// block and engine blocks that re-key to one hash included (a hash goes with its last one).
pub fn relay_vllm(data: &[u8]) {
    let Ok(batch) = decode_batch(data) else {
        return;
    };
    assert!(batch.events.len() <= data.len());
    let hashes: usize = batch
        .events
        .iter()
        .map(|e| match e {
            Event::Stored(s) => s.block_hashes.len(),
            Event::Removed(h) => h.len(),
            Event::Cleared => 0,
        })
        .sum();
    assert!(hashes <= data.len());
    for bs in [1, 4] {
        let mut ix = EngineIndex::with_max_blocks("m", bs, 16);
        let mut held: HashSet<u64> = HashSet::new();
        let mut c = Counts::default();
        for ev in &batch.events {
            let mut d = DeltaBuilder::default();
            ix.apply(ev, &mut d, &mut c);
            assert!(ix.blocks.len() <= 16, "{} blocks held", ix.blocks.len());
            let d = d.finish();
            if d.cleared {
                held.clear();
            }
            held.extend(&d.stored);
            for h in &d.removed {
                held.remove(h);
            }
            let snap = ix.blocks.snapshot();
            let now: HashSet<u64> = snap.iter().copied().collect();
            assert_eq!(now.len(), snap.len(), "a snapshot lists a hash twice");
            assert_eq!(held, now, "a gateway's view differs from the index");
            for h in &now {
                assert!(ix.blocks.holders(*h) >= 1);
            }
        }
        assert!(c.blocks_stored as usize <= hashes);
        assert!((c.blocks_removed + c.evicted) as usize <= hashes);
    }
}

/// The request body of a gRPC call, in chunks.
struct Wire(VecDeque<Bytes>);

impl http_body::Body for Wire {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.0.pop_front().map(|b| Ok(http_body::Frame::data(b))))
    }
}

/// What a gateway sends on `Relay/Watch`: gRPC length-prefixed `WatchRequest`s, read by the
/// relay's tonic decoder (4 MiB limit, as served), in chunks whose size the input picks.
pub fn relay_watch(data: &[u8]) {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let size = 1 + usize::from(first % 64) * 16;
    let chunks = rest.chunks(size).map(Bytes::copy_from_slice).collect();
    let decoder = ProstCodec::<Update, WatchRequest>::default().decoder();
    let mut s = tonic::Streaming::new_request(decoder, Wire(chunks), None, Some(4 << 20));
    let mut n = 0usize;
    while let Ok(Some(req)) = ready(s.message()) {
        n += 1;
        // Each message takes its 5-byte prefix.
        assert!(n * 5 <= rest.len());
        let again = WatchRequest::decode(req.encode_to_vec().as_slice()).expect("re-encoded");
        assert_eq!(again, req);
        let decisions: usize = req.decisions.iter().map(Vec::len).sum();
        assert!(decisions + req.gateway.len() + req.group.len() <= rest.len());
    }
}

/// A NATS message from another relay (`share::ShareMsg`), decoded and taken in as the relay's
/// receiver does, with a local stream of the message's group listening.
pub fn relay_nats(data: &[u8]) {
    let Ok(msg) = ShareMsg::decode(data) else {
        return;
    };
    let again = ShareMsg::decode(msg.encode_to_vec().as_slice()).expect("re-encoded");
    assert_eq!(again, msg);
    let share = Share::new(1);
    let (_, mut rx) = share.register("local-gateway", &msg.group);
    let (peers, gone) = (msg.peers.len(), msg.gone.len());
    share.on_remote(msg);
    let mut events = 0;
    while let Ok(ev) = rx.try_recv() {
        events += match ev {
            PeerEvent::Decisions(_) | PeerEvent::Gone(_) => 1,
        };
    }
    assert!(
        events <= peers + gone,
        "{events} events from {peers} peers, {gone} gone"
    );
}
