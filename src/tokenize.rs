//! Exact token ids for text prompts, from the engine's own tokenizer (`POST /tokenize`, as
//! vLLM and SGLang serve it): the request this filter sends, and reading the answer.
//!
//! With token ids a text or chat prompt hashes exactly like the engine's blocks, which is
//! what lets the engines' KV events (precise mode) match it. A prompt that needs no
//! tokenizing (already token ids) or cannot be tokenized as one (a batch) gets no call.

use crate::request::ApiKind;
use serde_json::{Map, Value};

/// The body of the tokenize call for a request, or `None` when the request has nothing to
/// tokenize (token ids, a batch of prompts) or is not a JSON object.
pub fn request_body(kind: ApiKind, body: &[u8]) -> Option<Vec<u8>> {
    let Value::Object(req) = serde_json::from_slice::<Value>(body).ok()? else {
        return None;
    };
    let mut out = Map::new();
    if let Some(m) = req.get("model").filter(|m| m.is_string()) {
        out.insert("model".into(), m.clone());
    }
    match kind {
        ApiKind::Completions => {
            // One text prompt (or a batch of exactly one); ids and batches are left alone.
            let text = match req.get("prompt")? {
                Value::String(s) => s.clone(),
                Value::Array(a) if a.len() == 1 => a.first()?.as_str()?.to_string(),
                _ => return None,
            };
            out.insert("prompt".into(), Value::String(text));
        }
        ApiKind::ChatCompletions => {
            let msgs = req.get("messages").filter(|m| m.is_array())?;
            out.insert("messages".into(), msgs.clone());
            if let Some(t) = req.get("tools").filter(|t| !t.is_null()) {
                out.insert("tools".into(), t.clone());
            }
            // The prompt a chat completion prefills ends with the assistant's turn header.
            out.insert("add_generation_prompt".into(), Value::Bool(true));
        }
    }
    serde_json::to_vec(&Value::Object(out)).ok()
}

/// The token ids of a tokenize answer (`{"tokens": [..], ...}`), or `None` if it has none or
/// any id is not a u32.
pub fn parse_tokens(body: &[u8]) -> Option<Vec<u32>> {
    #[derive(serde::Deserialize)]
    struct Answer {
        tokens: Vec<u32>,
    }
    let a: Answer = serde_json::from_slice(body).ok()?;
    (!a.tokens.is_empty()).then_some(a.tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn json(b: &[u8]) -> Value {
        serde_json::from_slice(b).unwrap()
    }

    #[test]
    fn completion_text_is_tokenized_ids_and_batches_are_not() {
        let b = request_body(
            ApiKind::Completions,
            br#"{"model":"m","prompt":"hello","max_tokens":3,"stream":true}"#,
        )
        .unwrap();
        assert_eq!(json(&b), serde_json::json!({"model":"m","prompt":"hello"}));
        let one = request_body(ApiKind::Completions, br#"{"prompt":["hi"]}"#).unwrap();
        assert_eq!(json(&one), serde_json::json!({"prompt":"hi"}));
        for body in [
            &br#"{"model":"m","prompt":[1,2,3]}"#[..],
            br#"{"model":"m","prompt":["a","b"]}"#,
            br#"{"model":"m"}"#,
            br#"[1,2]"#,
            b"not json",
        ] {
            assert_eq!(request_body(ApiKind::Completions, body), None);
        }
    }

    #[test]
    fn chat_keeps_messages_and_tools_and_asks_for_the_generation_prompt() {
        let b = request_body(
            ApiKind::ChatCompletions,
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}],"temperature":0}"#,
        )
        .unwrap();
        assert_eq!(
            json(&b),
            serde_json::json!({"model":"m","messages":[{"role":"user","content":"x"}],
                "tools":[{"type":"function"}],"add_generation_prompt":true})
        );
        assert_eq!(
            request_body(ApiKind::ChatCompletions, br#"{"messages":"x"}"#),
            None
        );
    }

    #[test]
    fn answers_are_read_strictly() {
        assert_eq!(
            parse_tokens(br#"{"count":3,"max_model_len":8,"tokens":[1,2,4294967295]}"#),
            Some(vec![1, 2, u32::MAX])
        );
        for bad in [
            &br#"{"tokens":[]}"#[..],
            br#"{"tokens":[-1]}"#,
            br#"{"tokens":[4294967296]}"#,
            br#"{"count":3}"#,
            b"<html>",
        ] {
            assert_eq!(parse_tokens(bad), None);
        }
    }
}
