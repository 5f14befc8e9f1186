//! A deterministic stand-in for a byte-level BPE tokenizer (Llama-3 / GPT-4 style).
//!
//! It is deliberately *not* the router's estimator: the router has to learn the engine's
//! token counts from `usage`, exactly as it would against a real vLLM. What it imitates is how
//! many tokens text costs, so that characters per token come out where real tokenizers put
//! them (about 4-4.5 on English prose, about 3 on code, 2-3 on JSON and logs, 2 on random
//! letters). The rules follow the pre-tokenization of those vocabularies, then stand in for
//! the merges with a small vocabulary:
//!
//! - a letter run takes one leading space (or one punctuation char, as in `.get` or `_name`);
//!   a word of [`ENGLISH_WORDS`] or [`CODE_WORDS`] (in lower, Capitalized or UPPER case) is one token; camelCase
//!   runs split at case changes; any other word splits greedily into the longest known
//!   pieces (common words and [`SUBWORDS`], at most [`MAX_PIECE`] letters), two letters at a
//!   time where nothing is known;
//! - digits go in groups of at most three, from the left;
//! - punctuation in runs of at most three chars, with an optional leading space;
//! - a whitespace run ending in newlines is one token; spaces before a word or punctuation
//!   give their last space to it, the rest are one token;
//! - English contractions (`'s`, `'t`, `'re`, ...) are one token, `<|name|>` markers are one
//!   special token, every other non-ASCII char is one token.
//!
//! Costs are a few table lookups per token (see the `speed` test).

use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::OnceLock;

use xxhash_rust::xxh3::xxh3_64_with_seed;

const TOKEN_SEED: u64 = 0x006b_7672_6f75_7465;

/// English words that are one token each, roughly most frequent first (the load generator
/// draws prose from this list with Zipf weights by rank). Real vocabularies hold tens of
/// thousands of such words; this list and [`CODE_WORDS`] cover common ones, other words are
/// one token or several by the rule in `Vocab::single_token`.
pub const ENGLISH_WORDS: &str = "\
the of and to a in is that for it was on with as he be by at this are from his or an \
have not but they which you one were had all we there their been has can if more when will \
would who so no she out up about what them into said than its only other some could time \
these two may then do first any like my now over such our man me even most made after also \
did many before must through back years where much your way well down should because each \
just those people how too little state good very make world still own see men work long \
get here between both life being under never day same another know while last might us \
great old year off come since against go came right used take three himself few house use \
during without again place american around however home small found thought went say part \
once general high upon school every does got united left number course war until always \
away something fact though water less public put think almost hand enough far took head yet \
government system better set told nothing night end why called didn find going look asked \
later knew point next program city business give group toward young days let room president \
side social given present several order national possible rather second face per among form \
important often things looked early white case john become large big need four within felt \
along children saw best church ever least power development light thing seemed family \
interest want members mind country area others done turned although open god service \
certain kind problem began different door thus help sense means whole matter perhaps \
itself york times law human line above name example action company hands local show whether \
five history gave today either act feet across taken past quite anything having seen death \
experience body word half really week free field car words already information tell \
together college shall money period held keep sure probably real behind seems father \
question change answer question questions document documents summary section chapter paper study \
research analysis results method methods approach problem problems solution solutions \
report reports team customer customers product products market price cost sales plan \
policy support issue issues review note notes meeting project projects account email \
address phone date today tomorrow morning evening week month months year years hour \
hours minute minutes second seconds please thanks thank hello sorry yes okay sure \
understand explain describe write provide following based using include including \
however therefore although because while whether without within between across \
about above below before after during under over into onto upon toward towards \
";

/// Words of code and tool output that are one token each.
pub const CODE_WORDS: &str = "\
data model value user file error result item request response client \
server status type key list text message code test function return true false null none \
self class import from def print string int float bool dict len str range new public \
private static void const let var async await struct impl pub fn mut use crate match enum \
config path load save read write open close start stop run check parse format log info \
debug warn token cache index count size total build update create delete insert select \
query table row column field input output source target local remote version default \
option options param params args kwargs node tree graph map filter sort find search query \
event handler callback error errors exception raise try catch throw finally else elif \
while break continue yield lambda object array number integer boolean double char byte \
bytes buffer stream reader writer file files line lines path paths dir directory name \
names label labels level levels limit offset page pages step steps state states task tasks \
job jobs queue worker workers thread threads process time timeout retry retries delay \
rate score weight weights layer layers batch epoch train training loss learning network \
";

/// Word pieces that real vocabularies hold as tokens of their own: prefixes, suffixes and
/// frequent syllables. Together with the common words they are what unknown words split into.
pub const SUBWORDS: &str = "\
ing ings ed er ers est ly ability stand tion tions sion sions ment ments ness able ible ity ities ous \
ive ives al als ial ic ics ical ate ates ated ating ation ations ize izes ized izing ise \
ist ists ism ure ures ence ences ance ances ent ents ant ants ful less ship hood ward \
wards like ory ary ery ify ified ogy ology graph phy ism un re pre pro con com dis mis \
non sub super inter trans over under out anti auto semi multi micro macro mega meta \
poly mono bio geo photo tele hyper ex en em in im ir il de be se ab ad ac ap at ar as \
str \
ion ions ian ians ier iers ies ied ier ial age ages ane ene ine one ide ode ude \
ade ake ale ame ane ape are ase ave ice ike ile ime ite ive ise ose ote ove ure use \
ack ick ock uck ash ish ush all ell ill oll ull and end ind ond und ank ink onk unk \
ang ing ong ung ant ent int ont unt art ert irt ort urt ast est ist ost ust \
man men son ton ton ber ter der ner per ver ger ker ler mer ser cer ser \
lab led lin lay los lot lic lim lit mat mod mon mor mas nat net nom nos \
par pat pen pol pos pot rad ran ref reg rel rep res ret rev rot sal sat sec \
sel sen ser sim sol son spe sta ste sto sup syn tab tal tar tec tem ten ter \
tor tra tri val var ven ver vis vol ";

/// Longest piece an unknown word splits into, in letters.
const MAX_PIECE: usize = 8;
/// Longest whitespace token in bytes.
const MAX_SPACE_RUN: usize = 16;
/// Longest punctuation token in chars (a leading space is extra).
const MAX_PUNCT_RUN: usize = 3;

/// Id of one piece of text. Ids are hashes so that the vocabulary is unbounded yet stable
/// across processes and runs.
pub fn piece_id(piece: &str) -> u32 {
    let h = xxh3_64_with_seed(piece.as_bytes(), TOKEN_SEED);
    (h ^ (h >> 32)) as u32
}

/// Hashes the packed letter keys below with one multiply; keys are already well spread.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u128(&mut self, k: u128) {
        let x = (k as u64) ^ ((k >> 64) as u64).rotate_left(29);
        self.0 = (x ^ (x >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type KeySet = HashSet<u128, BuildHasherDefault<KeyHasher>>;

/// Case-folded ASCII letters packed 5 bits each; `None` for longer than 25 letters.
fn key(letters: &[u8]) -> Option<u128> {
    if letters.len() > 25 {
        return None;
    }
    let mut k = 0u128;
    for &b in letters {
        k = (k << 5) | u128::from((b | 0x20) - b'a' + 1);
    }
    Some(k)
}

struct Vocab {
    words: KeySet,
    pieces: KeySet,
    /// Letter pairs seen inside the words above: text made only of these reads as English.
    bigrams: [bool; 26 * 26],
}

fn common_words() -> impl Iterator<Item = &'static str> {
    ENGLISH_WORDS
        .split_ascii_whitespace()
        .chain(CODE_WORDS.split_ascii_whitespace())
}

fn vocab() -> &'static Vocab {
    static V: OnceLock<Vocab> = OnceLock::new();
    V.get_or_init(|| {
        let words: KeySet = common_words().filter_map(|w| key(w.as_bytes())).collect();
        let pieces: KeySet = common_words()
            .chain(SUBWORDS.split_ascii_whitespace())
            .filter(|w| w.len() <= MAX_PIECE)
            .filter_map(|w| key(w.as_bytes()))
            .collect();
        let mut bigrams = [false; 26 * 26];
        for w in common_words().chain(SUBWORDS.split_ascii_whitespace()) {
            for p in w.as_bytes().windows(2) {
                bigrams[pair(p[0], p[1])] = true;
            }
        }
        Vocab {
            words,
            pieces,
            bigrams,
        }
    })
}

fn pair(a: u8, b: u8) -> usize {
    usize::from((a | 0x20) - b'a') * 26 + usize::from((b | 0x20) - b'a')
}

impl Vocab {
    fn english_like(&self, letters: &[u8]) -> bool {
        letters.windows(2).all(|p| self.bigrams[pair(p[0], p[1])])
    }

    /// Whether a real vocabulary would hold this word as one token: the shorter an
    /// English-looking word, the likelier, decided by a hash so that it is stable.
    fn single_token(&self, w: &[u8], k: u128) -> bool {
        if self.words.contains(&k) {
            return true;
        }
        let per_mille: u64 = match w.len() {
            0..=4 => 1000,
            5..=6 => 850,
            7..=8 => 650,
            9..=10 => 450,
            11..=13 => 250,
            _ => 0,
        };
        if per_mille == 0 || !self.english_like(w) {
            return false;
        }
        let h = ((k as u64) ^ ((k >> 64) as u64)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (h >> 32) % 1000 < per_mille
    }
}

/// True if `text` is one word of [`ENGLISH_WORDS`] or [`CODE_WORDS`] (any of the cases that stay one token).
pub fn is_common_word(text: &str) -> bool {
    let b = text.as_bytes();
    !b.is_empty()
        && b.iter().all(u8::is_ascii_alphabetic)
        && one_case(b)
        && key(b).is_some_and(|k| vocab().words.contains(&k))
}

/// lower, Capitalized or UPPER: the cases in which a known word stays one token.
fn one_case(w: &[u8]) -> bool {
    let rest_lower = w.iter().skip(1).all(u8::is_ascii_lowercase);
    let all_upper = w.iter().all(u8::is_ascii_uppercase);
    rest_lower || all_upper
}

/// Length in bytes of a `<|name|>` special marker starting at `s`, if there is one.
fn special_len(s: &[u8]) -> Option<usize> {
    let rest = s.strip_prefix(b"<|")?;
    for (i, &c) in rest.iter().enumerate().take(32) {
        if c == b'|' {
            return (i > 0 && rest.get(i + 1) == Some(&b'>')).then_some(2 + i + 2);
        }
        if !(c.is_ascii_alphanumeric() || c == b'_') {
            return None;
        }
    }
    None
}

fn is_punct(b: u8) -> bool {
    b.is_ascii_punctuation()
}

/// Length of a contraction (`'s`, `'t`, `'re`, `'ve`, `'m`, `'ll`, `'d`) at `s`, if any.
fn contraction_len(s: &[u8]) -> Option<usize> {
    let tail = s.strip_prefix(b"'")?;
    let n = tail.iter().take_while(|b| b.is_ascii_alphabetic()).count();
    let word = tail.get(..n)?;
    let known = [&b"s"[..], b"t", b"re", b"ve", b"m", b"ll", b"d"];
    known
        .iter()
        .any(|k| word.eq_ignore_ascii_case(k))
        .then_some(1 + n)
}

/// Splits `text` into pieces; `emit(start, end)` gets byte ranges in order.
struct Splitter<'a, F: FnMut(usize, usize)> {
    b: &'a [u8],
    emit: F,
}

impl<F: FnMut(usize, usize)> Splitter<'_, F> {
    fn run(&mut self) {
        let b = self.b;
        let mut i = 0;
        while i < b.len() {
            let c = b[i];
            i = if c.is_ascii_alphabetic() {
                self.word(i, i)
            } else if c.is_ascii_digit() {
                self.digits(i)
            } else if c == b'<' && special_len(&b[i..]).is_some() {
                let n = special_len(&b[i..]).unwrap_or(1);
                (self.emit)(i, i + n);
                i + n
            } else if c == b'\'' && contraction_len(&b[i..]).is_some() {
                let n = contraction_len(&b[i..]).unwrap_or(1);
                (self.emit)(i, i + n);
                i + n
            } else if c.is_ascii_whitespace() {
                self.whitespace(i)
            } else if is_punct(c) {
                self.punct(i, i)
            } else {
                // Any other char (a multi-byte UTF-8 sequence): one token.
                let n = utf8_len(c);
                let end = (i + n).min(b.len());
                (self.emit)(i, end);
                end
            };
        }
    }

    /// A letter run starting at `letters`, with a one-byte lead at `start` if `start <
    /// letters`. Returns the end.
    fn word(&mut self, start: usize, letters: usize) -> usize {
        let b = self.b;
        let end = letters
            + b[letters..]
                .iter()
                .take_while(|c| c.is_ascii_alphabetic())
                .count();
        let mut from = start;
        let mut part = letters;
        // camelCase and HTTPServer: split before an upper that follows a lower, or before
        // the last upper of an upper run that a lower follows.
        for j in letters + 1..end {
            let boundary = b[j].is_ascii_uppercase()
                && (b[j - 1].is_ascii_lowercase()
                    || (b[j - 1].is_ascii_uppercase()
                        && b.get(j + 1).is_some_and(u8::is_ascii_lowercase)));
            if boundary {
                self.subword(from, part, j);
                from = j;
                part = j;
            }
        }
        self.subword(from, part, end);
        end
    }

    /// Letters `b[letters..end]`, with the lead `b[from..letters]` joined to the first piece.
    fn subword(&mut self, from: usize, letters: usize, end: usize) {
        let v = vocab();
        let w = &self.b[letters..end];
        if one_case(w) && key(w).is_some_and(|k| v.single_token(w, k)) {
            (self.emit)(from, end);
            return;
        }
        let mut p = letters;
        let mut lead = from;
        while p < end {
            let longest = (end - p).min(MAX_PIECE);
            // Two-letter pieces only as prefixes (`un`, `re`), as merges learned on English do.
            let shortest = if p == letters { 2 } else { 3 };
            let mut keys = [0u128; MAX_PIECE + 1];
            let mut k = 0u128;
            for (n, &c) in self.b[p..p + longest].iter().enumerate() {
                k = (k << 5) | u128::from((c | 0x20) - b'a' + 1);
                keys[n + 1] = k;
            }
            let n = (shortest..=longest)
                .rev()
                .find(|&n| v.pieces.contains(&keys[n]))
                .unwrap_or_else(|| {
                    // Nothing known: English-looking letters merge into longer pieces than
                    // random ones do; never leave a single letter behind.
                    let four = longest.min(4);
                    let n = if v.english_like(&self.b[p..p + four]) {
                        four
                    } else {
                        longest.min(2)
                    };
                    if end - p == n + 1 {
                        n + 1
                    } else {
                        n
                    }
                });
            (self.emit)(lead, p + n);
            p += n;
            lead = p;
        }
    }

    fn digits(&mut self, start: usize) -> usize {
        let end = start
            + self.b[start..]
                .iter()
                .take_while(|c| c.is_ascii_digit())
                .count();
        let mut p = start;
        while p < end {
            let q = (p + 3).min(end);
            (self.emit)(p, q);
            p = q;
        }
        end
    }

    /// Punctuation from `chars`, with a leading space at `start` if `start < chars`.
    fn punct(&mut self, start: usize, chars: usize) -> usize {
        let b = self.b;
        let mut end = chars;
        while end < b.len()
            && is_punct(b[end])
            && !(end > chars && b[end] == b'<' && special_len(&b[end..]).is_some())
            && !(end > chars && b[end] == b'\'' && contraction_len(&b[end..]).is_some())
        {
            end += 1;
        }
        // One unspaced punctuation char before letters joins them, as in `.get` or `_id`.
        if start == chars
            && end == chars + 1
            && b"._-/$@#".contains(&b[chars])
            && b.get(end).is_some_and(u8::is_ascii_alphabetic)
        {
            return self.word(start, end);
        }
        let mut from = start;
        let mut p = chars;
        while p < end {
            let q = (p + MAX_PUNCT_RUN).min(end);
            (self.emit)(from, q);
            p = q;
            from = q;
        }
        end
    }

    fn whitespace(&mut self, start: usize) -> usize {
        let b = self.b;
        let end = start
            + b[start..]
                .iter()
                .take_while(|c| c.is_ascii_whitespace())
                .count();
        // A run that contains newlines is one token up to its last newline.
        let mut p = start;
        if let Some(nl) = b[start..end]
            .iter()
            .rposition(|&c| c == b'\n' || c == b'\r')
        {
            let cut = start + nl + 1;
            self.chunks(p, cut);
            p = cut;
        }
        if p == end {
            return end;
        }
        // The last space goes with a following word or punctuation.
        let next = b.get(end).copied();
        let joins = b[end - 1] == b' '
            && next.is_some_and(|c| {
                c.is_ascii_alphabetic()
                    || (is_punct(c) && !(c == b'<' && special_len(&b[end..]).is_some()))
            });
        if !joins {
            self.chunks(p, end);
            return end;
        }
        self.chunks(p, end - 1);
        let lead = end - 1;
        if next.is_some_and(|c| c.is_ascii_alphabetic()) {
            self.word(lead, end)
        } else {
            self.punct(lead, end)
        }
    }

    fn chunks(&mut self, mut p: usize, end: usize) {
        while p < end {
            let q = (p + MAX_SPACE_RUN).min(end);
            (self.emit)(p, q);
            p = q;
        }
    }
}

fn utf8_len(first: u8) -> usize {
    match first {
        0xF0..=0xFF => 4,
        0xE0..=0xEF => 3,
        0xC0..=0xDF => 2,
        _ => 1,
    }
}

/// Calls `emit` with every piece of `text`, in order. Splitting is separate from hashing so
/// tests can look at the pieces.
pub fn split<'a>(text: &'a str, mut emit: impl FnMut(&'a str)) {
    let mut s = Splitter {
        b: text.as_bytes(),
        emit: |a: usize, z: usize| {
            if let Some(p) = text.get(a..z) {
                emit(p);
            }
        },
    };
    s.run();
}

/// Appends the token ids of `text` to `out`.
pub fn encode_into(text: &str, out: &mut Vec<u32>) {
    split(text, |p| out.push(piece_id(p)));
}

pub fn encode(text: &str) -> Vec<u32> {
    let mut v = Vec::with_capacity(text.len() / 3 + 1);
    encode_into(text, &mut v);
    v
}

/// Number of tokens in `text` (what `encode(text).len()` gives, without hashing).
pub fn count(text: &str) -> usize {
    let mut n = 0;
    Splitter {
        b: text.as_bytes(),
        emit: |_, _| n += 1,
    }
    .run();
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    const ENGLISH: &str = "It was the best of times, it was the worst of times, it was the age of \
        wisdom, it was the age of foolishness, it was the epoch of belief, it was the epoch of \
        incredulity, it was the season of Light, it was the season of Darkness, it was the spring \
        of hope, it was the winter of despair. Large language models answer questions by \
        predicting one token after another; serving them efficiently depends on reusing the \
        attention cache computed for earlier requests that share a common prefix, such as a \
        system prompt, a long document, or the previous turns of a conversation.";

    const NEWS: &str = "The European Central Bank raised interest rates again on Thursday, arguing that \
        inflation remained too high even as economic growth across the euro area slowed markedly during \
        the second quarter. Analysts said the decision, which had been widely expected by financial \
        markets, reflected the institution's determination to restore price stability despite mounting \
        concerns about unemployment and industrial production.";

    const CODE: &str = r#"def load_config(path, defaults=None):
    """Read a JSON config file and merge it over the defaults."""
    result = dict(defaults or {})
    with open(path) as f:
        data = json.load(f)
    for key, value in data.items():
        if isinstance(value, dict) and key in result:
            result[key].update(value)
        else:
            result[key] = value
    return result
"#;

    const JSON: &str = r#"{"id": 48213, "name": "cache_loader", "status": "ok", "path": "/var/lib/app/data_7.json", "size": 10234, "updated": "2024-03-17T08:41:22Z", "tags": ["prod", "eu-west-1"], "checksum": "a3f9c2e17b04"}"#;

    fn ratio(text: &str) -> f64 {
        text.chars().count() as f64 / encode(text).len() as f64
    }

    #[test]
    fn chars_per_token_match_bpe_vocabularies() {
        // Llama-3 and GPT-4 tokenizers give about 4-5 chars per token on English prose, 3-4
        // on Python, 2-3 on JSON with ids and numbers, 2-3 on random letters.
        for (name, text, lo, hi) in [
            ("english", ENGLISH, 4.0, 5.0),
            ("news", NEWS, 4.0, 5.0),
            ("code", CODE, 2.8, 4.0),
            ("json", JSON, 2.0, 3.2),
            (
                "random letters",
                " qzkx vbnwt lrpsq xhgf mkzt wqpl",
                1.6,
                3.0,
            ),
        ] {
            let r = ratio(text);
            eprintln!("{name}: {r:.2} chars per token");
            assert!((lo..=hi).contains(&r), "{name}: {r:.2} chars per token");
        }
    }

    #[test]
    fn common_words_are_one_token_and_rare_words_several() {
        for w in [
            " the",
            " The",
            " THE",
            " model",
            " answer",
            "hello",
            " configuration",
        ] {
            let n = count(w);
            if w.trim() == "configuration" {
                assert!((2..=4).contains(&n), "{w}: {n}");
            } else {
                assert_eq!(n, 1, "{w}");
            }
        }
        // The engine's output words re-tokenize to the ids it cached.
        for w in crate::engine::WORDS {
            assert_eq!(count(&format!(" {w}")), 1, "{w}");
        }
        assert!(is_common_word("which") && !is_common_word("whichever"));
        let mut pieces = vec![];
        split(" unpredictability", |p| pieces.push(p));
        assert_eq!(pieces, [" un", "pre", "dict", "ability"]);
    }

    #[test]
    fn digits_go_in_threes_and_punctuation_in_runs() {
        let mut pieces = vec![];
        split("x = 1234567;\n", |p| pieces.push(p));
        assert_eq!(pieces, ["x", " =", " ", "123", "456", "7", ";", "\n"]);
        pieces.clear();
        split("self.client.get(url)", |p| pieces.push(p));
        assert_eq!(pieces, ["self", ".client", ".get", "(", "url", ")"]);
        pieces.clear();
        split("getUserName HTTPServer", |p| pieces.push(p));
        assert_eq!(pieces, ["get", "User", "Name", " HTTP", "Server"]);
        pieces.clear();
        split("don't ... !!!!!", |p| pieces.push(p));
        assert_eq!(pieces, ["don", "'t", " ...", " !!!", "!!"]);
    }

    #[test]
    fn pieces_cover_the_text_exactly() {
        for text in [
            ENGLISH,
            CODE,
            JSON,
            "  héllo\n\n<|user|>\nx  , <|bad marker|> 12345678\t!  \n  ",
            "<|<|a|>|>'''s 'x",
        ] {
            let mut joined = String::new();
            split(text, |p| joined.push_str(p));
            assert_eq!(joined, text);
            assert_eq!(count(text), encode(text).len());
        }
    }

    #[test]
    fn specials_and_spaces() {
        let mut pieces = vec![];
        split("<|assistant|>\n the understanding.\n\n    return x", |p| {
            pieces.push(p)
        });
        assert_eq!(
            pieces,
            [
                "<|assistant|>",
                "\n",
                " the",
                " under",
                "stand",
                "ing",
                ".",
                "\n\n",
                "   ",
                " return",
                " x"
            ]
        );
    }

    #[test]
    fn deterministic_and_prefix_stable() {
        let a = encode("hello world, this is a test");
        let b = encode("hello world, this is a test of prefixes");
        assert_eq!(a, encode("hello world, this is a test"));
        assert_eq!(&b[..a.len()], &a[..]);
    }

    #[test]
    fn speed() {
        // The mock tokenizes every prompt on receipt; keep it far below a pass's duration.
        let text: String = [ENGLISH, CODE, JSON].concat().repeat(200);
        let tokens = count(&text);
        let t = std::time::Instant::now();
        let mut n = 0;
        for _ in 0..5 {
            n += encode(&text).len();
        }
        let ns = t.elapsed().as_nanos() as f64 / n as f64;
        eprintln!("tokenizer: {ns:.1} ns per token over {tokens} tokens");
        assert_eq!(n, 5 * tokens);
        // Generous for a debug build on a loaded machine; release is ~20x faster.
        assert!(ns < 5_000.0, "{ns:.0} ns per token");
    }
}
