//! Payloads encoded by msgspec itself (the encoder vLLM uses), in every generation of vLLM's
//! event classes: the mock worker's golden fixtures (examples/mock-worker/tests/fixtures,
//! written by gen_kv_events.py there) and the newest form (batch and events as maps, bytes
//! hashes, extra_keys, group_idx), encoded with msgspec 0.19+ from the class definitions in
//! vllm/distributed/kv_events.py at 0181ea31.

use kvroute_relay::decode::{decode_batch, engine_key_bytes, Event};
use std::path::Path;

fn unhex(s: &str) -> Vec<u8> {
    let s = s.trim();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn mock_worker_fixtures_decode() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/mock-worker/tests/fixtures");
    let tokens: [u32; 12] = [0, 1, 127, 128, 255, 256, 65535, 65536, 4294967295, 7, 8, 9];
    let mut n = 0;
    for name in ["array", "map", "array_group", "v0_9"] {
        let path = dir.join(format!("kv_events_{name}.hex"));
        let Ok(hex) = std::fs::read_to_string(&path) else {
            eprintln!("skipping {}: not present", path.display());
            continue;
        };
        n += 1;
        let bytes = unhex(&hex);
        let b = decode_batch(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(b.ts, 1_700_000_000.125, "{name}");
        assert_eq!(b.unknown_events, 0);
        assert_eq!(b.events.len(), 4, "{name}");
        assert_eq!(b.events[0], Event::Cleared);
        let Event::Stored(s) = &b.events[1] else {
            panic!("{name}: {:?}", b.events[1])
        };
        assert_eq!(s.block_hashes, vec![0xFEDC_BA98_7654_3210, 42]);
        assert_eq!((s.parent, s.block_size), (None, Some(4)));
        assert_eq!(s.token_ids, tokens[..8]);
        let Event::Stored(s) = &b.events[2] else {
            panic!("{name}: {:?}", b.events[2])
        };
        assert_eq!((s.block_hashes.clone(), s.parent), (vec![300], Some(42)));
        assert_eq!(s.token_ids, tokens[8..]);
        assert_eq!(b.events[3], Event::Removed(vec![0xFEDC_BA98_7654_3210]));
    }
    eprintln!("{n} fixtures decoded");
}

#[test]
fn newest_map_form_with_bytes_hashes() {
    let hex = "83a27473cb41d954fc40080000a66576656e74739381a474797065b0416c6c426c6f636b73436c65617265648ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392c4200101010101010101010101010101010101010101010101010101010101010101c4200202020202020202020202020202020202020202020202020202020202020202b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65a873716c2d6c6f7261aa65787472615f6b65797392c091a473616c74a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391c4200101010101010101010101010101010101010101010101010101010101010101a66d656469756da3475055a967726f75705f69647800b2646174615f706172616c6c656c5f72616e6b00";
    let bytes = unhex(hex);
    let b = decode_batch(&bytes).unwrap();
    assert_eq!(b.ts, 1_700_000_000.125);
    assert_eq!(b.data_parallel_rank, Some(0));
    assert_eq!(b.events.len(), 3);
    assert_eq!(b.events[0], Event::Cleared);
    let h1 = engine_key_bytes(&[1; 32]);
    let h2 = engine_key_bytes(&[2; 32]);
    let Event::Stored(s) = &b.events[1] else {
        panic!("{:?}", b.events[1])
    };
    assert_eq!(s.block_hashes, vec![h1, h2]);
    assert_eq!(s.parent, None);
    assert_eq!(s.token_ids, vec![1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(s.block_size, Some(4));
    assert_eq!(s.lora_name, Some("sql-lora"));
    assert_eq!(b.events[2], Event::Removed(vec![h1]));
}
