//! The bodies of kvroute's fuzz targets, shared by the libFuzzer binaries (`fuzz_targets/`)
//! and by the native corpus replay in `make test` (`tests/fuzz_corpus.rs` includes this
//! file as a module).
//!
//! Every target feeds raw bytes to a public entry point that sees client or upstream data
//! and then checks properties that must hold for any input, beyond "it did not panic".
//! A violated property panics, which libFuzzer reports as a crash.

use kvroute::config::Config;
use kvroute::events::{self, DecodeError};
use kvroute::feedback::{parse_orca, Usage, UsageTail};
use kvroute::hashing::{canonical_stream, prompt_hashes, HashParams, PromptHashes};
use kvroute::ids::MAX_WORKERS;
use kvroute::request::{self, ApiKind, InferenceRequest, ParseError, Prompt};
use serde::de::IgnoredAny;
use std::borrow::Cow;

/// Target names: the fuzz binaries and the corpus folders are named after them.
pub const TARGETS: [&str; 5] = ["request", "hashing", "events", "feedback", "config"];

/// Runs the named target on one input; `false` for an unknown name.
pub fn run(target: &str, data: &[u8]) -> bool {
    let body: fn(&[u8]) = match target {
        "request" => request,
        "hashing" => hashing,
        "events" => events,
        "feedback" => feedback,
        "config" => config,
        _ => return false,
    };
    body(data);
    true
}

const KINDS: [ApiKind; 2] = [ApiKind::Completions, ApiKind::ChatCompletions];

/// `kvroute::request::parse` of a completions and of a chat body.
pub fn request(data: &[u8]) {
    for kind in KINDS {
        let parsed = request::parse(kind, data);
        assert_eq!(parsed, request::parse(kind, data), "parse is deterministic");
        match parsed {
            Ok(req) => check_request(kind, data, &req),
            Err(e) => check_parse_error(&e),
        }
    }
}

fn check_request(kind: ApiKind, data: &[u8], req: &InferenceRequest<'_>) {
    // Nothing kvroute accepts may be JSON that serde_json itself refuses.
    assert!(
        serde_json::from_slice::<IgnoredAny>(data).is_ok(),
        "accepted a body that is not JSON"
    );
    assert_eq!(req.skipped_parts, req.prompt.skipped_parts());
    match (&req.prompt, kind) {
        (Prompt::Text(texts), ApiKind::Completions) => {
            assert!(!texts.is_empty() && texts.iter().all(|t| !t.is_empty()));
            // Unescaping only ever shrinks a string, so the text fits in the body.
            let bytes = texts
                .iter()
                .map(|t| t.len())
                .fold(0usize, usize::saturating_add);
            assert!(
                bytes <= data.len(),
                "{bytes} text bytes from {}",
                data.len()
            );
        }
        (Prompt::Tokens(lists), ApiKind::Completions) => {
            assert!(!lists.is_empty() && lists.iter().all(|l| !l.is_empty()));
            // Every id takes at least one digit and a separator (or the closing bracket).
            let ids = lists.iter().map(Vec::len).sum::<usize>();
            assert!(
                ids * 2 <= data.len(),
                "{ids} token ids from {} bytes",
                data.len()
            );
        }
        (Prompt::Chat { messages, .. }, ApiKind::ChatCompletions) => {
            assert!(!messages.is_empty());
            // `{}` is the shortest message.
            assert!(messages.len() * 2 <= data.len());
        }
        (prompt, kind) => panic!("{kind:?} body parsed as {prompt:?}"),
    }
}

fn check_parse_error(e: &ParseError) {
    let field = match e {
        ParseError::MissingField(f) | ParseError::Empty(f) => Some(*f),
        ParseError::WrongType { field, expected } => {
            assert!(!expected.is_empty());
            Some(*field)
        }
        ParseError::Unsupported { field, reason } => {
            assert!(!reason.is_empty());
            Some(*field)
        }
        ParseError::InvalidJson { .. } | ParseError::NotAnObject => None,
    };
    let shown = e.to_string();
    if let Some(field) = field {
        assert!(!field.is_empty(), "{e:?} names no field");
        assert!(shown.contains(field), "{shown:?} does not name {field}");
    }
    assert!(!shown.is_empty());
}

/// The canonical prompt stream and the chained block hashes of every body that parses.
pub fn hashing(data: &[u8]) {
    // The shipped block size, and a small one derived from the input so that short inputs
    // still make several blocks.
    let small = HashParams {
        block_size: 1 + (data.len() % 5) as u32,
        chars_per_token: 0.5 * (1 + data.len() % 3) as f64,
    };
    for kind in KINDS {
        let Ok(req) = request::parse(kind, data) else {
            continue;
        };
        for p in [HashParams::default(), small] {
            check_hashes(data, &req, &p);
        }
    }
}

fn check_hashes(data: &[u8], req: &InferenceRequest<'_>, p: &HashParams) {
    let h = prompt_hashes(req, p);
    assert_eq!(h, prompt_hashes(req, p), "hashing is deterministic");
    let stream = canonical_stream(req);
    match &req.prompt {
        Prompt::Tokens(lists) => {
            let first = lists.first().map_or(0, Vec::len);
            assert!(h.exact);
            assert_eq!(stream.len(), first * 4);
            assert_eq!(h.blocks.len(), first / p.tokens_per_block());
            let all = lists.iter().map(Vec::len).sum::<usize>();
            assert_eq!(h.est_tokens, u32::try_from(all).unwrap_or(u32::MAX));
            // Never more blocks than the body has bytes.
            assert!(h.blocks.len() <= data.len());
        }
        Prompt::Text(texts) => {
            assert!(!h.exact);
            assert_eq!(h.blocks.len(), stream.len() / p.text_block_bytes());
            let est = texts
                .iter()
                .fold(0u32, |s, t| s.saturating_add(p.estimate_tokens(t.len())));
            assert_eq!(h.est_tokens, est);
            assert!(h.blocks.len() <= data.len());
        }
        Prompt::Chat { .. } => {
            assert!(!h.exact);
            assert_eq!(h.blocks.len(), stream.len() / p.text_block_bytes());
            assert_eq!(h.est_tokens, p.estimate_tokens(stream.len()));
        }
    }
    check_prefix(req, p, &h, &stream);
    check_salt_separates(req, p, &h);
}

/// A request whose prompt is a prefix (in whole blocks, or earlier turns) of this one must
/// hash to a prefix of this one's blocks: that is what makes the index's prefix match work.
fn check_prefix(req: &InferenceRequest<'_>, p: &HashParams, h: &PromptHashes, stream: &[u8]) {
    let prompt = match &req.prompt {
        Prompt::Tokens(lists) => {
            let first = lists.first().map_or(&[][..], Vec::as_slice);
            let keep = (h.blocks.len() / 2) * p.tokens_per_block();
            Prompt::Tokens(vec![first.get(..keep).unwrap_or(first).to_vec()])
        }
        Prompt::Text(texts) => {
            let first: &str = texts.first().map_or("", |t| t.as_ref());
            let mut cut = (h.blocks.len() / 2) * p.text_block_bytes();
            while !first.is_char_boundary(cut) {
                cut -= 1;
            }
            Prompt::Text(vec![Cow::Borrowed(&first[..cut])])
        }
        Prompt::Chat { messages, tools } => {
            if messages.len() < 2 {
                return;
            }
            Prompt::Chat {
                messages: messages[..messages.len() - 1].to_vec(),
                tools: tools.clone(),
            }
        }
    };
    let shorter = InferenceRequest {
        prompt,
        ..req.clone()
    };
    let short_stream = canonical_stream(&shorter);
    assert!(
        stream.starts_with(&short_stream),
        "the shorter prompt's stream is not a prefix"
    );
    let short = prompt_hashes(&shorter, p);
    assert!(short.blocks.len() <= h.blocks.len());
    assert_eq!(short.blocks[..], h.blocks[..short.blocks.len()]);
}

/// Another cache salt must never share a block with this request.
fn check_salt_separates(req: &InferenceRequest<'_>, p: &HashParams, h: &PromptHashes) {
    let Some(&first) = h.blocks.first() else {
        return;
    };
    let salt = format!("{}/other", req.cache_salt.as_deref().unwrap_or(""));
    let salted = InferenceRequest {
        cache_salt: Some(Cow::Owned(salt)),
        ..req.clone()
    };
    let other = prompt_hashes(&salted, p);
    assert_eq!(other.blocks.len(), h.blocks.len());
    assert_ne!(
        other.blocks.first(),
        Some(&first),
        "salt did not change the hash"
    );
}

/// `kvroute::events::decode` of a replication message.
pub fn events(data: &[u8]) {
    match events::decode(data) {
        Ok((sent_ns, evs)) => {
            let again = events::encode(sent_ns, &evs);
            let clean = events::decode_counted(data).is_ok_and(|d| d.skipped == 0);
            if clean && data.first() == again.first() {
                // The current wire form has exactly one encoding: re-encoding a message read
                // without skips gives the same bytes, so decode(encode(x)) == x.
                assert_eq!(again, data, "encode(decode(msg)) != msg");
            } else {
                // Older versions and messages with skipped events: what was read survives
                // a round trip through the current form.
                let back = events::decode(&again).map(|(_, e)| e);
                assert_eq!(
                    back.as_deref().unwrap_or(&[]),
                    &evs[..],
                    "events lost in re-encoding"
                );
            }
            // Dropping the last byte loses the last event of a clean message, and never
            // adds one to any message.
            if let Some(short) = data.get(..data.len() - 1) {
                if let Ok((_, fewer)) = events::decode(short) {
                    assert!(fewer.len() <= evs.len());
                    assert!(!clean || fewer.len() < evs.len());
                }
            }
            // Every event takes at least its tag byte.
            assert!(evs.len() < data.len());
        }
        Err(e) => {
            match (e, data.first()) {
                (DecodeError::Empty, None) => {}
                (DecodeError::Empty, Some(_)) => panic!("non-empty message decoded as Empty"),
                (_, None) => panic!("empty message decoded as {e:?}"),
                _ => {}
            }
            assert!(!e.to_string().is_empty());
        }
    }
}

/// The usage the feedback target appends to every stream.
const LAST_USAGE: &[u8] =
    b"\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3,\
      \"prompt_tokens_details\":{\"cached_tokens\":2}}}\n\ndata: [DONE]\n\n";

/// Keep in step with `kvroute::feedback`'s retained tail (8 KiB): below it, how a body is
/// cut into chunks must not change what is found.
const TAIL: usize = 8 * 1024;

/// `kvroute::feedback`: ORCA header parsing, and `UsageTail` over a response body.
pub fn feedback(data: &[u8]) {
    let header = String::from_utf8_lossy(data);
    if let Some(load) = parse_orca(&header) {
        assert!(!load.is_empty(), "Some(empty) for {header:?}");
        if let Some(kv) = load.kv_usage {
            assert!(kv.is_finite() && (0.0..=1.0).contains(&kv), "kv_usage {kv}");
        }
    }

    let mut whole = UsageTail::default();
    whole.push(data);
    let found = whole.usage();
    if found.is_some() {
        assert!(data.windows(7).any(|w| w == b"\"usage\""));
    }
    if data.len() <= TAIL {
        // The same body in chunks whose size the input picks.
        let size = 1 + usize::from(data.first().copied().unwrap_or(0) % 64);
        let mut pieces = UsageTail::default();
        for chunk in data.chunks(size) {
            pieces.push(chunk);
        }
        assert_eq!(pieces.usage(), found, "chunking changed the usage found");
    }
    // Whatever came before, the final chunk's usage is the one reported.
    whole.push(LAST_USAGE);
    assert_eq!(
        whole.usage(),
        Some(Usage {
            prompt_tokens: 7,
            completion_tokens: 3,
            cached_tokens: Some(2),
        })
    );
}

/// `kvroute::config::Config::from_json` of a plugin configuration.
pub fn config(data: &[u8]) {
    match Config::from_json(data) {
        Ok(cfg) => {
            assert_eq!(cfg.validate(), Ok(()));
            assert!(!cfg.workers.is_empty() && cfg.workers.len() <= MAX_WORKERS);
            assert!(cfg.workers.iter().all(|w| cfg.kv_blocks(w) >= 1));
            assert!((1..=4096).contains(&cfg.block_size));
        }
        Err(e) => {
            assert!(!e.message.is_empty());
            assert!(e.to_string().starts_with("invalid kvroute config"));
            // A config that deserialises fails validation only, and every validation error
            // names the field as a path into the JSON (`workers[2].endpoint`).
            if serde_json::from_slice::<Config>(data).is_ok() {
                assert!(!e.field.is_empty(), "validation error names no field: {e}");
                assert!(
                    e.field
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"_.[]".contains(&b)),
                    "field {:?} is not a path",
                    e.field
                );
                assert!(e.to_string().contains(&e.field));
            }
        }
    }
}
