//! The parsed request: what the router reads from a body, and why a body could not be read.
//! Kept apart from the parser and its visitors, which both build these.

use std::borrow::Cow;
use std::fmt;

use serde_json::Value;

/// Which OpenAI endpoint the body was sent to; it decides which fields are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind {
    /// `/v1/completions`: `prompt`.
    Completions,
    /// `/v1/chat/completions`: `messages` and `tools`.
    ChatCompletions,
}

/// What the router needs from one inference request.
#[derive(Debug, Clone, PartialEq)]
pub struct InferenceRequest<'a> {
    /// Empty when the body has no `model`: engines then serve their only model, so an
    /// absent model is not an error.
    pub model: Cow<'a, str>,
    pub prompt: Prompt<'a>,
    /// `max_tokens`, or in chat `max_completion_tokens` when both are given (OpenAI
    /// deprecated the former in its favour).
    pub max_tokens: Option<u32>,
    pub stream: bool,
    /// `stream_options.include_usage`: whether the last SSE chunk will carry `usage`.
    pub include_usage: bool,
    pub cache_salt: Option<Cow<'a, str>>,
    /// OpenAI's `prompt_cache_key`: requests sharing it prefer the worker that served it.
    pub cache_key: Option<Cow<'a, str>>,
    /// Non-text content parts (`image_url`, `input_audio`, ...) that were not read as text.
    pub skipped_parts: u32,
}

/// The prompt, in the form the client sent it.
///
/// A completions batch (a list of prompts) keeps every entry: the first one is the
/// routing prompt whose blocks are hashed, and all of them count towards the token
/// estimate, because the worker prefills all of them.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt<'a> {
    /// One or more text prompts; never empty, no entry empty.
    Text(Vec<Cow<'a, str>>),
    /// One or more token-id prompts; never empty, no entry empty.
    Tokens(Vec<Vec<u32>>),
    /// Chat messages (never empty) and the tool definitions (empty when absent or null).
    Chat {
        messages: Vec<Message<'a>>,
        tools: Vec<Value>,
    },
}

/// One chat turn.
#[derive(Debug, Clone, PartialEq)]
pub struct Message<'a> {
    pub role: Cow<'a, str>,
    pub name: Option<Cow<'a, str>>,
    pub content: Content<'a>,
    /// Assistant tool calls; empty when absent or null.
    pub tool_calls: Vec<Value>,
    pub tool_call_id: Option<Cow<'a, str>>,
}

/// A message's `content`.
#[derive(Debug, Clone, PartialEq)]
pub enum Content<'a> {
    /// `null` or no `content` (an assistant turn that only calls tools).
    Absent,
    Text(Cow<'a, str>),
    Parts(Vec<Part<'a>>),
}

/// One element of an array `content`.
#[derive(Debug, Clone, PartialEq)]
pub enum Part<'a> {
    /// `{"type":"text","text":...}`
    Text(Cow<'a, str>),
    /// Any other part type. Its payload is not read as text, but `digest` (of its raw
    /// fields) still tells two different images apart, so they never look like a shared
    /// prefix.
    Other { kind: Cow<'a, str>, digest: u64 },
}

/// Why a body could not be used for routing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseError {
    /// Not JSON at all, or JSON that serde_json refuses (e.g. nesting deeper than 128).
    InvalidJson { detail: String },
    /// Valid JSON whose top level is not an object.
    NotAnObject,
    /// A required field is absent (or `null`).
    MissingField(&'static str),
    /// A field holds a value of the wrong type or out of range.
    WrongType {
        field: &'static str,
        expected: &'static str,
    },
    /// A prompt or message list with nothing in it.
    Empty(&'static str),
    /// A valid request this router cannot hash.
    Unsupported {
        field: &'static str,
        reason: &'static str,
    },
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidJson { detail } => write!(f, "request body is not valid JSON: {detail}"),
            Self::NotAnObject => f.write_str("request body must be a JSON object"),
            Self::MissingField(field) => write!(f, "missing required field `{field}`"),
            Self::WrongType { field, expected } => write!(f, "field `{field}` must be {expected}"),
            Self::Empty(field) => write!(f, "field `{field}` must not be empty"),
            Self::Unsupported { field, reason } => {
                write!(f, "field `{field}` is not supported: {reason}")
            }
        }
    }
}

impl std::error::Error for ParseError {}

impl Prompt<'_> {
    /// Non-text content parts in all messages.
    pub fn skipped_parts(&self) -> u32 {
        let Prompt::Chat { messages, .. } = self else {
            return 0;
        };
        let skipped = messages
            .iter()
            .filter_map(|m| match &m.content {
                Content::Parts(parts) => Some(parts),
                _ => None,
            })
            .flatten()
            .filter(|p| matches!(p, Part::Other { .. }))
            .count();
        u32::try_from(skipped).unwrap_or(u32::MAX)
    }
}
