//! The serde visitors behind [`super::parse`].
//!
//! serde reports a type mismatch without saying where it happened, so every reader first
//! records in [`Ctx`] which field it is about to read; a data error is then attributed to
//! the innermost field being read when it was raised. Checks of our own (a missing field)
//! store the typed error in `Ctx` directly and unwind with a placeholder serde error.

use std::borrow::Cow;
use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::types::{ApiKind, Content, Message, ParseError, Part, Prompt};

const PROMPT_EXPECTED: &str =
    "a string, an array of strings, an array of token ids (0..=4294967295) or an array of token-id arrays";
const COUNT_EXPECTED: &str = "an integer from 0 to 4294967295, or null";

pub(super) struct Ctx {
    at: Cell<(&'static str, &'static str)>,
    error: Cell<Option<ParseError>>,
}

impl Ctx {
    pub(super) fn new() -> Self {
        Self {
            at: Cell::new(("(body)", "a JSON object")),
            error: Cell::new(None),
        }
    }

    fn enter(&self, field: &'static str, expected: &'static str) {
        self.at.set((field, expected));
    }

    fn reject<E: de::Error>(&self, err: ParseError) -> E {
        self.error.set(Some(err));
        E::custom("rejected by kvroute")
    }

    pub(super) fn to_error(&self, e: &serde_json::Error) -> ParseError {
        if let Some(err) = self.error.take() {
            return err;
        }
        match e.classify() {
            serde_json::error::Category::Data => {
                let (field, expected) = self.at.get();
                ParseError::WrongType { field, expected }
            }
            _ => ParseError::InvalidJson {
                detail: e.to_string(),
            },
        }
    }
}

/// A string that borrows from the body when it has no escapes. (serde's own `Cow<str>`
/// always allocates outside derived structs with `#[serde(borrow)]`.)
struct Str<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Str<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(StrVisitor)
    }
}

struct StrVisitor;

impl<'de> Visitor<'de> for StrVisitor {
    type Value = Str<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Str(Cow::Borrowed(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Str(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(Str(Cow::Owned(v)))
    }
}

fn read<'de, A, T>(
    map: &mut A,
    ctx: &Ctx,
    field: &'static str,
    expected: &'static str,
) -> Result<T, A::Error>
where
    A: MapAccess<'de>,
    T: Deserialize<'de>,
{
    ctx.enter(field, expected);
    map.next_value()
}

fn read_str<'de, A: MapAccess<'de>>(
    map: &mut A,
    ctx: &Ctx,
    field: &'static str,
) -> Result<Option<Cow<'de, str>>, A::Error> {
    let s: Option<Str<'de>> = read(map, ctx, field, "a string or null")?;
    Ok(s.map(|s| s.0))
}

/// The top-level fields, before the checks that need all of them.
#[derive(Default)]
pub(super) struct Fields<'a> {
    pub model: Option<Cow<'a, str>>,
    pub prompt: Option<Prompt<'a>>,
    pub prompt_embeds: bool,
    pub messages: Option<Vec<Message<'a>>>,
    pub tools: Option<Vec<Value>>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub stream: Option<bool>,
    pub include_usage: Option<bool>,
    pub cache_salt: Option<Cow<'a, str>>,
    pub prompt_cache_key: Option<Cow<'a, str>>,
}

pub(super) struct BodyVisitor<'c> {
    kind: ApiKind,
    ctx: &'c Ctx,
}

impl<'c> BodyVisitor<'c> {
    pub(super) fn new(kind: ApiKind, ctx: &'c Ctx) -> Self {
        Self { kind, ctx }
    }
}

impl<'de> Visitor<'de> for BodyVisitor<'_> {
    type Value = Fields<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    // Repeated keys overwrite: the engines behind us read JSON the same way.
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let ctx = self.ctx;
        let chat = self.kind == ApiKind::ChatCompletions;
        let mut f = Fields::default();
        while let Some(Str(key)) = map.next_key()? {
            match key.as_ref() {
                "model" => f.model = read_str(&mut map, ctx, "model")?,
                "cache_salt" => f.cache_salt = read_str(&mut map, ctx, "cache_salt")?,
                "prompt_cache_key" => {
                    f.prompt_cache_key = read_str(&mut map, ctx, "prompt_cache_key")?;
                }
                "stream" => f.stream = read(&mut map, ctx, "stream", "a boolean or null")?,
                "stream_options" => {
                    f.include_usage = map.next_value_seed(StreamOptionsSeed(ctx))?
                }
                "max_tokens" => f.max_tokens = read(&mut map, ctx, "max_tokens", COUNT_EXPECTED)?,
                "max_completion_tokens" if chat => {
                    f.max_completion_tokens =
                        read(&mut map, ctx, "max_completion_tokens", COUNT_EXPECTED)?;
                }
                "prompt" if !chat => f.prompt = map.next_value_seed(PromptSeed(ctx))?,
                "prompt_embeds" if !chat => {
                    let v: Option<IgnoredAny> = read(&mut map, ctx, "prompt_embeds", "any")?;
                    f.prompt_embeds = v.is_some();
                }
                "messages" if chat => f.messages = Some(map.next_value_seed(MessagesSeed(ctx))?),
                "tools" if chat => {
                    f.tools = read(
                        &mut map,
                        ctx,
                        "tools",
                        "an array of tool definitions or null",
                    )?;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(f)
    }
}

struct StreamOptionsSeed<'c>(&'c Ctx);

impl<'de> DeserializeSeed<'de> for StreamOptionsSeed<'_> {
    type Value = Option<bool>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.0.enter("stream_options", "an object or null");
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for StreamOptionsSeed<'_> {
    type Value = Option<bool>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object or null")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut include_usage = None;
        while let Some(Str(key)) = map.next_key()? {
            if key == "include_usage" {
                include_usage = read(
                    &mut map,
                    self.0,
                    "stream_options.include_usage",
                    "a boolean or null",
                )?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(include_usage)
    }
}

/// `prompt`: `null` reads as absent.
struct PromptSeed<'c>(&'c Ctx);

impl<'de> DeserializeSeed<'de> for PromptSeed<'_> {
    type Value = Option<Prompt<'de>>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.0.enter("prompt", PROMPT_EXPECTED);
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PromptSeed<'_> {
    type Value = Option<Prompt<'de>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(PROMPT_EXPECTED)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Some(Prompt::Text(vec![Cow::Borrowed(v)])))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Some(Prompt::Text(vec![Cow::Owned(v.to_owned())])))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(Some(Prompt::Text(vec![Cow::Owned(v)])))
    }

    // The first entry decides the form; the rest must match it.
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let ctx = self.0;
        let Some(first) = seq.next_element_seed(PromptItemSeed(ctx))? else {
            return Ok(Some(Prompt::Text(Vec::new())));
        };
        let prompt = match first {
            PromptItem::Text(text) => {
                let mut texts = vec![text];
                ctx.enter("prompt", "an array of strings");
                while let Some(Str(text)) = seq.next_element()? {
                    texts.push(text);
                }
                Prompt::Text(texts)
            }
            PromptItem::Token(token) => {
                let mut tokens = vec![token];
                ctx.enter("prompt", "an array of token ids (0..=4294967295)");
                while let Some(token) = seq.next_element()? {
                    tokens.push(token);
                }
                Prompt::Tokens(vec![tokens])
            }
            PromptItem::Tokens(tokens) => {
                let mut lists = vec![tokens];
                ctx.enter("prompt", "an array of token-id arrays (0..=4294967295)");
                while let Some(tokens) = seq.next_element()? {
                    lists.push(tokens);
                }
                Prompt::Tokens(lists)
            }
        };
        Ok(Some(prompt))
    }
}

enum PromptItem<'a> {
    Text(Cow<'a, str>),
    Token(u32),
    Tokens(Vec<u32>),
}

struct PromptItemSeed<'c>(&'c Ctx);

impl<'de> DeserializeSeed<'de> for PromptItemSeed<'_> {
    type Value = PromptItem<'de>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.0.enter("prompt", PROMPT_EXPECTED);
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PromptItemSeed<'_> {
    type Value = PromptItem<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(PROMPT_EXPECTED)
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(PromptItem::Text(Cow::Borrowed(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(PromptItem::Text(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(PromptItem::Text(Cow::Owned(v)))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        u32::try_from(v)
            .map(PromptItem::Token)
            .map_err(|_| E::invalid_value(de::Unexpected::Unsigned(v), &self))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        u32::try_from(v)
            .map(PromptItem::Token)
            .map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        self.0
            .enter("prompt", "an array of token-id arrays (0..=4294967295)");
        let mut tokens = Vec::new();
        while let Some(token) = seq.next_element()? {
            tokens.push(token);
        }
        Ok(PromptItem::Tokens(tokens))
    }
}

struct MessagesSeed<'c>(&'c Ctx);

impl<'de> DeserializeSeed<'de> for MessagesSeed<'_> {
    type Value = Vec<Message<'de>>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.0.enter("messages", "an array of message objects");
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for MessagesSeed<'_> {
    type Value = Vec<Message<'de>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of message objects")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut messages = Vec::new();
        while let Some(m) = seq.next_element_seed(MessageSeed(self.0))? {
            messages.push(m);
        }
        Ok(messages)
    }
}

struct MessageSeed<'c>(&'c Ctx);

impl<'de> DeserializeSeed<'de> for MessageSeed<'_> {
    type Value = Message<'de>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.0.enter("messages[]", "a message object");
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for MessageSeed<'_> {
    type Value = Message<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a message object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let ctx = self.0;
        let mut role = None;
        let mut name = None;
        let mut content = Content::Absent;
        let mut tool_calls = None;
        let mut tool_call_id = None;
        while let Some(Str(key)) = map.next_key()? {
            match key.as_ref() {
                "role" => {
                    let r: Str<'de> = read(&mut map, ctx, "messages[].role", "a string")?;
                    role = Some(r.0);
                }
                "content" => content = map.next_value_seed(ContentSeed(ctx))?,
                "name" => name = read_str(&mut map, ctx, "messages[].name")?,
                "tool_call_id" => {
                    tool_call_id = read_str(&mut map, ctx, "messages[].tool_call_id")?
                }
                "tool_calls" => {
                    tool_calls = read(
                        &mut map,
                        ctx,
                        "messages[].tool_calls",
                        "an array of tool calls or null",
                    )?;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let role = role.ok_or_else(|| ctx.reject(ParseError::MissingField("messages[].role")))?;
        Ok(Message {
            role,
            name,
            content,
            tool_calls: tool_calls.unwrap_or_default(),
            tool_call_id,
        })
    }
}

struct ContentSeed<'c>(&'c Ctx);

const CONTENT_EXPECTED: &str = "a string, an array of content parts or null";

impl<'de> DeserializeSeed<'de> for ContentSeed<'_> {
    type Value = Content<'de>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.0.enter("messages[].content", CONTENT_EXPECTED);
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ContentSeed<'_> {
    type Value = Content<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(CONTENT_EXPECTED)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Content::Absent)
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Content::Text(Cow::Borrowed(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Content::Text(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(Content::Text(Cow::Owned(v)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut parts = Vec::new();
        while let Some(part) = seq.next_element_seed(PartSeed(self.0))? {
            parts.push(part);
        }
        Ok(Content::Parts(parts))
    }
}

struct PartSeed<'c>(&'c Ctx);

impl<'de> DeserializeSeed<'de> for PartSeed<'_> {
    type Value = Part<'de>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.0
            .enter("messages[].content[]", "a content part object");
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for PartSeed<'_> {
    type Value = Part<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a content part object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let ctx = self.0;
        let mut kind = None;
        let mut text = None;
        // Summed per field so the digest does not depend on the order of the fields.
        let mut digest = 0u64;
        while let Some(Str(key)) = map.next_key()? {
            match key.as_ref() {
                "type" => {
                    let k: Str<'de> = read(&mut map, ctx, "messages[].content[].type", "a string")?;
                    kind = Some(k.0);
                }
                "text" => text = read_str(&mut map, ctx, "messages[].content[].text")?,
                _ => {
                    let raw: &'de RawValue = map.next_value()?;
                    let field_seed = xxh3_64(key.as_bytes());
                    digest =
                        digest.wrapping_add(xxh3_64_with_seed(raw.get().as_bytes(), field_seed));
                }
            }
        }
        let kind =
            kind.ok_or_else(|| ctx.reject(ParseError::MissingField("messages[].content[].type")))?;
        if kind != "text" {
            return Ok(Part::Other { kind, digest });
        }
        let text =
            text.ok_or_else(|| ctx.reject(ParseError::MissingField("messages[].content[].text")))?;
        Ok(Part::Text(text))
    }
}
