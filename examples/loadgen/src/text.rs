//! Deterministic prompt text that tokenizes like real text.
//!
//! A block of text is a pure function of its seed and is built from segments in one of three
//! genres, mixed the way LLM traffic mixes them (chat and documents, code, tool output):
//! English-like prose (Zipf-distributed common words, rarer derived words, names, numbers,
//! punctuation), Python-like code (indentation, identifiers, calls, literals) and tool output
//! (JSON records, log lines with timestamps and ids). Token counts come from the mock
//! worker's BPE-like tokenizer, so a block of `n` tokens is exactly `n` tokens for the mock
//! and close to what a Llama-3 or GPT-4 tokenizer would count: about 4.2 chars per token on
//! the prose, 3.8 on the code, 2.5 on the tool output, 3.9 on the mix (tests pin ranges).
//!
//! Every segment starts with whitespace and ends with a non-space char, so tokenizing a
//! concatenation gives the sum of the parts: a prompt made of blocks has exactly the blocks'
//! tokens, and requests that share blocks share exactly those tokens.

use mock_worker::tokenizer;

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

/// Stems and endings of the rarer words of prose: most combinations are real-looking words
/// that BPE vocabularies hold as one token or split in two or three.
const STEMS: &[&str] = &[
    "abstract",
    "accommod",
    "activ",
    "adapt",
    "align",
    "annot",
    "architect",
    "assess",
    "atom",
    "balanc",
    "calibr",
    "cardi",
    "categor",
    "civil",
    "clust",
    "cognit",
    "collabor",
    "compil",
    "compress",
    "configur",
    "consist",
    "construct",
    "contamin",
    "coordin",
    "correl",
    "crystal",
    "defin",
    "degrad",
    "depend",
    "deriv",
    "detect",
    "determin",
    "digit",
    "distribut",
    "document",
    "domin",
    "econom",
    "electr",
    "emerg",
    "enabl",
    "encod",
    "equilibr",
    "estim",
    "evalu",
    "evolut",
    "experiment",
    "explor",
    "fragment",
    "function",
    "generat",
    "geometr",
    "harmon",
    "hydr",
    "identif",
    "illustr",
    "implement",
    "indic",
    "industr",
    "infer",
    "initial",
    "integr",
    "interpret",
    "invest",
    "isol",
    "magnet",
    "manipul",
    "measur",
    "mechan",
    "migr",
    "minim",
    "moder",
    "modul",
    "molecul",
    "navig",
    "neur",
    "normal",
    "observ",
    "optim",
    "organ",
    "orient",
    "partit",
    "perform",
    "photograph",
    "polit",
    "popul",
    "predict",
    "preserv",
    "prior",
    "probabil",
    "regul",
    "replic",
    "represent",
    "resist",
    "resolut",
    "schedul",
    "sediment",
    "segment",
    "sensit",
    "serial",
    "simul",
    "spectr",
    "stabil",
    "statist",
    "structur",
    "symmetr",
    "synchron",
    "synthes",
    "territor",
    "therm",
    "transform",
    "transit",
    "util",
    "valid",
    "vari",
    "veget",
    "visual",
];
const ENDINGS: &[&str] = &[
    "ation", "ations", "ity", "ive", "ively", "al", "ally", "ing", "ed", "es", "er", "ers", "ism",
    "ist", "ize", "ized", "ization", "ous", "ment", "ments", "ic", "ical", "able", "e",
];
const NAME_PARTS: &[&str] = &[
    "al", "ber", "cal", "dan", "el", "fen", "gar", "hol", "is", "jor", "kess", "lin", "mar", "nor",
    "ost", "pel", "quin", "ros", "sten", "tor", "ul", "vin", "wal", "yar", "zel", "ton", "by",
    "ley", "sen", "ford", "ia", "o", "ard", "wick",
];
/// Identifier words of code and tool output.
const IDENTS: &[&str] = &[
    "data", "user", "config", "value", "result", "item", "items", "key", "name", "path", "file",
    "request", "response", "client", "server", "status", "error", "count", "index", "size",
    "cache", "token", "tokens", "model", "batch", "query", "row", "rows", "node", "state", "task",
    "job", "queue", "worker", "timeout", "retry", "score", "weight", "offset", "limit", "page",
    "buffer", "stream", "reader", "output", "input", "source", "target", "event", "handler",
    "message", "session", "prefix", "block", "chunk", "hash", "metric", "entry", "record",
    "schema", "field", "table", "url", "host", "port", "id", "ts", "tmp", "ctx", "cfg", "args",
    "opts", "params", "meta", "info", "total", "max", "min", "avg",
];
const VERBS: &[&str] = &[
    "get", "set", "load", "save", "read", "write", "parse", "build", "update", "create", "delete",
    "fetch", "send", "handle", "check", "validate", "compute", "merge", "split", "encode",
    "decode", "flush", "reset", "init", "run", "apply", "resolve", "format",
];
const LEVELS: &[&str] = &["INFO", "INFO", "INFO", "DEBUG", "WARN", "ERROR"];
const STATUSES: &[&str] = &["ok", "ok", "ok", "pending", "failed", "skipped", "running"];
const EXTS: &[&str] = &["json", "py", "rs", "txt", "csv", "log", "yaml", "md"];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Genre {
    Prose,
    Code,
    Tool,
}

impl Genre {
    /// Genre of a block: 60 % prose, 25 % code, 15 % tool output.
    fn pick(st: &mut u64) -> Genre {
        match splitmix(st) % 20 {
            0..=11 => Genre::Prose,
            12..=16 => Genre::Code,
            _ => Genre::Tool,
        }
    }
}

struct Gen {
    st: u64,
    words: &'static [&'static str],
    zipf: &'static Zipf,
    indent: usize,
}

fn common_words() -> &'static (Vec<&'static str>, Zipf) {
    static W: std::sync::OnceLock<(Vec<&'static str>, Zipf)> = std::sync::OnceLock::new();
    W.get_or_init(|| {
        let mut seen = std::collections::HashSet::new();
        let words: Vec<&str> = tokenizer::ENGLISH_WORDS
            .split_ascii_whitespace()
            .filter(|w| seen.insert(*w))
            .collect();
        let z = Zipf::new(words.len(), 0.8);
        (words, z)
    })
}

impl Gen {
    fn new(seed: u64) -> Self {
        let (words, zipf) = common_words();
        Gen {
            st: seed,
            words,
            zipf,
            indent: 0,
        }
    }

    fn below(&mut self, n: usize) -> usize {
        (splitmix(&mut self.st) % n as u64) as usize
    }

    fn chance(&mut self, p: f64) -> bool {
        unit(&mut self.st) < p
    }

    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[self.below(xs.len())]
    }

    fn ident(&mut self, out: &mut String) {
        let parts = 1 + self.below(3);
        for i in 0..parts {
            if i > 0 {
                out.push('_');
            }
            let w = self.pick(IDENTS);
            out.push_str(w);
        }
    }

    /// `verb_ident(ident`: the start of a definition or a call.
    fn call_open(&mut self, out: &mut String) {
        let v = self.pick(VERBS);
        out.push_str(v);
        out.push('_');
        self.ident(out);
        out.push('(');
        self.ident(out);
    }

    fn number(&mut self, out: &mut String) {
        use std::fmt::Write;
        let _ = match self.below(6) {
            0 => write!(out, "{}", 1950 + self.below(76)),
            1 => write!(out, "{}.{}", self.below(100), self.below(100)),
            2 => write!(out, "{}%", 1 + self.below(99)),
            3 => write!(out, "{}", self.below(100_000)),
            _ => write!(out, "{}", self.below(60)),
        };
    }

    fn prose_word(&mut self, out: &mut String, capital: bool) {
        let start = out.len();
        let r = unit(&mut self.st);
        if r < 0.9 {
            let w = self.words[self.zipf.sample(&mut self.st)];
            out.push_str(w);
        } else if r < 0.96 {
            let stem = self.pick(STEMS);
            let end = self.pick(ENDINGS);
            out.push_str(stem);
            out.push_str(end);
        } else if r < 0.985 {
            let n = 2 + self.below(2);
            for _ in 0..n {
                let p = self.pick(NAME_PARTS);
                out.push_str(p);
            }
            capitalize(out, start);
            return;
        } else {
            self.number(out);
            return;
        }
        if capital {
            capitalize(out, start);
        }
    }

    /// One sentence, now and then opening a paragraph.
    fn prose(&mut self, out: &mut String) {
        out.push_str(if self.chance(0.15) { "\n\n" } else { " " });
        let n = 6 + self.below(22);
        for i in 0..n {
            if i > 0 {
                out.push(' ');
            }
            self.prose_word(out, i == 0);
            if i + 1 < n && self.chance(0.07) {
                out.push(',');
            }
        }
        let end = match self.below(40) {
            0..=1 => "?",
            2 => ":",
            3 => "!",
            _ => ".",
        };
        out.push_str(end);
    }

    /// One line of Python-like code.
    fn code(&mut self, out: &mut String) {
        out.push('\n');
        for _ in 0..self.indent * 4 {
            out.push(' ');
        }
        match self.below(17) {
            0 => {
                out.push_str("def ");
                self.call_open(out);
                out.push_str(", ");
                self.ident(out);
                out.push_str("=None):");
                self.indent = (self.indent + 1).min(3);
            }
            1 => {
                out.push_str("if ");
                self.ident(out);
                out.push_str(if self.chance(0.5) {
                    " is None:"
                } else {
                    " > 0:"
                });
                self.indent = (self.indent + 1).min(3);
            }
            2 => {
                out.push_str("for ");
                self.ident(out);
                out.push_str(" in ");
                self.ident(out);
                out.push(':');
                self.indent = (self.indent + 1).min(3);
            }
            3 => {
                out.push_str("return ");
                self.ident(out);
                self.indent = self.indent.saturating_sub(1);
            }
            4 => {
                out.push_str("# ");
                let n = 3 + self.below(8);
                for i in 0..n {
                    if i > 0 {
                        out.push(' ');
                    }
                    self.prose_word(out, false);
                }
            }
            5 => {
                out.push_str("self.");
                self.ident(out);
                out.push_str(" = ");
                self.ident(out);
            }
            6 => {
                out.push_str("raise ValueError(f\"");
                self.prose_word(out, true);
                out.push(' ');
                self.prose_word(out, false);
                out.push_str(" {");
                self.ident(out);
                out.push_str("!r}\")");
            }
            8 => {
                self.ident(out);
                out.push_str(" = [x[i] for i in range(len(");
                self.ident(out);
                out.push_str(")) if x[i] is not None]");
            }
            9 => {
                out.push_str("logger.info(\"%s: %d ");
                self.prose_word(out, false);
                out.push_str("\", ");
                self.ident(out);
                out.push_str(", len(");
                self.ident(out);
                out.push_str("))");
            }
            10 => {
                self.ident(out);
                out.push_str(": Optional[Dict[str, List[int]]] = {}");
            }
            7 => {
                self.ident(out);
                out.push_str("[\"");
                self.ident(out);
                out.push_str("\"] = ");
                self.number(out);
            }
            _ => {
                self.ident(out);
                out.push_str(" = ");
                if self.chance(0.5) {
                    out.push_str("self.");
                }
                self.call_open(out);
                if self.chance(0.5) {
                    out.push_str(", ");
                    self.ident(out);
                    out.push('=');
                    self.number(out);
                }
                out.push(')');
            }
        }
    }

    /// One record of tool output: a JSON object or a log line.
    fn tool(&mut self, out: &mut String) {
        use std::fmt::Write;
        let (y, mo, d) = (2020 + self.below(6), 1 + self.below(12), 1 + self.below(28));
        let (h, mi, s) = (self.below(24), self.below(60), self.below(60));
        if self.chance(0.5) {
            let _ = write!(out, "\n{{\"id\": {}, \"name\": \"", self.below(1_000_000));
            self.ident(out);
            let st = self.pick(STATUSES);
            let _ = write!(out, "\", \"status\": \"{st}\", \"path\": \"/srv/");
            self.ident(out);
            out.push('/');
            self.ident(out);
            let ext = self.pick(EXTS);
            let _ = write!(
                out,
                "_{}.{ext}\", \"size\": {}, \"updated\": \"{y}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z\"",
                self.below(100),
                self.below(10_000_000)
            );
            if self.chance(0.5) {
                let _ = write!(out, ", \"sha\": \"{:012x}\"", splitmix(&mut self.st) >> 16);
            }
            out.push('}');
        } else {
            let lvl = self.pick(LEVELS);
            let _ = write!(
                out,
                "\n{y}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02},{:03} {lvl} ",
                self.below(1000)
            );
            self.ident(out);
            out.push('.');
            self.ident(out);
            out.push_str(": ");
            let v = self.pick(VERBS);
            out.push_str(v);
            out.push(' ');
            self.number(out);
            out.push(' ');
            self.ident(out);
            let _ = write!(out, " in {}.{:02}s", self.below(10), self.below(100));
        }
    }

    fn segment(&mut self, genre: Genre, out: &mut String) {
        match genre {
            Genre::Prose => self.prose(out),
            Genre::Code => self.code(out),
            Genre::Tool => self.tool(out),
        }
    }
}

fn capitalize(out: &mut String, at: usize) {
    if let Some(c) = out[at..].chars().next() {
        if c.is_ascii_lowercase() {
            out.replace_range(at..at + 1, &c.to_ascii_uppercase().to_string());
        }
    }
}

/// Appends exactly `n` tokens (for the mock worker's tokenizer) of text generated from
/// `seed` to `out`. The text is a stream of whole segments; when the next segment does not
/// fit, as much of it as ends on a word boundary is kept and the rest is filled with
/// one-token words, so a shorter block is its longer self up to its last few tokens.
pub fn push_words(out: &mut String, seed: u64, n: usize) {
    let mut g = Gen::new(seed);
    let genre = Genre::pick(&mut g.st);
    let mut left = n;
    let mut seg = String::with_capacity(256);
    while left > 0 {
        seg.clear();
        g.segment(genre, &mut seg);
        let t = tokenizer::count(&seg);
        if t <= left {
            out.push_str(&seg);
            left -= t;
            continue;
        }
        // Keep the longest prefix that ends before a space-led piece and on a non-space char.
        let (mut used, mut keep, mut k) = (0, 0, 0);
        let mut pos = 0;
        let mut prev_ok = false;
        tokenizer::split(&seg, |p| {
            if k <= left && prev_ok && p.starts_with([' ', '\n']) {
                keep = pos;
                used = k;
            }
            pos += p.len();
            k += 1;
            prev_ok = !p.ends_with(|c: char| c.is_ascii_whitespace());
        });
        out.push_str(&seg[..keep]);
        for i in 0..left - used {
            out.push_str(if i % 2 == 0 { " and" } else { " the" });
        }
        left = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(seed: u64, n: usize) -> String {
        let mut s = String::new();
        push_words(&mut s, seed, n);
        s
    }

    fn genre_of(seed: u64) -> Genre {
        let mut g = Gen::new(seed);
        Genre::pick(&mut g.st)
    }

    #[test]
    fn blocks_have_exactly_n_tokens_and_concatenate_exactly() {
        let mut all = String::new();
        let mut total = 0;
        for seed in 0..60u64 {
            let n = [1, 7, 16, 100, 512][seed as usize % 5];
            let b = block(seed, n);
            assert_eq!(tokenizer::count(&b), n, "seed {seed}: {b:?}");
            assert!(b.starts_with([' ', '\n']), "{b:?}");
            all.push_str(&b);
            total += n;
        }
        // Tokenizing the concatenation gives the sum: blocks share exact token prefixes.
        assert_eq!(tokenizer::count(&all), total);
    }

    #[test]
    fn deterministic_and_shorter_blocks_are_nearly_prefixes() {
        let a = block(7, 512);
        assert_eq!(a, block(7, 512));
        assert_ne!(a, block(8, 512));
        for m in [50, 200, 400] {
            let c = block(7, m);
            let (ta, tc) = (tokenizer::encode(&a), tokenizer::encode(&c));
            let shared = ta.iter().zip(&tc).take_while(|(x, y)| x == y).count();
            // Only the tail of the last, cut segment may differ (fillers).
            assert!(shared + 40 >= m, "{m}: shares {shared}");
        }
    }

    fn ratio_of(genre: Genre) -> f64 {
        let (mut chars, mut tokens) = (0, 0);
        for seed in (0..2000u64).filter(|&s| genre_of(s) == genre).take(20) {
            let b = block(seed, 512);
            chars += b.chars().count();
            tokens += 512;
        }
        chars as f64 / tokens as f64
    }

    #[test]
    fn chars_per_token_are_those_of_real_text() {
        // cl100k (GPT-4) counts about 4.0-4.4 chars per token on English prose and 3.3 on
        // source code, o200k and Llama-3 a little more; JSON and logs full of ids,
        // timestamps and hashes come out at 2-3.
        let prose = ratio_of(Genre::Prose);
        let code = ratio_of(Genre::Code);
        let tool = ratio_of(Genre::Tool);
        eprintln!("chars per token: prose {prose:.2}, code {code:.2}, tool {tool:.2}");
        assert!((4.0..=4.7).contains(&prose), "prose {prose:.2}");
        assert!((3.0..=4.0).contains(&code), "code {code:.2}");
        assert!((2.0..=3.0).contains(&tool), "tool {tool:.2}");
        let mut mix = String::new();
        for seed in 0..200 {
            push_words(&mut mix, seed, 512);
        }
        let r = mix.chars().count() as f64 / (200.0 * 512.0);
        eprintln!("mix {r:.2}");
        assert!((3.4..=4.2).contains(&r), "mix {r:.2}");
    }

    #[test]
    fn prose_reads_like_prose() {
        let seed = (0..100).find(|&s| genre_of(s) == Genre::Prose).unwrap();
        let b = block(seed, 300);
        let words: Vec<&str> = b.split_whitespace().collect();
        // Function words dominate, as in English.
        let the = words.iter().filter(|w| **w == "the").count();
        assert!(
            the * 40 > words.len(),
            "{the} 'the' in {} words",
            words.len()
        );
        assert!(b.contains(". ") || b.contains(".\n"));
    }

    #[test]
    fn speed() {
        let t = std::time::Instant::now();
        let mut s = String::new();
        for seed in 0..40 {
            push_words(&mut s, seed, 512);
        }
        let ns = t.elapsed().as_nanos() as f64 / (40.0 * 512.0);
        eprintln!("generator: {ns:.0} ns per token");
        assert!(ns < 50_000.0);
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
