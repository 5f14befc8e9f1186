//! OpenAI request parsing (step 2 of the data flow).
//!
//! The body is read in one pass with hand-written serde visitors: strings borrow from the
//! body unless they contain escapes, parts we only need to identify stay `&RawValue`, and
//! unknown fields are skipped without building a DOM. Hand-written visitors (instead of
//! derived structs) are what lets every failure come back as a typed [`ParseError`] naming
//! the field, which the filter needs to log and to decide how to fall back.

mod de;
mod types;

pub use types::{ApiKind, Content, InferenceRequest, Message, ParseError, Part, Prompt};

use std::borrow::Cow;

use serde::de::IgnoredAny;
use serde::Deserializer as _;

/// Parses an OpenAI completions or chat completions body, borrowing from it.
pub fn parse(kind: ApiKind, body: &[u8]) -> Result<InferenceRequest<'_>, ParseError> {
    if !starts_with_object(body) {
        return Err(classify_non_object(body));
    }
    let ctx = de::Ctx::new();
    let mut reader = serde_json::Deserializer::from_slice(body);
    let fields = reader
        .deserialize_map(de::BodyVisitor::new(kind, &ctx))
        .and_then(|fields| reader.end().map(|()| fields))
        .map_err(|e| ctx.to_error(&e))?;
    build(kind, fields)
}

fn starts_with_object(body: &[u8]) -> bool {
    body.iter()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        .is_some_and(|&b| b == b'{')
}

/// Only reached on the error path, so a second scan to tell the two cases apart is fine.
fn classify_non_object(body: &[u8]) -> ParseError {
    match serde_json::from_slice::<IgnoredAny>(body) {
        Ok(_) => ParseError::NotAnObject,
        Err(e) => ParseError::InvalidJson {
            detail: e.to_string(),
        },
    }
}

fn build(kind: ApiKind, f: de::Fields<'_>) -> Result<InferenceRequest<'_>, ParseError> {
    let prompt = match kind {
        ApiKind::Completions => completion_prompt(f.prompt, f.prompt_embeds)?,
        ApiKind::ChatCompletions => {
            let messages = f.messages.ok_or(ParseError::MissingField("messages"))?;
            if messages.is_empty() {
                return Err(ParseError::Empty("messages"));
            }
            Prompt::Chat {
                messages,
                tools: f.tools.unwrap_or_default(),
            }
        }
    };
    let max_tokens = match kind {
        ApiKind::Completions => f.max_tokens,
        ApiKind::ChatCompletions => f.max_completion_tokens.or(f.max_tokens),
    };
    Ok(InferenceRequest {
        model: f.model.unwrap_or(Cow::Borrowed("")),
        skipped_parts: prompt.skipped_parts(),
        prompt,
        max_tokens,
        stream: f.stream.unwrap_or(false),
        include_usage: f.include_usage.unwrap_or(false),
        cache_salt: f.cache_salt,
        cache_key: f.prompt_cache_key,
    })
}

fn completion_prompt<'a>(
    prompt: Option<Prompt<'a>>,
    has_embeds: bool,
) -> Result<Prompt<'a>, ParseError> {
    // Hashing only the text of a request that also carries embeddings would claim a
    // shared prefix the worker does not have.
    if has_embeds {
        return Err(ParseError::Unsupported {
            field: "prompt_embeds",
            reason: "embedding inputs cannot be hashed",
        });
    }
    let prompt = prompt.ok_or(ParseError::MissingField("prompt"))?;
    let any_empty = match &prompt {
        Prompt::Text(texts) => texts.is_empty() || texts.iter().any(|t| t.is_empty()),
        Prompt::Tokens(lists) => lists.is_empty() || lists.iter().any(Vec::is_empty),
        Prompt::Chat { messages, .. } => messages.is_empty(),
    };
    if any_empty {
        return Err(ParseError::Empty("prompt"));
    }
    Ok(prompt)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn chat(body: &str) -> Result<InferenceRequest<'_>, ParseError> {
        parse(ApiKind::ChatCompletions, body.as_bytes())
    }

    fn completion(body: &str) -> Result<InferenceRequest<'_>, ParseError> {
        parse(ApiKind::Completions, body.as_bytes())
    }

    fn messages<'r, 'a>(req: &'r InferenceRequest<'a>) -> &'r [Message<'a>] {
        match &req.prompt {
            Prompt::Chat { messages, .. } => messages,
            other => panic!("not a chat prompt: {other:?}"),
        }
    }

    #[test]
    fn completion_string_prompt_borrows() {
        let req = completion(
            r#"{"model":"m","prompt":"hello","max_tokens":7,"stream":true,
                "stream_options":{"include_usage":true},"cache_salt":"s","extra":{"x":[1]},
                "prompt_cache_key":"k"}"#,
        )
        .unwrap();
        assert_eq!(req.model, "m");
        assert!(matches!(req.model, Cow::Borrowed(_)));
        match &req.prompt {
            Prompt::Text(t) => {
                assert_eq!(t.len(), 1);
                assert!(matches!(t[0], Cow::Borrowed("hello")));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(req.max_tokens, Some(7));
        assert!(req.stream);
        assert!(req.include_usage);
        assert_eq!(req.cache_salt.as_deref(), Some("s"));
        assert_eq!(req.cache_key.as_deref(), Some("k"));
        assert_eq!(req.skipped_parts, 0);
    }

    #[test]
    fn completion_defaults() {
        let req = completion(r#"{"prompt":"x","stream":null,"max_tokens":null}"#).unwrap();
        assert_eq!(req.model, "");
        assert_eq!(req.max_tokens, None);
        assert!(!req.stream);
        assert!(!req.include_usage);
        assert_eq!(req.cache_salt, None);
        assert_eq!(req.cache_key, None);
    }

    #[test]
    fn completion_list_of_strings() {
        let req = completion(r#"{"model":"m","prompt":["a","b\n","c"]}"#).unwrap();
        assert_eq!(
            req.prompt,
            Prompt::Text(vec!["a".into(), "b\n".into(), "c".into()])
        );
    }

    #[test]
    fn completion_token_ids() {
        let req = completion(r#"{"model":"m","prompt":[1,2,4294967295]}"#).unwrap();
        assert_eq!(req.prompt, Prompt::Tokens(vec![vec![1, 2, u32::MAX]]));
    }

    #[test]
    fn completion_token_id_lists() {
        let req = completion(r#"{"model":"m","prompt":[[1,2],[3]]}"#).unwrap();
        assert_eq!(req.prompt, Prompt::Tokens(vec![vec![1, 2], vec![3]]));
    }

    #[test]
    fn completion_ignores_chat_fields() {
        let req =
            completion(r#"{"prompt":"p","messages":5,"tools":"x","max_completion_tokens":-1}"#)
                .unwrap();
        assert_eq!(req.prompt, Prompt::Text(vec!["p".into()]));
    }

    #[test]
    fn chat_messages_and_tools() {
        let req = chat(
            r#"{"model":"m","tools":[{"type":"function","function":{"name":"f"}}],
            "messages":[
              {"role":"system","content":"be brief"},
              {"role":"user","name":"ann","content":[{"type":"text","text":"look"},
                 {"type":"image_url","image_url":{"url":"data:x"}},{"text":"here","type":"text"}]},
              {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function"}]},
              {"role":"tool","tool_call_id":"c1","content":"42"},
              {"role":"assistant"}
            ],"max_tokens":5,"max_completion_tokens":9}"#,
        )
        .unwrap();
        assert_eq!(req.max_tokens, Some(9));
        assert_eq!(req.skipped_parts, 1);
        let Prompt::Chat { messages, tools } = &req.prompt else {
            panic!()
        };
        assert_eq!(tools.len(), 1);
        assert_eq!(messages.len(), 5);
        assert_eq!(messages[0].role, "system");
        assert_eq!(messages[0].content, Content::Text("be brief".into()));
        assert_eq!(messages[1].name.as_deref(), Some("ann"));
        let Content::Parts(parts) = &messages[1].content else {
            panic!()
        };
        assert_eq!(parts.len(), 3);
        assert_eq!(parts[0], Part::Text("look".into()));
        assert!(matches!(&parts[1], Part::Other { kind, .. } if kind == "image_url"));
        assert_eq!(parts[2], Part::Text("here".into()));
        assert_eq!(messages[2].content, Content::Absent);
        assert_eq!(messages[2].tool_calls.len(), 1);
        assert_eq!(messages[3].tool_call_id.as_deref(), Some("c1"));
        assert_eq!(messages[4].content, Content::Absent);
        assert!(messages[4].tool_calls.is_empty());
    }

    #[test]
    fn chat_max_tokens_fallback_and_null_tools() {
        let req =
            chat(r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":3,"tools":null}"#)
                .unwrap();
        assert_eq!(req.max_tokens, Some(3));
        assert!(matches!(&req.prompt, Prompt::Chat { tools, .. } if tools.is_empty()));
    }

    #[test]
    fn skipped_parts_counted_across_messages() {
        let req = chat(
            r#"{"messages":[
              {"role":"user","content":[{"type":"input_audio","input_audio":{"data":"AAA"}},
                                        {"type":"image_url","image_url":{"url":"u"}}]},
              {"role":"user","content":[{"type":"file","file":{}},{"type":"text","text":"t"}]}]}"#,
        )
        .unwrap();
        assert_eq!(req.skipped_parts, 3);
    }

    #[test]
    fn different_images_get_different_digests() {
        let a = chat(r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"a"}}]}]}"#).unwrap();
        let b = chat(r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"b"}}]}]}"#).unwrap();
        assert_ne!(messages(&a)[0].content, messages(&b)[0].content);
    }

    #[test]
    fn escaped_strings_are_decoded() {
        let req = chat(r#"{"model":"m\u0031","messages":[{"role":"user","content":"a\nb\u00e9\ud83d\ude00\"\\"}]}"#)
            .unwrap();
        assert_eq!(req.model, "m1");
        assert_eq!(
            messages(&req)[0].content,
            Content::Text("a\nbé😀\"\\".into())
        );
    }

    #[test]
    fn escaped_keys_are_recognised() {
        let req = completion(r#"{"pr\u006fmpt":"x"}"#).unwrap();
        assert_eq!(req.prompt, Prompt::Text(vec!["x".into()]));
    }

    #[test]
    fn duplicate_keys_last_wins() {
        let req = completion(r#"{"prompt":"a","prompt":"b"}"#).unwrap();
        assert_eq!(req.prompt, Prompt::Text(vec!["b".into()]));
    }

    fn assert_err(res: Result<InferenceRequest<'_>, ParseError>, want: &ParseError, names: &str) {
        let err = res.expect_err("must fail");
        assert_eq!(&err, want);
        let shown = err.to_string();
        assert!(shown.contains(names), "{shown:?} does not name {names:?}");
    }

    fn wrong(field: &'static str) -> impl Fn(&ParseError) -> bool {
        move |e| matches!(e, ParseError::WrongType { field: f, .. } if *f == field)
    }

    fn assert_wrong(res: Result<InferenceRequest<'_>, ParseError>, field: &'static str) {
        let err = res.expect_err("must fail");
        assert!(
            wrong(field)(&err),
            "expected WrongType({field}), got {err:?}"
        );
        assert!(err.to_string().contains(field), "{err}");
    }

    #[test]
    fn invalid_json() {
        for body in [
            "",
            "{",
            "{\"prompt\":\"x\"",
            "{\"prompt\":\"x\"}x",
            "nul",
            "[1,",
            "{\"a\":tru}",
        ] {
            let err = completion(body).expect_err(body);
            assert!(
                matches!(err, ParseError::InvalidJson { .. }),
                "{body}: {err:?}"
            );
            assert!(err.to_string().contains("not valid JSON"));
        }
    }

    #[test]
    fn invalid_utf8_is_invalid_json() {
        let err = parse(ApiKind::Completions, b"{\"prompt\":\"\xff\"}").unwrap_err();
        assert!(matches!(err, ParseError::InvalidJson { .. }));
    }

    #[test]
    fn not_an_object() {
        for body in ["[]", "1", "\"s\"", " null ", "[{\"prompt\":\"x\"}]"] {
            assert_err(completion(body), &ParseError::NotAnObject, "object");
        }
    }

    #[test]
    fn missing_fields() {
        assert_err(
            completion("{}"),
            &ParseError::MissingField("prompt"),
            "prompt",
        );
        assert_err(
            completion(r#"{"prompt":null}"#),
            &ParseError::MissingField("prompt"),
            "prompt",
        );
        assert_err(
            chat(r#"{"prompt":"x"}"#),
            &ParseError::MissingField("messages"),
            "messages",
        );
        assert_err(
            chat(r#"{"messages":[{"content":"x"}]}"#),
            &ParseError::MissingField("messages[].role"),
            "messages[].role",
        );
        assert_err(
            chat(r#"{"messages":[{"role":"user","content":[{"text":"x"}]}]}"#),
            &ParseError::MissingField("messages[].content[].type"),
            "messages[].content[].type",
        );
        assert_err(
            chat(r#"{"messages":[{"role":"user","content":[{"type":"text"}]}]}"#),
            &ParseError::MissingField("messages[].content[].text"),
            "messages[].content[].text",
        );
    }

    #[test]
    fn empty_prompts() {
        for body in [
            r#"{"prompt":""}"#,
            r#"{"prompt":[]}"#,
            r#"{"prompt":["a",""]}"#,
            r#"{"prompt":[[1],[]]}"#,
        ] {
            assert_err(completion(body), &ParseError::Empty("prompt"), "prompt");
        }
        assert_err(
            chat(r#"{"messages":[]}"#),
            &ParseError::Empty("messages"),
            "messages",
        );
    }

    #[test]
    fn unsupported_prompt_embeds() {
        let err = completion(r#"{"prompt":"x","prompt_embeds":"AAAA"}"#).unwrap_err();
        assert!(matches!(
            err,
            ParseError::Unsupported {
                field: "prompt_embeds",
                ..
            }
        ));
        assert!(err.to_string().contains("prompt_embeds"));
        assert!(completion(r#"{"prompt":"x","prompt_embeds":null}"#).is_ok());
    }

    #[test]
    fn wrong_types() {
        assert_wrong(completion(r#"{"model":1,"prompt":"x"}"#), "model");
        assert_wrong(completion(r#"{"prompt":5}"#), "prompt");
        assert_wrong(completion(r#"{"prompt":{"a":1}}"#), "prompt");
        assert_wrong(completion(r#"{"prompt":[true]}"#), "prompt");
        assert_wrong(completion(r#"{"prompt":["a",1]}"#), "prompt");
        assert_wrong(completion(r#"{"prompt":[1,"a"]}"#), "prompt");
        assert_wrong(completion(r#"{"prompt":[1,[2]]}"#), "prompt");
        assert_wrong(completion(r#"{"prompt":[[1],2]}"#), "prompt");
        assert_wrong(completion(r#"{"prompt":"x","stream":"yes"}"#), "stream");
        assert_wrong(
            completion(r#"{"prompt":"x","stream_options":[]}"#),
            "stream_options",
        );
        assert_wrong(
            completion(r#"{"prompt":"x","stream_options":{"include_usage":1}}"#),
            "stream_options.include_usage",
        );
        assert_wrong(completion(r#"{"prompt":"x","cache_salt":7}"#), "cache_salt");
        let m = |rest: &str| format!(r#"{{"messages":[{{"role":"u",{rest}}}]}}"#);
        for (body, field) in [
            (r#"{"messages":{}}"#.to_string(), "messages"),
            (r#"{"messages":null}"#.to_string(), "messages"),
            (r#"{"messages":["hi"]}"#.to_string(), "messages[]"),
            (
                r#"{"messages":[{"role":null}]}"#.to_string(),
                "messages[].role",
            ),
            (m(r#""content":3"#), "messages[].content"),
            (m(r#""content":[3]"#), "messages[].content[]"),
            (m(r#""content":[{"type":1}]"#), "messages[].content[].type"),
            (
                m(r#""content":[{"type":"text","text":[]}]"#),
                "messages[].content[].text",
            ),
            (m(r#""name":1"#), "messages[].name"),
            (m(r#""tool_calls":{}"#), "messages[].tool_calls"),
            (m(r#""tool_call_id":[]"#), "messages[].tool_call_id"),
            (
                r#"{"messages":[{"role":"u"}],"tools":{}}"#.to_string(),
                "tools",
            ),
        ] {
            assert_wrong(chat(&body), field);
        }
    }

    #[test]
    fn out_of_range_numbers() {
        for v in [
            "-1",
            "4294967296",
            "1e3",
            "1.5",
            "\"5\"",
            "18446744073709551616",
        ] {
            let body = format!(r#"{{"prompt":"x","max_tokens":{v}}}"#);
            let err = completion(&body).expect_err(&body);
            // An integer too large even for u64 is rejected by the JSON reader itself.
            assert!(
                wrong("max_tokens")(&err) || matches!(err, ParseError::InvalidJson { .. }),
                "{body}: {err:?}"
            );
            let body = format!(r#"{{"messages":[{{"role":"u"}}],"max_completion_tokens":{v}}}"#);
            let err = chat(&body).expect_err(&body);
            assert!(
                wrong("max_completion_tokens")(&err)
                    || matches!(err, ParseError::InvalidJson { .. }),
                "{body}: {err:?}"
            );
        }
        for v in ["-1", "4294967296", "2.0"] {
            assert_wrong(completion(&format!(r#"{{"prompt":[1,{v}]}}"#)), "prompt");
            assert_wrong(completion(&format!(r#"{{"prompt":[{v}]}}"#)), "prompt");
            assert_wrong(completion(&format!(r#"{{"prompt":[[{v}]]}}"#)), "prompt");
        }
    }

    #[test]
    fn deeply_nested_junk() {
        let deep = "[".repeat(100_000);
        // In an ignored field: skipped without recursion, then the truncation is reported.
        let body = format!(r#"{{"prompt":"x","junk":{deep}}}"#);
        assert!(matches!(
            completion(&body),
            Err(ParseError::InvalidJson { .. })
        ));
        // Closed and ignored: fine.
        let body = format!(r#"{{"prompt":"x","junk":{deep}{}}}"#, "]".repeat(100_000));
        assert!(completion(&body).is_ok());
        // Where a value is built, serde_json's depth limit answers.
        let body = format!(
            r#"{{"messages":[{{"role":"u"}}],"tools":{deep}{}}}"#,
            "]".repeat(100_000)
        );
        assert!(matches!(chat(&body), Err(ParseError::InvalidJson { .. })));
        let body = format!(r#"{{"prompt":{deep}}}"#);
        assert!(completion(&body).is_err());
    }
}
