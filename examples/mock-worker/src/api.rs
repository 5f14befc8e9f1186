//! OpenAI request parsing, the chat template and the error object.
//!
//! Parsing goes through `serde_json::Value` rather than typed structs so that each wrong
//! field gets its own message and `param`, like vLLM's validation errors.

use serde_json::Value;

use crate::tokenizer;

/// An error answer in vLLM's shape: `{"error":{"message":..,"type":..,"param":..,"code":N}}`
/// where `code` is the HTTP status as an integer and `type` names the status class
/// (`BadRequestError`, `NotFoundError`, ...), serialized compactly in that key order as
/// FastAPI's `JSONResponse` writes pydantic's `ErrorResponse`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<&'static str>,
}

impl ApiError {
    pub fn bad(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "BadRequestError",
            param,
        }
    }
    pub fn not_found(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError {
            status: 404,
            message: message.into(),
            kind: "NotFoundError",
            param,
        }
    }
    /// Any other status; `kind` is the class name vLLM would use.
    pub fn other(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
        }
    }
    pub fn body(&self) -> String {
        format!(
            "{{\"error\":{{\"message\":{},\"type\":{},\"param\":{},\"code\":{}}}}}",
            Value::from(self.message.as_str()),
            Value::from(self.kind),
            self.param.map_or(Value::Null, Value::from),
            self.status
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Chat,
}

/// Everything the engine needs from a request body.
#[derive(Debug, Clone)]
pub struct Parsed {
    pub kind: Kind,
    pub model: Option<String>,
    pub tokens: Vec<u32>,
    pub max_tokens: usize,
    /// False when the body had neither `max_tokens` nor `max_completion_tokens`.
    pub max_tokens_given: bool,
    pub stream: bool,
    pub include_usage: bool,
    /// Seeds the block hash chain, like vLLM's `cache_salt`: equal prompts with different
    /// salts never share cache.
    pub cache_salt: Option<String>,
}

pub const DEFAULT_MAX_TOKENS: usize = 16;

/// Renders chat messages (and tools) into the prompt text.
///
/// Each earlier turn renders to the same bytes whatever follows it, so appending a turn keeps
/// the token prefix, which is what makes multi-turn chats hit the prefix cache.
pub fn render_chat(
    messages: &[Value],
    tools: Option<&Value>,
    add_generation_prompt: bool,
) -> Result<String, ApiError> {
    let mut out = String::new();
    if let Some(tools) = tools {
        if !tools.is_null() {
            if !tools.is_array() {
                return Err(ApiError::bad("'tools' must be an array", Some("tools")));
            }
            out.push_str("<|tools|>\n");
            out.push_str(&tools.to_string());
            out.push_str("<|end|>\n");
        }
    }
    for m in messages {
        let obj = m
            .as_object()
            .ok_or_else(|| ApiError::bad("each message must be an object", Some("messages")))?;
        let role = obj
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::bad("each message needs a string 'role'", Some("messages")))?;
        out.push_str("<|");
        out.push_str(role);
        out.push_str("|>\n");
        match obj.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => out.push_str(s),
            Some(Value::Array(parts)) => {
                for p in parts {
                    // Non-text parts (images, audio) have no text to cache here; skip them.
                    if p.get("type").and_then(Value::as_str) == Some("text") {
                        let t = p.get("text").and_then(Value::as_str).ok_or_else(|| {
                            ApiError::bad(
                                "a text content part needs a string 'text'",
                                Some("messages"),
                            )
                        })?;
                        out.push_str(t);
                    }
                }
            }
            Some(_) => {
                return Err(ApiError::bad(
                    "message 'content' must be a string or an array of parts",
                    Some("messages"),
                ))
            }
        }
        if let Some(tc) = obj.get("tool_calls").filter(|v| !v.is_null()) {
            out.push_str("<|tool_calls|>");
            out.push_str(&tc.to_string());
        }
        out.push_str("<|end|>\n");
    }
    if add_generation_prompt {
        out.push_str("<|assistant|>\n");
    }
    Ok(out)
}

fn token_list(v: &[Value]) -> Option<Vec<u32>> {
    v.iter()
        .map(|x| {
            x.as_u64()
                .filter(|&n| n <= u32::MAX as u64)
                .map(|n| n as u32)
        })
        .collect()
}

/// Tokens of a completions `prompt`. For a list of prompts only the first is served: the mock
/// answers a batch of one (one `choices` entry), and says so in its README.
fn completion_tokens(prompt: &Value) -> Result<Vec<u32>, ApiError> {
    let mut all = completion_prompts(prompt, false)?;
    Ok(all.swap_remove(0))
}

/// Every prompt of a completions `prompt` (`all`), or just the first; never empty.
pub fn completion_prompts(prompt: &Value, all: bool) -> Result<Vec<Vec<u32>>, ApiError> {
    let wrong = || {
        ApiError::bad("'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists", Some("prompt"))
    };
    let take = |n: usize| if all { n } else { 1 };
    match prompt {
        Value::String(s) => Ok(vec![tokenizer::encode(s)]),
        Value::Array(items) => match items.first() {
            None => Err(ApiError::bad("'prompt' must not be empty", Some("prompt"))),
            Some(Value::String(_)) => {
                if items.iter().all(Value::is_string) {
                    Ok(items
                        .iter()
                        .take(take(items.len()))
                        .map(|v| tokenizer::encode(v.as_str().unwrap_or("")))
                        .collect())
                } else {
                    Err(wrong())
                }
            }
            Some(Value::Number(_)) => Ok(vec![token_list(items).ok_or_else(wrong)?]),
            Some(Value::Array(_)) if items.iter().all(Value::is_array) => items
                .iter()
                .take(take(items.len()))
                .map(|v| v.as_array().and_then(|a| token_list(a)).ok_or_else(wrong))
                .collect(),
            Some(_) => Err(wrong()),
        },
        _ => Err(wrong()),
    }
}

fn opt_uint(
    obj: &serde_json::Map<String, Value>,
    key: &'static str,
) -> Result<Option<u64>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            ApiError::bad(format!("'{key}' must be a non-negative integer"), Some(key))
        }),
    }
}

fn opt_bool(
    obj: &serde_json::Map<String, Value>,
    key: &'static str,
) -> Result<Option<bool>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::bad(
            format!("'{key}' must be a boolean"),
            Some(key),
        )),
    }
}

/// Parses a request body. `chat` is `None` to detect it (the cache probe): a body with
/// `messages` is a chat.
pub fn parse(body: &[u8], chat: Option<bool>) -> Result<Parsed, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad(
            "request body is empty; expected a JSON object",
            None,
        ));
    }
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("invalid JSON body: {e}"), None))?;
    let obj = v
        .as_object()
        .ok_or_else(|| ApiError::bad("request body must be a JSON object", None))?;
    let is_chat = chat.unwrap_or_else(|| obj.contains_key("messages"));
    let model = match obj.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(ApiError::bad("'model' must be a string", Some("model"))),
    };
    let tokens = if is_chat {
        let msgs = match obj.get("messages") {
            None | Some(Value::Null) => {
                return Err(ApiError::bad("'messages' is required", Some("messages")))
            }
            Some(Value::Array(a)) if !a.is_empty() => a,
            Some(Value::Array(_)) => {
                return Err(ApiError::bad(
                    "'messages' must not be empty",
                    Some("messages"),
                ))
            }
            Some(_) => {
                return Err(ApiError::bad(
                    "'messages' must be an array",
                    Some("messages"),
                ))
            }
        };
        let gen = opt_bool(obj, "add_generation_prompt")?.unwrap_or(true);
        tokenizer::encode(&render_chat(msgs, obj.get("tools"), gen)?)
    } else {
        match obj.get("prompt") {
            None | Some(Value::Null) => {
                return Err(ApiError::bad("'prompt' is required", Some("prompt")))
            }
            Some(p) => completion_tokens(p)?,
        }
    };
    if tokens.is_empty() {
        return Err(ApiError::bad(
            "the prompt is empty",
            Some(if is_chat { "messages" } else { "prompt" }),
        ));
    }
    let mt = match opt_uint(obj, "max_completion_tokens")? {
        Some(n) => Some(n),
        None => opt_uint(obj, "max_tokens")?,
    };
    let max_tokens = match mt {
        Some(0) => {
            return Err(ApiError::bad(
                "'max_tokens' must be at least 1",
                Some("max_tokens"),
            ))
        }
        Some(n) => n.min(usize::MAX as u64 / 2) as usize,
        None => DEFAULT_MAX_TOKENS,
    };
    if let Some(n) = opt_uint(obj, "n")? {
        if n != 1 {
            return Err(ApiError::bad("only n=1 is supported", Some("n")));
        }
    }
    let stream = opt_bool(obj, "stream")?.unwrap_or(false);
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => opt_bool(o, "include_usage")?.unwrap_or(false),
        Some(_) => {
            return Err(ApiError::bad(
                "'stream_options' must be an object",
                Some("stream_options"),
            ))
        }
    };
    let cache_salt = match obj.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(ApiError::bad(
                "'cache_salt' must be a string",
                Some("cache_salt"),
            ))
        }
    };
    Ok(Parsed {
        kind: if is_chat {
            Kind::Chat
        } else {
            Kind::Completion
        },
        model,
        tokens,
        max_tokens,
        max_tokens_given: mt.is_some(),
        stream,
        include_usage,
        cache_salt,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(msgs: Value) -> Vec<u32> {
        parse(
            json!({"model": "m", "messages": msgs})
                .to_string()
                .as_bytes(),
            Some(true),
        )
        .unwrap()
        .tokens
    }

    #[test]
    fn appending_a_turn_keeps_the_token_prefix() {
        let one = json!([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there, how are you?"}]);
        let mut two = one.clone();
        two.as_array_mut()
            .unwrap()
            .push(json!({"role": "assistant", "content": " the of and"}));
        two.as_array_mut().unwrap().push(json!({"role": "user", "content": [{"type": "text", "text": "More please."}, {"type": "image_url", "image_url": {}}]}));
        let a = chat(one);
        let b = chat(two);
        // Everything before the generation prompt is shared.
        let gen = tokenizer::encode("<|assistant|>\n").len();
        assert!(b.len() > a.len());
        assert_eq!(&b[..a.len() - gen], &a[..a.len() - gen]);
        // And the generation prompt plus generated words re-tokenizes to the same ids, so the
        // assistant turn itself is shared too.
        assert_eq!(&b[..a.len()], &a[..]);
    }

    #[test]
    fn tools_are_rendered_first() {
        let body = json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]});
        let with = parse(body.to_string().as_bytes(), None).unwrap();
        assert_eq!(with.kind, Kind::Chat);
        let without = chat(json!([{"role": "user", "content": "x"}]));
        assert!(with.tokens.len() > without.len());
    }

    #[test]
    fn prompt_forms() {
        let p = |v: Value| parse(json!({"prompt": v}).to_string().as_bytes(), Some(false));
        assert_eq!(p(json!([1, 2, 3])).unwrap().tokens, vec![1, 2, 3]);
        assert_eq!(p(json!([[4, 5], [6]])).unwrap().tokens, vec![4, 5]);
        assert_eq!(
            p(json!(["a b", "c"])).unwrap().tokens,
            tokenizer::encode("a b")
        );
        assert!(p(json!([])).is_err());
        assert!(p(json!([1, "x"])).is_err());
        assert!(p(json!(5)).is_err());
        assert!(p(json!("")).is_err());
        assert_eq!(p(json!("hi")).unwrap().max_tokens, DEFAULT_MAX_TOKENS);
        assert!(parse(b"", None).is_err());
        assert!(parse(b"{", None).is_err());
        assert!(parse(br#"{"prompt":"x","max_tokens":"3"}"#, None).is_err());
    }

    #[test]
    fn error_body_is_vllms_byte_for_byte() {
        assert_eq!(
            ApiError::not_found("The model `x` does not exist.", Some("model")).body(),
            r#"{"error":{"message":"The model `x` does not exist.","type":"NotFoundError","param":"model","code":404}}"#
        );
        assert_eq!(
            ApiError::bad("bad \"q\"", None).body(),
            r#"{"error":{"message":"bad \"q\"","type":"BadRequestError","param":null,"code":400}}"#
        );
    }
}
