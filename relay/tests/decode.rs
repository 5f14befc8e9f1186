//! Decoder tests on hand-built MessagePack bytes.

use kvroute_relay::decode::{decode_batch, engine_key_bytes, Event, Stored};
use kvroute_relay::msgpack::Writer;
use kvroute_relay::vllm::{batch, chain, Ev, Hash};

fn stored(e: &Event<'_>) -> Stored<'static> {
    match e {
        Event::Stored(s) => Stored {
            block_hashes: s.block_hashes.clone(),
            parent: s.parent,
            token_ids: s.token_ids.clone(),
            block_size: s.block_size,
            lora_name: None,
        },
        other => panic!("not stored: {other:?}"),
    }
}

#[test]
fn array_form_literal_bytes() {
    // [1.0, [["BlockStored", [7], None, [1, 2], 2, None, "GPU", None], ["BlockRemoved", [7], "GPU"],
    //  ["AllBlocksCleared"]], 0], written byte by byte from the MessagePack spec.
    let mut b = vec![0x93, 0xcb];
    b.extend_from_slice(&1.0f64.to_be_bytes());
    b.push(0x93);
    b.push(0x98);
    b.push(0xab);
    b.extend_from_slice(b"BlockStored");
    b.extend_from_slice(&[0x91, 0x07, 0xc0, 0x92, 0x01, 0x02, 0x02, 0xc0, 0xa3]);
    b.extend_from_slice(b"GPU");
    b.push(0xc0);
    b.push(0x93);
    b.push(0xac);
    b.extend_from_slice(b"BlockRemoved");
    b.extend_from_slice(&[0x91, 0x07, 0xa3]);
    b.extend_from_slice(b"GPU");
    b.push(0x91);
    b.push(0xb0);
    b.extend_from_slice(b"AllBlocksCleared");
    b.push(0x00);
    let d = decode_batch(&b).unwrap();
    assert_eq!(d.ts, 1.0);
    assert_eq!(d.data_parallel_rank, Some(0));
    assert_eq!(d.events.len(), 3);
    assert_eq!(
        stored(&d.events[0]),
        Stored {
            block_hashes: vec![7],
            parent: None,
            token_ids: vec![1, 2],
            block_size: Some(2),
            lora_name: None
        }
    );
    assert_eq!(d.events[1], Event::Removed(vec![7]));
    assert_eq!(d.events[2], Event::Cleared);
}

#[test]
fn array_and_map_forms_decode_alike() {
    let evs = vec![
        chain(None, 10, 2, 4, 100),
        chain(Some(11), 12, 1, 4, 200),
        Ev::Removed(vec![Hash::Int(12)]),
        Ev::Cleared,
    ];
    let a = batch(&evs, false);
    let m = batch(&evs, true);
    assert_ne!(a, m);
    let da = decode_batch(&a).unwrap();
    let dm = decode_batch(&m).unwrap();
    assert_eq!(da, dm);
    assert_eq!(da.events.len(), 4);
    let s = stored(&da.events[1]);
    assert_eq!(s.parent, Some(11));
    assert_eq!(s.block_hashes, vec![12]);
    assert_eq!(s.token_ids, vec![200, 201, 202, 203]);
    assert_eq!(s.block_size, Some(4));
}

#[test]
fn bytes_hashes_fold_with_xxh3() {
    let h1 = vec![0xab; 32];
    let h2 = vec![0xcd; 32];
    let evs = vec![
        Ev::Stored {
            hashes: vec![Hash::Bytes(h2.clone())],
            parent: Some(Hash::Bytes(h1.clone())),
            tokens: vec![1, 2],
            block_size: 2,
            lora_name: Some("adapter".into()),
        },
        Ev::Removed(vec![Hash::Bytes(h1.clone())]),
    ];
    for map in [false, true] {
        let p = batch(&evs, map);
        let d = decode_batch(&p).unwrap();
        match &d.events[0] {
            Event::Stored(s) => {
                assert_eq!(s.block_hashes, vec![engine_key_bytes(&h2)]);
                assert_eq!(s.parent, Some(engine_key_bytes(&h1)));
                assert_eq!(s.lora_name, Some("adapter"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(d.events[1], Event::Removed(vec![engine_key_bytes(&h1)]));
    }
    // Negative ints (Python hash()) map to their two's complement.
    let p = batch(&[Ev::Removed(vec![Hash::Int(-5)])], false);
    assert_eq!(
        decode_batch(&p).unwrap().events[0],
        Event::Removed(vec![(-5i64) as u64])
    );
}

#[test]
fn missing_trailing_fields() {
    let mut w = Writer::new();
    // [ts, events] without data_parallel_rank; BlockStored without lora_id/medium/lora_name;
    // BlockRemoved without medium.
    w.array(2).float(0.0).array(2);
    w.array(5)
        .str("BlockStored")
        .array(1)
        .uint(9)
        .nil()
        .array(2)
        .uint(5)
        .uint(6)
        .uint(2);
    w.array(2).str("BlockRemoved").array(1).uint(9);
    let d = decode_batch(&w.buf).unwrap();
    assert_eq!(d.data_parallel_rank, None);
    let s = stored(&d.events[0]);
    assert_eq!(s.block_hashes, vec![9]);
    assert_eq!(s.token_ids, vec![5, 6]);
    assert_eq!(s.block_size, Some(2));
    assert_eq!(d.events[1], Event::Removed(vec![9]));

    // Map form without block_size or parent.
    let mut w = Writer::new();
    w.map(1).str("events").array(1);
    w.map(3).str("type").str("BlockStored");
    w.str("block_hashes").array(1).uint(1);
    w.str("token_ids").array(1).uint(3);
    let d = decode_batch(&w.buf).unwrap();
    let s = stored(&d.events[0]);
    assert_eq!((s.parent, s.block_size), (None, None));
}

#[test]
fn extra_fields_and_unknown_tags() {
    let mut w = Writer::new();
    // Batch with an extra 4th element; BlockStored with newer vLLM's extra_keys, group_idx,
    // kv_cache_spec_kind, kv_cache_spec_sliding_window; an unknown event kind in both forms.
    w.array(4).float(2.0).array(4);
    w.array(12)
        .str("BlockStored")
        .array(1)
        .uint(1)
        .nil()
        .array(1)
        .uint(3)
        .uint(1);
    w.nil().str("GPU").nil();
    w.array(1).array(2).str("salt").uint(1); // extra_keys
    w.uint(0).str("full_attention").nil();
    w.array(3)
        .str("BlockMoved")
        .array(1)
        .uint(1)
        .map(1)
        .str("x")
        .array(0);
    w.map(2)
        .str("type")
        .str("Future")
        .str("payload")
        .bin(&[1, 2, 3]);
    w.map(4)
        .str("block_hashes")
        .array(1)
        .uint(1)
        .str("group_idx")
        .uint(0);
    w.str("type").str("BlockRemoved").str("medium").nil(); // tag not first
    w.uint(3).str("trailing");
    let d = decode_batch(&w.buf).unwrap();
    assert_eq!(d.unknown_events, 2);
    assert_eq!(d.events.len(), 2);
    assert_eq!(stored(&d.events[0]).token_ids, vec![3]);
    assert_eq!(d.events[1], Event::Removed(vec![1]));
    assert_eq!(d.data_parallel_rank, Some(3));
}

#[test]
fn malformed_batches_are_errors() {
    for bad in [
        &[][..],
        &[0xc1],
        &[0x91, 0xcb],                               // truncated float
        &[0x92, 0x00, 0x01],                         // events not a list
        &[0x81, 0xa2, b't', b's', 0x00],             // map without events
        &[0x92, 0x00, 0x91, 0x90],                   // empty event
        &[0x92, 0x00, 0x91, 0x91, 0x01],             // tag not a string
        &[0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff], // huge list header, no items
        &[
            0x92, 0x00, 0x91, 0x92, 0xac, b'B', b'l', b'o', b'c', b'k', b'R', b'e', b'm', b'o',
            b'v', b'e', b'd', 0xa1, b'x',
        ], // hashes not a list
    ] {
        assert!(decode_batch(bad).is_err(), "{bad:?}");
    }
}

/// Random bytes, every truncation and every single-byte corruption of valid payloads: the
/// decoder returns, never panics, and never loops.
#[test]
fn garbage_never_panics() {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for _ in 0..20_000 {
        let n = (rnd() % 64) as usize;
        let buf: Vec<u8> = (0..n).map(|_| rnd() as u8).collect();
        let _ = decode_batch(&buf);
    }
    let evs = vec![
        chain(None, 1, 3, 2, 0),
        Ev::Removed(vec![Hash::Bytes(vec![1; 8])]),
        Ev::Cleared,
    ];
    for map in [false, true] {
        let good = batch(&evs, map);
        assert!(decode_batch(&good).is_ok());
        for cut in 0..good.len() {
            assert!(
                decode_batch(&good[..cut]).is_err(),
                "truncated at {cut} decoded"
            );
        }
        for i in 0..good.len() {
            for v in [0x00, 0xc1, 0xdd, 0xdf, 0xff, 0x9f, 0xc6] {
                let mut b = good.clone();
                b[i] = v;
                let _ = decode_batch(&b);
            }
        }
    }
    // Deep nesting stays bounded.
    let deep = [
        vec![0x93, 0x00, 0x91, 0x92, 0xa1, b'X'],
        vec![0x91; 100_000],
    ]
    .concat();
    assert!(decode_batch(&deep).is_err());
}
