//! A deterministic stand-in tokenizer.
//!
//! It is deliberately *not* the router's estimator: the router has to learn the engine's
//! token counts from `usage`, exactly as it would against a real vLLM. The shape mimics a
//! BPE vocabulary on English: a word keeps its leading space, long words break into pieces,
//! punctuation stands alone, and `<|name|>` markers are single special tokens, which gives
//! roughly 4-5 characters per token on prose.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Longest piece of a word in chars, counting its leading space. 7 puts ordinary prose at
/// about 4.1 (short-word fiction) to 4.7 (news) chars per token, like real BPE vocabularies.
const PIECE_CHARS: usize = 7;
const TOKEN_SEED: u64 = 0x6b76_726f_7574_65;

/// Id of one piece of text. Ids are hashes so that the vocabulary is unbounded yet stable
/// across processes and runs.
pub fn piece_id(piece: &str) -> u32 {
    let h = xxh3_64_with_seed(piece.as_bytes(), TOKEN_SEED);
    (h ^ (h >> 32)) as u32
}

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Length in bytes of a `<|name|>` special marker starting at `s`, if there is one.
fn special_len(s: &str) -> Option<usize> {
    let rest = s.strip_prefix("<|")?;
    for (i, c) in rest.char_indices().take(32) {
        if c == '|' {
            return rest[i..]
                .starts_with("|>")
                .then_some(2 + i + 2)
                .filter(|_| i > 0);
        }
        if !(c.is_ascii_alphanumeric() || c == '_') {
            return None;
        }
    }
    None
}

/// Calls `emit` with every piece of `text`, in order. Splitting is separate from hashing so
/// tests can look at the pieces.
pub fn split<'a>(text: &'a str, mut emit: impl FnMut(&'a str)) {
    let b = text.as_bytes();
    let mut i = 0;
    while i < text.len() {
        let rest = &text[i..];
        if b[i] == b'<' {
            if let Some(n) = special_len(rest) {
                emit(&rest[..n]);
                i += n;
                continue;
            }
        }
        let c = rest.chars().next().unwrap();
        if c.is_whitespace() {
            // A whitespace run is one token, except that a single trailing space joins the
            // following word (so " word" is one piece, like GPT-style vocabularies).
            let mut end = 0;
            for (j, ch) in rest.char_indices() {
                if !ch.is_whitespace() {
                    break;
                }
                end = j + ch.len_utf8();
            }
            let next_is_word = rest[end..].chars().next().is_some_and(is_word_char);
            let run_end = if next_is_word && rest[..end].ends_with(' ') {
                end - 1
            } else {
                end
            };
            if run_end > 0 {
                emit(&rest[..run_end]);
                i += run_end;
                continue;
            }
            // Only the single space before a word is left: fall through to the word path.
        }
        let (lead, body) = if rest.starts_with(' ') {
            (1, &rest[1..])
        } else {
            (0, rest)
        };
        if body.chars().next().is_some_and(is_word_char) {
            let mut end = 0;
            for (j, ch) in body.char_indices() {
                if !is_word_char(ch) {
                    break;
                }
                end = j + ch.len_utf8();
            }
            let word = &rest[..lead + end];
            // Pieces of at most PIECE_CHARS chars; the leading space counts toward the first.
            let mut start = 0;
            let mut count = 0;
            for (j, _) in word.char_indices() {
                if count == PIECE_CHARS {
                    emit(&word[start..j]);
                    start = j;
                    count = 0;
                }
                count += 1;
            }
            emit(&word[start..]);
            i += word.len();
            continue;
        }
        // Punctuation and symbols: one char each.
        let n = c.len_utf8();
        emit(&rest[..n]);
        i += n;
    }
}

/// Appends the token ids of `text` to `out`.
pub fn encode_into(text: &str, out: &mut Vec<u32>) {
    split(text, |p| out.push(piece_id(p)));
}

pub fn encode(text: &str) -> Vec<u32> {
    let mut v = Vec::with_capacity(text.len() / 4 + 1);
    encode_into(text, &mut v);
    v
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

    #[test]
    fn english_ratio_is_between_4_and_5_chars_per_token() {
        for text in [ENGLISH, NEWS] {
            let n = encode(text).len();
            let ratio = text.chars().count() as f64 / n as f64;
            assert!(
                (4.0..=5.0).contains(&ratio),
                "ratio {ratio:.2} ({n} tokens)"
            );
        }
    }

    #[test]
    fn pieces_cover_the_text_exactly() {
        let mut joined = String::new();
        split(ENGLISH, |p| joined.push_str(p));
        assert_eq!(joined, ENGLISH);
        let mut s = String::new();
        let weird = "  héllo\n\n<|user|>\nx  , <|bad marker|> 12345678\t!";
        split(weird, |p| s.push_str(p));
        assert_eq!(s, weird);
    }

    #[test]
    fn specials_and_spaces() {
        let mut pieces = vec![];
        split("<|assistant|>\n the understanding.", |p| pieces.push(p));
        assert_eq!(
            pieces,
            ["<|assistant|>", "\n", " the", " unders", "tanding", "."]
        );
    }

    #[test]
    fn deterministic_and_prefix_stable() {
        let a = encode("hello world, this is a test");
        let b = encode("hello world, this is a test of prefixes");
        assert_eq!(a, encode("hello world, this is a test"));
        assert_eq!(&b[..a.len()], &a[..]);
    }
}
