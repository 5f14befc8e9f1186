//! vLLM KV cache events (`--kv-events`): the msgpack bytes against msgspec's (golden fixtures
//! from tests/fixtures/gen_kv_events.py) and the ZeroMQ PUB/ROUTER behaviour end to end.

mod common;

use std::time::Duration;

use bytes::Bytes;
use mock_worker::kv;
use mock_worker::kv_events::{encode, Batch, Format, KvEvent, END_SEQ};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

fn unhex(s: &str) -> Vec<u8> {
    let s = s.trim();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// The batch `fixed_batch()` of gen_kv_events.py builds.
fn fixed_batch() -> Batch {
    let tokens: Vec<u32> = vec![0, 1, 127, 128, 255, 256, 65535, 65536, u32::MAX, 7, 8, 9];
    Batch {
        ts: 1700000000.125,
        events: vec![
            KvEvent::AllBlocksCleared,
            KvEvent::BlockStored {
                block_hashes: vec![0xFEDC_BA98_7654_3210, 42],
                parent_block_hash: None,
                token_ids: tokens[..8].to_vec(),
                block_size: 4,
            },
            KvEvent::BlockStored {
                block_hashes: vec![300],
                parent_block_hash: Some(42),
                token_ids: tokens[8..12].to_vec(),
                block_size: 4,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![0xFEDC_BA98_7654_3210],
            },
        ],
        data_parallel_rank: Some(0),
    }
}

#[test]
fn encoder_matches_msgspec_byte_for_byte() {
    let array = unhex(include_str!("fixtures/kv_events_array.hex"));
    assert_eq!(encode(&fixed_batch(), Format::Array), array);
    let map = unhex(include_str!("fixtures/kv_events_map.hex"));
    assert_eq!(encode(&fixed_batch(), Format::Map), map);
    // The other generations differ (for decoders: see the generator's docstring).
    for other in [
        include_str!("fixtures/kv_events_array_group.hex"),
        include_str!("fixtures/kv_events_v0_9.hex"),
    ] {
        assert_ne!(unhex(other), array);
        assert_eq!(Value::decode(&unhex(other)).events().len(), 4);
    }
    assert_eq!(Value::decode(&array), Value::decode(&array));
}

/// Just enough msgpack decoding to read the events back.
#[derive(Debug, Clone, PartialEq)]
enum Value {
    Nil,
    Int(i128),
    F64(f64),
    Str(String),
    Arr(Vec<Value>),
    Map(Vec<(Value, Value)>),
}

impl Value {
    fn decode(mut b: &[u8]) -> Value {
        let v = Self::read(&mut b);
        assert!(b.is_empty(), "trailing bytes");
        v
    }

    fn read(b: &mut &[u8]) -> Value {
        use rmp::Marker as M;
        let m = rmp::decode::read_marker(b).unwrap();
        let mut take = |n: usize| {
            let (h, t) = b.split_at(n);
            *b = t;
            h.to_vec()
        };
        let be = |v: Vec<u8>| v.iter().fold(0u128, |a, &x| (a << 8) | u128::from(x));
        let len = match m {
            M::FixArray(n) => return Self::arr(b, n as usize),
            M::Array16 => {
                let n = be(take(2)) as usize;
                return Self::arr(b, n);
            }
            M::Array32 => {
                let n = be(take(4)) as usize;
                return Self::arr(b, n);
            }
            M::FixMap(n) => return Self::map(b, n as usize),
            M::Map16 => {
                let n = be(take(2)) as usize;
                return Self::map(b, n);
            }
            M::FixStr(n) => n as usize,
            M::Str8 => be(take(1)) as usize,
            M::Str16 => be(take(2)) as usize,
            M::FixPos(n) => return Value::Int(i128::from(n)),
            M::FixNeg(n) => return Value::Int(i128::from(n)),
            M::U8 => return Value::Int(be(take(1)) as i128),
            M::U16 => return Value::Int(be(take(2)) as i128),
            M::U32 => return Value::Int(be(take(4)) as i128),
            M::U64 => return Value::Int(be(take(8)) as i128),
            M::I64 => return Value::Int(i128::from(be(take(8)) as u64 as i64)),
            M::F64 => return Value::F64(f64::from_bits(be(take(8)) as u64)),
            M::Null => return Value::Nil,
            other => panic!("unexpected marker {other:?}"),
        };
        Value::Str(String::from_utf8(take(len)).unwrap())
    }

    fn arr(b: &mut &[u8], n: usize) -> Value {
        Value::Arr((0..n).map(|_| Self::read(b)).collect())
    }

    fn map(b: &mut &[u8], n: usize) -> Value {
        Value::Map((0..n).map(|_| (Self::read(b), Self::read(b))).collect())
    }

    fn arr_ref(&self) -> &[Value] {
        match self {
            Value::Arr(v) => v,
            other => panic!("not an array: {other:?}"),
        }
    }

    /// A batch's events.
    fn events(&self) -> &[Value] {
        self.arr_ref()[1].arr_ref()
    }

    fn int(&self) -> i128 {
        match self {
            Value::Int(i) => *i,
            other => panic!("not an int: {other:?}"),
        }
    }

    fn ints(&self) -> Vec<u64> {
        self.arr_ref().iter().map(|v| v.int() as u64).collect()
    }
}

/// A positional event as (tag, fields).
fn event(v: &Value) -> (String, Vec<Value>) {
    let a = v.arr_ref();
    match &a[0] {
        Value::Str(tag) => (tag.clone(), a[1..].to_vec()),
        other => panic!("no tag: {other:?}"),
    }
}

struct Received {
    seq: u64,
    payload: Bytes,
    batch: Value,
}

async fn next_batch(sub: &mut zeromq::SubSocket, topic: &str) -> Received {
    let msg = tokio::time::timeout(Duration::from_secs(10), sub.recv())
        .await
        .expect("no KV event batch within 10 s")
        .unwrap();
    let frames = msg.into_vec();
    assert_eq!(frames.len(), 3, "[topic, seq, payload]");
    assert_eq!(frames[0].as_ref(), topic.as_bytes());
    let seq = u64::from_be_bytes(frames[1].as_ref().try_into().unwrap());
    Received {
        seq,
        batch: Value::decode(&frames[2]),
        payload: frames[2].clone(),
    }
}

/// Receives batches until `pred` holds for one; returns all of them.
async fn until(
    sub: &mut zeromq::SubSocket,
    got: &mut Vec<Received>,
    pred: impl Fn(&(String, Vec<Value>)) -> bool,
) {
    loop {
        let r = next_batch(sub, "kv").await;
        let hit = r.batch.events().iter().map(event).any(|e| pred(&e));
        got.push(r);
        if hit {
            return;
        }
    }
}

async fn replay(endpoint: &str, start: u64) -> Vec<(i64, Bytes)> {
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(endpoint).await.unwrap();
    let req = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start.to_be_bytes()),
    ])
    .unwrap();
    dealer.send(req).await.unwrap();
    let mut out = vec![];
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(10), dealer.recv())
            .await
            .expect("replay answer within 10 s")
            .unwrap()
            .into_vec();
        // vLLM 0.32: ['', topic, seq, payload] (the END marker's topic empty); the older
        // formats: ['', seq, payload].
        assert!(matches!(msg.len(), 3 | 4), "['', (topic,) seq, payload]");
        assert!(msg[0].is_empty(), "empty delimiter first");
        let (seq_frame, payload) = (&msg[msg.len() - 2], &msg[msg.len() - 1]);
        let seq = i64::from_be_bytes(seq_frame.as_ref().try_into().unwrap());
        out.push((seq, payload.clone()));
        if seq_frame.as_ref() == END_SEQ {
            assert!(payload.is_empty(), "END marker has an empty payload");
            assert!(
                msg.len() == 3 || msg[1].is_empty(),
                "END marker has an empty topic"
            );
            return out;
        }
    }
}

fn completion(tokens: &[u32], max_tokens: usize) -> String {
    serde_json::json!({"model": "mock-model", "prompt": tokens, "max_tokens": max_tokens})
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_follow_the_cache_and_replay_serves_the_buffer() {
    let h = common::worker(
        "--kv-events tcp://127.0.0.1:0 --kv-events-replay tcp://127.0.0.1:0 --kv-events-topic kv \
         --block-size 4 --kv-blocks 12 --speedup 100 --kv-events-format array --no-null-block \
         --no-duplicate-blocks",
    )
    .await;
    let ep = h.kv_events.clone().expect("events are on");
    let replay_ep = ep.replay.clone().expect("replay is on");
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&ep.publish).await.unwrap();
    sub.subscribe("kv").await.unwrap();
    // The subscription reaches the publisher asynchronously (ZeroMQ's slow joiner).
    tokio::time::sleep(Duration::from_millis(300)).await;

    // A prompt of 10 tokens: 2 full blocks stored when scheduled, more as output fills them.
    let prompt: Vec<u32> = (0..10).map(|i| 1000 + i).collect();
    let r = common::post(h.addr, "/v1/completions", &completion(&prompt, 7), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let mut got = vec![];
    // 10 prompt + 7 output tokens, of which the first 16 are computed: 4 full blocks.
    let mut stored: Vec<(Vec<u64>, Option<u64>, Vec<u64>)> = vec![];
    while stored.iter().map(|s| s.0.len()).sum::<usize>() < 4 {
        until(&mut sub, &mut got, |e| e.0 == "BlockStored").await;
        for e in got.last().unwrap().batch.events().iter().map(event) {
            let (tag, f) = e;
            assert_eq!(tag, "BlockStored");
            assert_eq!(f.len(), 7, "block_hashes .. lora_name");
            assert_eq!(f[3], Value::Int(4), "block_size");
            assert_eq!(f[4], Value::Nil, "lora_id");
            assert_eq!(f[5], Value::Str("GPU".into()), "medium");
            assert_eq!(f[6], Value::Nil, "lora_name");
            let parent = match &f[1] {
                Value::Nil => None,
                v => Some(v.int() as u64),
            };
            stored.push((f[0].ints(), parent, f[2].ints()));
        }
    }
    // The first event starts the chain at the prompt's first block.
    assert_eq!(stored[0].1, None);
    assert_eq!(
        stored[0].2[..8],
        prompt[..8]
            .iter()
            .map(|&t| u64::from(t))
            .collect::<Vec<_>>()
    );
    // Each later event's parent is the last hash stored before it; hashes are the mock's.
    let all_tokens: Vec<u32> = stored
        .iter()
        .flat_map(|s| s.2.iter().map(|&t| t as u32))
        .collect();
    assert_eq!(all_tokens.len(), 16);
    assert_eq!(all_tokens[..10], prompt[..]);
    let mut expect = vec![];
    kv::extend_hashes(&mut expect, 0, &all_tokens, 4);
    let all_hashes: Vec<u64> = stored.iter().flat_map(|s| s.0.clone()).collect();
    assert_eq!(all_hashes, expect);
    for w in stored.windows(2) {
        assert_eq!(
            w[1].1,
            w[0].0.last().copied(),
            "parent chains to the previous event"
        );
        assert_eq!(
            w[1].2.len(),
            4 * w[1].0.len(),
            "token_ids cover the stored blocks"
        );
    }

    // Eviction pressure: 12 blocks, so distinct 16-token prompts soon evict the first chain
    // (least recently freed, leaf first).
    for seed in 1..4u32 {
        let p: Vec<u32> = (0..16).map(|i| 2000 * seed + i).collect();
        let r = common::post(h.addr, "/v1/completions", &completion(&p, 1), &[]).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    until(&mut sub, &mut got, |e| e.0 == "BlockRemoved").await;
    let removed: Vec<u64> = got
        .iter()
        .flat_map(|r| r.batch.events().iter().map(event))
        .filter(|e| e.0 == "BlockRemoved")
        .flat_map(|e| {
            assert_eq!(e.1[1], Value::Str("GPU".into()));
            e.1[0].ints()
        })
        .collect();
    assert_eq!(
        removed[0], expect[3],
        "the leaf of the oldest chain goes first"
    );
    let m = common::get(h.addr, "/metrics").await.body;
    assert!(common::metric(&m, "mock:kv_evicted_blocks_total") >= 1.0);
    assert_eq!(
        common::metric(&m, "mock:kv_event_batches_dropped_total"),
        0.0
    );

    // vLLM's /reset_prefix_cache clears the cache and says so.
    let last_prompt: Vec<u32> = (0..16).map(|i| 2000 * 3 + i).collect();
    let cached = |body: String| {
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["cached_tokens"].clone()
    };
    let probe = common::post(h.addr, "/v1/cache/probe", &completion(&last_prompt, 1), &[]).await;
    assert_eq!(cached(probe.body), 12);
    let r = common::post(h.addr, "/reset_prefix_cache", "", &[]).await;
    assert_eq!(r.status, 200);
    until(&mut sub, &mut got, |e| e.0 == "AllBlocksCleared").await;
    let probe = common::post(h.addr, "/v1/cache/probe", &completion(&last_prompt, 1), &[]).await;
    assert_eq!(cached(probe.body), 0);

    // Sequence numbers are consecutive; the first batch (before we subscribed) was seq 0.
    for w in got.windows(2) {
        assert_eq!(w[1].seq, w[0].seq + 1);
    }
    for r in &got {
        assert!(
            r.batch.arr_ref().len() == 3,
            "[ts, events, data_parallel_rank]"
        );
        assert_eq!(r.batch.arr_ref()[2], Value::Int(0));
        match r.batch.arr_ref()[0] {
            Value::F64(ts) => assert!(ts > 1.7e9, "unix seconds"),
            ref other => panic!("ts {other:?}"),
        }
    }

    // Replay from 0: the start-up AllBlocksCleared, then the very bytes published, then END.
    let all = replay(&replay_ep, 0).await;
    let (end, batches) = all.split_last().unwrap();
    assert_eq!(end.0, -1);
    assert_eq!(batches[0].0, 0);
    let first = Value::decode(&batches[0].1);
    assert_eq!(first.events().len(), 1);
    assert_eq!(event(&first.events()[0]).0, "AllBlocksCleared");
    for (i, (seq, _)) in batches.iter().enumerate() {
        assert_eq!(*seq, i as i64);
    }
    let last = got.last().unwrap().seq;
    assert_eq!(batches.last().unwrap().0, last as i64);
    for r in &got {
        assert_eq!(
            batches[r.seq as usize].1, r.payload,
            "replayed bytes = published bytes"
        );
    }
    // A later start returns only the tail.
    let tail = replay(&replay_ep, last - 1).await;
    let seqs: Vec<i64> = tail.iter().map(|t| t.0).collect();
    assert_eq!(seqs, vec![last as i64 - 1, last as i64, -1]);
    // Beyond the end: only the END marker.
    assert_eq!(replay(&replay_ep, last + 100).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_buffer_keeps_only_the_last_batches_and_off_means_off() {
    let h = common::worker(
        "--kv-events tcp://127.0.0.1:0 --kv-events-replay tcp://127.0.0.1:0 --kv-events-buffer 2 \
         --block-size 4 --kv-blocks 64 --speedup 100",
    )
    .await;
    let ep = h.kv_events.clone().unwrap();
    for seed in 0..3u32 {
        let p: Vec<u32> = (0..8).map(|i| 500 * seed + i).collect();
        let r = common::post(h.addr, "/v1/completions", &completion(&p, 1), &[]).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    // At least one stored batch per request (nothing at start-up, as vLLM 0.32): only the
    // last 2 are kept.
    let all = replay(ep.replay.as_deref().unwrap(), 0).await;
    assert_eq!(
        all.len(),
        3,
        "{:?}",
        all.iter().map(|a| a.0).collect::<Vec<_>>()
    );
    assert!(all[0].0 >= 1);
    assert_eq!(all[1].0, all[0].0 + 1);

    let off = common::worker("--block-size 4 --kv-blocks 64").await;
    assert!(off.kv_events.is_none());
    let m = common::get(off.addr, "/metrics").await.body;
    assert_eq!(
        common::metric(&m, "mock:kv_event_batches_dropped_total"),
        0.0
    );
}
