//! Deterministic prompt text.
//!
//! Every word is one to six lowercase letters with a leading space, so the mock worker's
//! tokenizer (and GPT-style BPE) counts exactly one token per word; lengths are uniform over
//! 1..=6 letters, i.e. 4.5 characters per token on average, like English prose. A stream of
//! words is a pure function of its seed, so `words(seed, n)` is always a prefix of
//! `words(seed, n + k)`: a truncated block shares exactly its leading tokens with the full one.

/// SplitMix64 step: small, fast, good enough to make text and random choices.
pub fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Mixes several numbers into one seed.
pub fn seed_of(parts: &[u64]) -> u64 {
    let mut s = 0x006b_7672_6f75_7465_u64;
    for &p in parts {
        s ^= p.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        splitmix(&mut s);
        s = splitmix(&mut s);
    }
    s
}

/// Appends `n` one-token words generated from `seed` to `out`.
pub fn push_words(out: &mut String, seed: u64, n: usize) {
    let mut st = seed;
    let mut i = 0;
    while i < n {
        // One 64-bit draw gives the length (1..=6) and up to 6 letters (5 bits each, mod 26).
        let r = splitmix(&mut st);
        let len = 1 + (r % 6) as usize;
        out.push(' ');
        let mut bits = r >> 3;
        for _ in 0..len {
            out.push((b'a' + (bits % 26) as u8) as char);
            bits /= 26;
        }
        i += 1;
    }
}

/// Uniform random number in [0, 1).
pub fn unit(st: &mut u64) -> f64 {
    (splitmix(st) >> 11) as f64 / (1u64 << 53) as f64
}

/// Inverse-CDF sampler for Zipf popularity over `n` items: weight of rank k is 1/(k+1)^s.
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    pub fn new(n: usize, s: f64) -> Self {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (0..n.max(1))
            .map(|k| {
                acc += 1.0 / ((k + 1) as f64).powf(s);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }

    pub fn sample(&self, st: &mut u64) -> usize {
        let u = unit(st);
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_property_and_word_shape() {
        let mut a = String::new();
        let mut b = String::new();
        push_words(&mut a, 7, 100);
        push_words(&mut b, 7, 60);
        assert!(a.starts_with(&b));
        let words: Vec<&str> = a.split(' ').skip(1).collect();
        assert_eq!(words.len(), 100);
        assert!(words.iter().all(|w| (1..=6).contains(&w.len())));
        let chars_per_token = a.len() as f64 / 100.0;
        assert!((3.8..5.2).contains(&chars_per_token), "{chars_per_token}");
        let mut c = String::new();
        push_words(&mut c, 8, 100);
        assert_ne!(a, c);
    }

    #[test]
    fn zipf_prefers_low_ranks() {
        let z = Zipf::new(10, 1.2);
        let mut st = 1;
        let mut n = [0usize; 10];
        for _ in 0..10_000 {
            n[z.sample(&mut st)] += 1;
        }
        assert!(n[0] > n[1] && n[1] > n[5] && n[9] > 0);
    }
}
