//! The block table against a map: probes, spill counts, wrap-around and growth.

use super::*;
use crate::ids::mix;
use proptest::prelude::*;
use std::collections::HashMap;

/// Spill counts recomputed from where every key sits, and every key found again.
fn check(t: &SlotTable, keys: &HashMap<u32, u64>) {
    let n = t.lines.len();
    let mut spill = vec![0u32; n];
    let mut len = 0;
    for (at, line) in t.lines.iter().enumerate() {
        for j in line.full() {
            let v = line.vals[j];
            let m = keys[&v];
            let mut i = t.home(m);
            while i != at {
                spill[i] += 1;
                i = t.next(i);
            }
            len += 1;
        }
    }
    assert_eq!(len, t.len());
    assert_eq!(len, keys.len());
    for (i, line) in t.lines.iter().enumerate() {
        assert_eq!(line.spill(), spill[i], "spill of line {i}");
    }
    for (&v, &m) in keys {
        assert_eq!(t.find(m, |x| x == v), Some(v));
    }
}

#[derive(Debug, Clone)]
enum Op {
    Add(u64),
    Remove(usize),
    Reserve(usize),
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    /// Against a map, with few distinct home lines and tags (long probes, wrap-around at
    /// the last line, tag collisions) and growth from empty.
    #[test]
    fn slot_table_matches_a_map(
        ops in prop::collection::vec(prop_oneof![
            8 => (0u64..64).prop_map(Op::Add),
            5 => (0usize..1000).prop_map(Op::Remove),
            1 => (0usize..200).prop_map(Op::Reserve),
        ], 1..300),
        skew in proptest::arbitrary::any::<bool>(),
    ) {
        let mut t = SlotTable::new();
        let mut keys: HashMap<u32, u64> = HashMap::new();
        let mut next = 0u32;
        for op in ops {
            match op {
                Op::Add(k) => {
                    // Skewed: keys share a few top bits (home lines) and tags.
                    let m = if skew { (k % 3) << 62 | (k % 5) << 8 | k } else { mix(k + 1) };
                    let present = keys.iter().find(|&(_, &x)| x == m).map(|(&v, _)| v);
                    let r = {
                        let keys = &keys;
                        t.find_or_insert(m, next, |v| keys.get(&v) == Some(&m), |v| keys[&v])
                    };
                    match (r, present) {
                        (Probe::Found(v), Some(p)) => prop_assert_eq!(v, p),
                        (Probe::Added, None) => {
                            keys.insert(next, m);
                            next += 1;
                        }
                        _ => prop_assert!(false, "find_or_insert disagrees with the map"),
                    }
                }
                Op::Remove(i) => {
                    let Some((&v, &m)) = keys.iter().nth(i % keys.len().max(1)) else { continue };
                    prop_assert!(!t.remove(m, v + 1_000_000));
                    prop_assert!(t.remove(m, v));
                    keys.remove(&v);
                    prop_assert!(!t.remove(m, v));
                }
                Op::Reserve(n) => {
                    let keys = &keys;
                    t.reserve(n, |v| keys[&v]);
                    prop_assert!(t.lines.len() * LINE_SLOTS * 3 / 4 >= n);
                }
            }
            check(&t, &keys);
        }
    }
}

#[test]
fn full_lines_wrap_around_and_removal_unwinds_spill() {
    let mut t = SlotTable::new();
    let keys: HashMap<u32, u64> = HashMap::new();
    t.reserve(40, |_| 0);
    let mut keys = keys;
    // Every key homes at the last line: they fill it and wrap to line 0, 1, ...
    let m0 = u64::MAX;
    for v in 0..30u32 {
        let m = m0 - u64::from(v) * 256;
        assert!(t.insert(m, v, |x| keys[&x]));
        keys.insert(v, m);
    }
    let last = t.lines.len() - 1;
    assert_eq!(t.home(m0), last);
    assert!(t.lines[last].spill() > 0);
    check(&t, &keys);
    for v in 0..30u32 {
        assert!(t.remove(keys[&v], v));
        keys.remove(&v);
        check(&t, &keys);
    }
    assert!(t
        .lines
        .iter()
        .all(|l| l.spill() == 0 && l.full().next().is_none()));
}
