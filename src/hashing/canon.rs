//! The canonical chat stream.
//!
//! Format (every length is the byte length as unsigned LEB128):
//!
//! ```text
//! stream     = [0x1D canon(tools)] turn*          tools only when non-empty
//! turn       = 0x1E
//!              0x01 len role
//!              [0x02 len name]
//!              [0x03 len tool_call_id]
//!              content*                           in order; empty texts omitted
//!              [0x06 canon(tool_calls)]           only when non-empty
//! content    = 0x04 text 0xFF                     string content or a text part
//!                                                 (0xFF never occurs in UTF-8)
//!            | 0x05 len kind digest_le64          any other part
//! canon(v)   = compact JSON, object keys sorted by bytes, serde_json's escaping
//! ```
//!
//! Each turn's bytes depend on that message alone, so the stream of a conversation is a
//! byte prefix of the stream of any continuation, and blocks inside it hash the same.
//! Text is terminated, not length-prefixed, so two messages that start with the same
//! document and end with different questions share the document's blocks, as they share
//! its KV in an engine that renders the message through its chat template.
//! Every field is tagged and either length-prefixed, terminated or self-delimiting JSON, so two
//! different conversations never produce the same stream. String content and a single
//! text part produce the same bytes, as do null, missing, `""` and `[]` content: engines
//! render them the same way.

use serde::ser::{Serialize, Serializer};
use serde_json::Value;

use crate::request::{Content, Message, Part};

const TOOLS: u8 = 0x1D;
const TURN: u8 = 0x1E;
const ROLE: u8 = 0x01;
const NAME: u8 = 0x02;
const TOOL_CALL_ID: u8 = 0x03;
const TEXT: u8 = 0x04;
const OTHER_PART: u8 = 0x05;
const TOOL_CALLS: u8 = 0x06;
/// Ends a text; no UTF-8 string contains this byte.
const END_TEXT: u8 = 0xFF;

/// Where the canonical stream goes: the block chain, or (in tests) a plain buffer.
pub(super) trait Sink {
    fn put(&mut self, bytes: &[u8]);
}

pub(super) fn write_chat<S: Sink>(out: &mut S, messages: &[Message<'_>], tools: &[Value]) {
    // Tools and tool calls are small; serialising them into one reused buffer first turns
    // serde_json's many tiny writes into one call on the block chain.
    let mut json = Vec::new();
    if !tools.is_empty() {
        out.put(&[TOOLS]);
        put_json(out, &mut json, tools);
    }
    for message in messages {
        write_turn(out, &mut json, message);
    }
}

/// Bytes of text in the messages: a lower bound of the stream length, for presizing.
pub(super) fn size_hint(messages: &[Message<'_>]) -> usize {
    messages
        .iter()
        .map(|m| match &m.content {
            Content::Absent => 0,
            Content::Text(t) => t.len(),
            Content::Parts(parts) => parts
                .iter()
                .map(|p| match p {
                    Part::Text(t) => t.len(),
                    Part::Other { .. } => 0,
                })
                .sum(),
        })
        .fold(0usize, usize::saturating_add)
}

fn write_turn<S: Sink>(out: &mut S, json: &mut Vec<u8>, m: &Message<'_>) {
    out.put(&[TURN]);
    put_field(out, ROLE, m.role.as_bytes());
    if let Some(name) = &m.name {
        put_field(out, NAME, name.as_bytes());
    }
    if let Some(id) = &m.tool_call_id {
        put_field(out, TOOL_CALL_ID, id.as_bytes());
    }
    match &m.content {
        Content::Absent => {}
        Content::Text(text) => put_text(out, text),
        Content::Parts(parts) => {
            for part in parts {
                match part {
                    Part::Text(text) => put_text(out, text),
                    Part::Other { kind, digest } => {
                        put_field(out, OTHER_PART, kind.as_bytes());
                        out.put(&digest.to_le_bytes());
                    }
                }
            }
        }
    }
    if !m.tool_calls.is_empty() {
        out.put(&[TOOL_CALLS]);
        put_json(out, json, &m.tool_calls);
    }
}

fn put_text<S: Sink>(out: &mut S, text: &str) {
    if !text.is_empty() {
        out.put(&[TEXT]);
        out.put(text.as_bytes());
        out.put(&[END_TEXT]);
    }
}

fn put_field<S: Sink>(out: &mut S, tag: u8, bytes: &[u8]) {
    out.put(&[tag]);
    put_len(out, bytes.len());
    out.put(bytes);
}

fn put_len<S: Sink>(out: &mut S, len: usize) {
    let mut buf = [0u8; 10];
    let mut used = 0;
    let mut rest = len as u64; // usize is at most 64 bits on every target
    for slot in &mut buf {
        let low = (rest & 0x7f) as u8; // masked to 7 bits, so nothing is lost
        rest >>= 7;
        used += 1;
        if rest == 0 {
            *slot = low;
            break;
        }
        *slot = low | 0x80;
    }
    out.put(buf.get(..used).unwrap_or(&buf));
}

fn put_json<S: Sink>(out: &mut S, json: &mut Vec<u8>, values: &[Value]) {
    json.clear();
    // Writing to a Vec cannot fail and `Canonical` never errors; were that ever to change,
    // the stream would still be deterministic, only shorter.
    let _ = serde_json::to_writer(&mut *json, &Canonical::Seq(values));
    out.put(json);
}

/// A JSON value serialised with object keys in byte order, whatever order the client
/// sent them in and however serde_json's `Map` is configured.
enum Canonical<'v> {
    Seq(&'v [Value]),
    One(&'v Value),
}

impl Serialize for Canonical<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Seq(items) => s.collect_seq(items.iter().map(Canonical::One)),
            Self::One(Value::Array(items)) => s.collect_seq(items.iter().map(Canonical::One)),
            Self::One(Value::Object(map)) => {
                if map.keys().is_sorted() {
                    return s.collect_map(map.iter().map(|(k, v)| (k, Canonical::One(v))));
                }
                let mut entries: Vec<(&String, &Value)> = map.iter().collect();
                entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
                s.collect_map(entries.into_iter().map(|(k, v)| (k, Canonical::One(v))))
            }
            Self::One(scalar) => scalar.serialize(s),
        }
    }
}
