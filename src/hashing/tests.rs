//! Block hashing against its promises: chaining, prefix stability, chat canonical form,
//! token estimates; and properties over generated requests.

use super::*;
use crate::request::{parse, ApiKind};
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn chat_hashes(body: &str, p: &HashParams) -> PromptHashes {
    prompt_hashes(
        &parse(ApiKind::ChatCompletions, body.as_bytes()).unwrap(),
        p,
    )
}

fn completion_hashes(body: &str, p: &HashParams) -> PromptHashes {
    prompt_hashes(&parse(ApiKind::Completions, body.as_bytes()).unwrap(), p)
}

/// A request for model `m` with nothing but this prompt.
fn request(prompt: Prompt<'_>) -> InferenceRequest<'_> {
    InferenceRequest {
        model: "m".into(),
        prompt,
        max_tokens: None,
        stream: false,
        include_usage: false,
        cache_salt: None,
        cache_key: None,
        skipped_parts: 0,
    }
}

fn text_request(text: &str) -> InferenceRequest<'_> {
    request(Prompt::Text(vec![text.into()]))
}

const SMALL: HashParams = HashParams {
    block_size: 2,
    chars_per_token: 2.0,
};

#[test]
fn token_chain_matches_hand_reference() {
    let p = HashParams {
        block_size: 2,
        chars_per_token: 4.0,
    };
    let h = completion_hashes(r#"{"model":"m","prompt":[1,2,3,258,9]}"#, &p);
    let s = seed("m", None);
    let b0 = [1u8, 0, 0, 0, 2, 0, 0, 0];
    let b1 = [3u8, 0, 0, 0, 2, 1, 0, 0];
    let h0 = xxh3_64_with_seed(&b0, s);
    let l1 = xxh3_64_with_seed(&b1, s);
    let mut cat = h0.to_le_bytes().to_vec();
    cat.extend_from_slice(&l1.to_le_bytes());
    let h1 = xxh3_64_with_seed(&cat, s);
    assert_eq!(h.blocks, vec![h0, h1]);
    assert_eq!(h.est_tokens, 5);
    assert!(h.exact);
}

#[test]
fn relay_rekeying_reproduces_token_prompt_hashes() {
    let p = HashParams {
        block_size: 3,
        chars_per_token: 4.0,
    };
    let ids: Vec<u32> = (0..10).map(|i| i * 977 + 5).collect();
    let body = format!(r#"{{"model":"m","prompt":{ids:?},"cache_salt":"s"}}"#);
    let want = completion_hashes(&body, &p).blocks;
    let s = chain_seed("m", Some("s"));
    let mut parent = None;
    let mut got = Vec::new();
    for block in ids.chunks_exact(3) {
        let h = token_block_hash(parent, block, s);
        got.push(h);
        parent = Some(h);
    }
    assert_eq!(want.len(), 3);
    assert_eq!(got, want);
    assert_ne!(chain_seed("m", None), s);
}

#[test]
fn token_partial_tail_not_hashed_but_counted() {
    let p = HashParams::default();
    let ids: Vec<String> = (0..40).map(|i| i.to_string()).collect();
    let h = completion_hashes(&format!(r#"{{"prompt":[{}]}}"#, ids.join(",")), &p);
    assert_eq!(h.blocks.len(), 2);
    assert_eq!(h.est_tokens, 40);
    let short = completion_hashes(&format!(r#"{{"prompt":[{}]}}"#, ids[..32].join(",")), &p);
    assert_eq!(short.blocks, h.blocks);
    let tiny = completion_hashes(r#"{"prompt":[1,2,3]}"#, &p);
    assert!(tiny.blocks.is_empty());
    assert_eq!(tiny.est_tokens, 3);
}

#[test]
fn token_batch_hashes_first_counts_all() {
    let p = SMALL;
    let batch = completion_hashes(r#"{"prompt":[[1,2,3,4,5],[6,7,8]]}"#, &p);
    let single = completion_hashes(r#"{"prompt":[1,2,3,4,5]}"#, &p);
    assert_eq!(batch.blocks, single.blocks);
    assert_eq!(batch.blocks.len(), 2);
    assert_eq!(batch.est_tokens, 8);
}

#[test]
fn text_blocks_and_estimate() {
    // 16 tokens * 4 bytes = 64-byte blocks.
    let p = HashParams::default();
    let text = "x".repeat(130);
    let h = prompt_hashes(&text_request(&text), &p);
    assert_eq!(h.blocks.len(), 2);
    assert_eq!(h.est_tokens, 33);
    assert!(!h.exact);
    let s = seed("m", None);
    let h0 = xxh3_64_with_seed(&text.as_bytes()[..64], s);
    let l1 = xxh3_64_with_seed(&text.as_bytes()[64..128], s);
    assert_eq!(h.blocks, vec![h0, xxh3_64_with_seed(&pair(h0, l1), s)]);
}

#[test]
fn text_batch_hashes_first_counts_all() {
    let p = SMALL;
    let batch = completion_hashes(r#"{"model":"m","prompt":["abcdefghij","xyz"]}"#, &p);
    let single = prompt_hashes(&text_request("abcdefghij"), &p);
    assert_eq!(batch.blocks, single.blocks);
    assert_eq!(batch.est_tokens, 5 + 2);
}

#[test]
fn params_are_sanitised() {
    let odd = HashParams {
        block_size: 0,
        chars_per_token: f64::NAN,
    };
    assert_eq!(odd.tokens_per_block(), 1);
    assert_eq!(odd.text_block_bytes(), 4);
    let tiny = HashParams {
        block_size: 1,
        chars_per_token: 1e-9,
    };
    assert_eq!(tiny.text_block_bytes(), 1);
    assert_eq!(tiny.estimate_tokens(10), u32::MAX);
    let huge = HashParams {
        block_size: u32::MAX,
        chars_per_token: 1e9,
    };
    assert_eq!(huge.tokens_per_block(), 1 << 16);
    assert_eq!(huge.text_block_bytes(), MAX_BLOCK_BYTES);
    let fractional = HashParams {
        block_size: 16,
        chars_per_token: 3.7,
    };
    assert_eq!(fractional.text_block_bytes(), 59);
    assert_eq!(fractional.estimate_tokens(59), 16);
    // Hashing with degenerate parameters must not panic either.
    let body = r#"{"prompt":[1,2,3]}"#;
    assert_eq!(completion_hashes(body, &odd).blocks.len(), 3);
    assert!(completion_hashes(body, &huge).blocks.is_empty());
}

#[test]
fn escapes_hash_like_plain_text() {
    let p = SMALL;
    let escaped = completion_hashes(
        r#"{"model":"m","prompt":"line\none \u00e9t\u00E9 \ud83d\ude00 \"q\" \/"}"#,
        &p,
    );
    let plain = prompt_hashes(&text_request("line\none été 😀 \"q\" /"), &p);
    assert_eq!(escaped, plain);
    let a = chat_hashes(
        r#"{"messages":[{"role":"user","content":"caf\u00e9\n\ud83d\ude00"}]}"#,
        &p,
    );
    let b = chat_hashes(r#"{"messages":[{"role":"user","content":"café\n😀"}]}"#, &p);
    assert_eq!(a, b);
    assert!(!a.blocks.is_empty());
}

#[test]
fn tools_formatting_does_not_matter() {
    let p = SMALL;
    let a = chat_hashes(
        r#"{"tools":[{"type":"function","function":{"name":"f","parameters":{"a":1,"b":[true,null]}}}],
            "messages":[{"role":"user","content":"hi"},
              {"role":"assistant","tool_calls":[{"id":"1","function":{"name":"f","arguments":"{}"}}]}]}"#,
        &p,
    );
    let b = chat_hashes(
        r#"{ "messages" : [ {"content":"hi","role":"user"},
              {"tool_calls":[ { "function" : {"arguments":"{}","name":"f"} , "id":"1"}],"role":"assistant"}],
            "tools" : [ { "function" : { "parameters" : { "b" : [ true , null ] , "a" : 1 } , "name" : "\u0066" } ,
              "type" : "function" } ] }"#,
        &p,
    );
    assert_eq!(a, b);
    let c = chat_hashes(
        r#"{"tools":[{"type":"function","function":{"name":"g"}}],
            "messages":[{"role":"user","content":"hi"}]}"#,
        &p,
    );
    assert_ne!(a.blocks, c.blocks);
}

#[test]
fn tools_come_first() {
    let p = SMALL;
    let with = chat_hashes(
        r#"{"tools":[{"name":"t"}],"messages":[{"role":"user","content":"hello world"}]}"#,
        &p,
    );
    let without = chat_hashes(
        r#"{"messages":[{"role":"user","content":"hello world"}]}"#,
        &p,
    );
    assert_ne!(with.blocks.first(), without.blocks.first());
    let empty_tools = chat_hashes(
        r#"{"tools":[],"messages":[{"role":"user","content":"hello world"}]}"#,
        &p,
    );
    assert_eq!(empty_tools, without);
}

#[test]
fn model_and_salt_change_hashes() {
    let p = SMALL;
    let base = completion_hashes(r#"{"model":"a","prompt":"some prompt text"}"#, &p);
    let model = completion_hashes(r#"{"model":"b","prompt":"some prompt text"}"#, &p);
    let salt = completion_hashes(
        r#"{"model":"a","prompt":"some prompt text","cache_salt":"s"}"#,
        &p,
    );
    let empty_salt = completion_hashes(
        r#"{"model":"a","prompt":"some prompt text","cache_salt":""}"#,
        &p,
    );
    assert!(!base.blocks.is_empty());
    for other in [&model, &salt, &empty_salt] {
        assert!(other.blocks.iter().all(|h| !base.blocks.contains(h)));
    }
    assert_ne!(salt.blocks, empty_salt.blocks);
    assert_ne!(seed("ab", None), seed("a", Some("b")));
    assert_ne!(seed("a", Some("")), seed("a", None));
    let tokens = completion_hashes(r#"{"model":"a","prompt":[1,2,3,4]}"#, &p);
    let tokens_salted =
        completion_hashes(r#"{"model":"a","prompt":[1,2,3,4],"cache_salt":"s"}"#, &p);
    assert_ne!(tokens.blocks, tokens_salted.blocks);
}

#[test]
fn turn_boundaries_are_unambiguous() {
    let p = HashParams {
        block_size: 1,
        chars_per_token: 1.0,
    };
    let one = chat_hashes(r#"{"messages":[{"role":"user","content":"ab"}]}"#, &p);
    let two = chat_hashes(
        r#"{"messages":[{"role":"user","content":"a"},{"role":"user","content":"b"}]}"#,
        &p,
    );
    let parts = chat_hashes(
        r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#,
        &p,
    );
    let name = chat_hashes(r#"{"messages":[{"role":"user","name":"ab"}]}"#, &p);
    let role = chat_hashes(r#"{"messages":[{"role":"userab"}]}"#, &p);
    let all = [&one, &two, &parts, &name, &role];
    for (i, a) in all.iter().enumerate() {
        for b in &all[i + 1..] {
            assert_ne!(a.blocks, b.blocks);
        }
    }
}

#[test]
fn equivalent_content_forms_hash_alike() {
    let p = SMALL;
    let text = chat_hashes(r#"{"messages":[{"role":"user","content":"hello"}]}"#, &p);
    let part = chat_hashes(
        r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hello"}]}]}"#,
        &p,
    );
    assert_eq!(text, part);
    let null = chat_hashes(r#"{"messages":[{"role":"assistant","content":null}]}"#, &p);
    let missing = chat_hashes(r#"{"messages":[{"role":"assistant"}]}"#, &p);
    let empty = chat_hashes(r#"{"messages":[{"role":"assistant","content":""}]}"#, &p);
    let no_parts = chat_hashes(r#"{"messages":[{"role":"assistant","content":[]}]}"#, &p);
    assert_eq!(null, missing);
    assert_eq!(null, empty);
    assert_eq!(null, no_parts);
}

#[test]
fn images_are_told_apart() {
    let p = SMALL;
    let body = |url: &str| {
        format!(
            r#"{{"messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"{url}"}}}},{{"type":"text","text":"describe this"}}]}}]}}"#
        )
    };
    let a = chat_hashes(&body("a.png"), &p);
    let b = chat_hashes(&body("b.png"), &p);
    assert_ne!(a.blocks, b.blocks);
    assert_eq!(a, chat_hashes(&body("a.png"), &p));
}

#[test]
fn chat_turn_appended_keeps_prefix() {
    let p = SMALL;
    let short = chat_hashes(
        r#"{"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Hi there"}]}"#,
        &p,
    );
    let long = chat_hashes(
        r#"{"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Hi there"},
            {"role":"assistant","content":"Hello."},{"role":"user","content":"Bye"}]}"#,
        &p,
    );
    assert!(short.blocks.len() > 3);
    assert!(long.blocks.starts_with(&short.blocks));
    assert!(long.est_tokens > short.est_tokens);
}

#[test]
fn canonical_stream_format() {
    let req = parse(
        ApiKind::ChatCompletions,
        br#"{"tools":[{"b":1,"a":"x"}],"messages":[
            {"role":"user","name":"n","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{}}]},
            {"role":"assistant","tool_calls":[{"id":"c"}]},
            {"role":"tool","tool_call_id":"c","content":"ok"}]}"#,
    )
    .unwrap();
    let digest = match &req.prompt {
        Prompt::Chat { messages, .. } => match &messages[0].content {
            crate::request::Content::Parts(parts) => match &parts[1] {
                crate::request::Part::Other { digest, .. } => *digest,
                _ => panic!(),
            },
            _ => panic!(),
        },
        _ => panic!(),
    };
    let mut want = Vec::new();
    want.extend_from_slice(b"\x1d[{\"a\":\"x\",\"b\":1}]");
    want.extend_from_slice(b"\x1e\x01\x04user\x02\x01n\x04hi\xff\x05\x09image_url");
    want.extend_from_slice(&digest.to_le_bytes());
    want.extend_from_slice(b"\x1e\x01\x09assistant\x06[{\"id\":\"c\"}]");
    want.extend_from_slice(b"\x1e\x01\x04tool\x03\x01c\x04ok\xff");
    assert_eq!(canonical_stream(&req), want);
}

#[test]
fn long_lengths_use_several_varint_bytes() {
    let name = "y".repeat(300);
    let body = format!(r#"{{"messages":[{{"role":"u","name":"{name}"}}]}}"#);
    let req = parse(ApiKind::ChatCompletions, body.as_bytes()).unwrap();
    let stream = canonical_stream(&req);
    assert_eq!(&stream[..7], b"\x1e\x01\x01u\x02\xac\x02");
    assert_eq!(stream.len(), 7 + 300);
}

/// RAG and document Q&A put the document and the question in one user message; the engine
/// caches the document's KV for every question, so its blocks must hash the same.
#[test]
fn messages_that_start_with_the_same_document_share_its_blocks() {
    let p = HashParams::default();
    let doc = "lorem ipsum dolor sit amet ".repeat(200);
    let ask = |q: &str| {
        let body = format!(
            r#"{{"messages":[{{"role":"system","content":"Answer briefly."}},
                {{"role":"user","content":"Document: {doc}\nQuestion: {q}"}}]}}"#
        );
        prompt_hashes(
            &parse(ApiKind::ChatCompletions, body.as_bytes()).unwrap(),
            &p,
        )
    };
    let long_question = "and what happened after that, in detail? ".repeat(8);
    let (a, b) = (ask("who?"), ask(&long_question));
    let doc_blocks = doc.len() / (p.block_size as usize * 4);
    let shared = a
        .blocks
        .iter()
        .zip(&b.blocks)
        .take_while(|(x, y)| x == y)
        .count();
    assert!(shared + 1 >= doc_blocks, "{shared} of {doc_blocks}");
    assert!(
        b.blocks.len() > shared + 2,
        "the question's own blocks differ"
    );
}

#[test]
fn chat_estimate_counts_stream_bytes() {
    let p = HashParams::default();
    let req = parse(
        ApiKind::ChatCompletions,
        br#"{"messages":[{"role":"user","content":"0123456789"}]}"#,
    )
    .unwrap();
    let n = canonical_stream(&req).len();
    assert_eq!(prompt_hashes(&req, &p).est_tokens, p.estimate_tokens(n));
}

#[cfg(not(target_arch = "wasm32"))]
mod props {
    use super::*;
    use crate::request::{parse, ApiKind, Content, Message, Part};
    use proptest::prelude::*;
    use serde_json::{json, Value};
    use std::borrow::Cow;

    /// The chain written the obvious way, over a whole buffer.
    fn reference_blocks(stream: &[u8], block: usize, seed: u64) -> Vec<u64> {
        let mut out: Vec<u64> = Vec::new();
        for chunk in stream.chunks_exact(block) {
            let local = xxh3_64_with_seed(chunk, seed);
            let hash = match out.last() {
                None => local,
                Some(&parent) => {
                    let mut cat = parent.to_le_bytes().to_vec();
                    cat.extend_from_slice(&local.to_le_bytes());
                    xxh3_64_with_seed(&cat, seed)
                }
            };
            out.push(hash);
        }
        out
    }

    fn text() -> impl Strategy<Value = String> {
        prop_oneof!["[a-c]{0,12}", "\\PC{0,20}", "[\\x00-\\x1f\"\\\\]{0,6}",]
    }

    fn part() -> impl Strategy<Value = Part<'static>> {
        prop_oneof![
            3 => text().prop_map(|t| Part::Text(Cow::Owned(t))),
            1 => ("[a-z_]{1,10}", any::<u64>())
                .prop_map(|(kind, digest)| Part::Other { kind: Cow::Owned(kind), digest }),
        ]
    }

    fn message() -> impl Strategy<Value = Message<'static>> {
        let content = prop_oneof![
            Just(Content::Absent),
            text().prop_map(|t| Content::Text(Cow::Owned(t))),
            prop::collection::vec(part(), 0..4).prop_map(Content::Parts),
        ];
        (
            prop::sample::select(vec!["system", "user", "assistant", "tool"]),
            prop::option::of("[a-z]{0,5}"),
            content,
            prop::collection::vec(json_value(), 0..2),
            prop::option::of("[a-z0-9]{0,5}"),
        )
            .prop_map(|(role, name, content, tool_calls, tool_call_id)| Message {
                role: Cow::Borrowed(role),
                name: name.map(Cow::Owned),
                content,
                tool_calls,
                tool_call_id: tool_call_id.map(Cow::Owned),
            })
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let key = prop_oneof![
            prop::sample::select(vec![
                "model",
                "prompt",
                "messages",
                "role",
                "content",
                "type",
                "text",
                "tools",
                "tool_calls",
                "name",
                "max_tokens",
                "max_completion_tokens",
                "stream",
                "stream_options",
                "include_usage",
                "cache_salt",
                "tool_call_id",
                "image_url",
                "prompt_embeds",
            ])
            .prop_map(String::from),
            "[a-z]{0,4}",
        ];
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            (0u32..40).prop_map(Value::from),
            prop::sample::select(vec!["user", "text", "image_url", ""]).prop_map(Value::from),
            text().prop_map(Value::from),
        ];
        leaf.prop_recursive(5, 48, 6, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::vec((key.clone(), inner), 0..6)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    fn chat_request(
        messages: Vec<Message<'static>>,
        tools: Vec<Value>,
    ) -> InferenceRequest<'static> {
        request(Prompt::Chat { messages, tools })
    }

    fn params() -> impl Strategy<Value = HashParams> {
        (1u32..5, 0.5f64..5.0).prop_map(|(block_size, chars_per_token)| HashParams {
            block_size,
            chars_per_token,
        })
    }

    proptest! {
        #[test]
        fn chat_prefix_hashes_are_prefixes(
            messages in prop::collection::vec(message(), 1..8),
            tools in prop::collection::vec(json_value(), 0..2),
            p in params(),
        ) {
            let full = prompt_hashes(&chat_request(messages.clone(), tools.clone()), &p);
            let full_stream = canonical_stream(&chat_request(messages.clone(), tools.clone()));
            for n in 1..messages.len() {
                let req = chat_request(messages[..n].to_vec(), tools.clone());
                let stream = canonical_stream(&req);
                prop_assert!(full_stream.starts_with(&stream));
                let prefix = prompt_hashes(&req, &p);
                // Blocks wholly before the boundary are exactly the prefix's blocks.
                let whole = stream.len() / p.text_block_bytes();
                prop_assert_eq!(prefix.blocks.len(), whole);
                prop_assert_eq!(&full.blocks[..whole], &prefix.blocks[..]);
            }
        }

        #[test]
        fn chat_hashes_equal_reference_over_stream(
            messages in prop::collection::vec(message(), 1..6),
            tools in prop::collection::vec(json_value(), 0..2),
            p in params(),
        ) {
            let req = chat_request(messages, tools);
            let stream = canonical_stream(&req);
            let s = seed("m", None);
            prop_assert_eq!(
                prompt_hashes(&req, &p).blocks,
                reference_blocks(&stream, p.text_block_bytes(), s)
            );
        }

        #[test]
        fn streamed_segments_equal_whole(
            data in prop::collection::vec(any::<u8>(), 0..600),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..20),
            block in 1usize..70,
            s in any::<u64>(),
        ) {
            let mut at: Vec<usize> = cuts.iter().map(|i| i.index(data.len() + 1)).collect();
            at.sort_unstable();
            let mut chain = Chain::new(s, block, 0, usize::MAX);
            let mut start = 0;
            for &end in &at {
                chain.put(&data[start..end]);
                start = end;
            }
            chain.put(&data[start..]);
            prop_assert_eq!(chain.fed, data.len());
            let mut whole = Chain::new(s, block, 0, usize::MAX);
            whole.put(&data);
            let streamed = chain.into_blocks();
            prop_assert_eq!(&streamed, &whole.into_blocks());
            prop_assert_eq!(streamed, reference_blocks(&data, block, s));
        }

        #[test]
        fn token_hashes_equal_reference(
            tokens in prop::collection::vec(any::<u32>(), 1..100),
            p in params(),
        ) {
            let req = request(Prompt::Tokens(vec![tokens.clone()]));
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            prop_assert_eq!(&canonical_stream(&req), &bytes);
            let h = prompt_hashes(&req, &p);
            prop_assert_eq!(h.blocks, reference_blocks(&bytes, p.tokens_per_block() * 4, seed("m", None)));
            prop_assert_eq!(h.est_tokens as usize, tokens.len());
        }

        #[test]
        fn parse_never_panics_on_bytes(body in prop::collection::vec(any::<u8>(), 0..200)) {
            for kind in [ApiKind::Completions, ApiKind::ChatCompletions] {
                if let Ok(req) = parse(kind, &body) {
                    let _ = prompt_hashes(&req, &HashParams::default());
                }
            }
        }

        #[test]
        fn parse_never_panics_on_json(v in json_value(), body_fields in json_value()) {
            let mut bodies = vec![v.to_string()];
            // Objects with the fields the parser reads, holding arbitrary values.
            if let Value::Object(fields) = body_fields {
                let mut with_required = fields.clone();
                with_required.entry("messages").or_insert(json!([{"role": "user", "content": v.clone()}]));
                with_required.entry("prompt").or_insert(v.clone());
                bodies.push(Value::Object(fields).to_string());
                bodies.push(Value::Object(with_required).to_string());
            }
            for body in &bodies {
                for kind in [ApiKind::Completions, ApiKind::ChatCompletions] {
                    if let Ok(req) = parse(kind, body.as_bytes()) {
                        let h = prompt_hashes(&req, &HashParams::default());
                        prop_assert!(h.est_tokens > 0 || !matches!(req.prompt, Prompt::Tokens(_)));
                    }
                }
            }
        }

        #[test]
        fn parsed_chat_roundtrips_through_json(
            messages in prop::collection::vec(message(), 1..5),
            p in params(),
        ) {
            // Rendering the generated chat as JSON and parsing it back hashes identically,
            // whatever the escapes serde_json chose.
            let json_messages: Vec<Value> = messages.iter().map(message_json).collect();
            let body = json!({"model": "m", "messages": json_messages}).to_string();
            let parsed = parse(ApiKind::ChatCompletions, body.as_bytes()).unwrap();
            let direct = chat_request(messages.iter().map(normalised).collect(), Vec::new());
            prop_assert_eq!(prompt_hashes(&parsed, &p), prompt_hashes(&direct, &p));
        }
    }

    // Generated `Other` parts carry a digest that JSON cannot express, so the round trip
    // replaces them with text. Floats are dropped from tool calls: without its
    // `float_roundtrip` feature serde_json may read a printed float back one ulp off.
    fn normalised(m: &Message<'static>) -> Message<'static> {
        let mut m = m.clone();
        m.tool_calls.iter_mut().for_each(drop_floats);
        if let Content::Parts(parts) = &mut m.content {
            for part in parts.iter_mut() {
                if let Part::Other { kind, .. } = part {
                    *part = Part::Text(kind.clone());
                }
            }
        }
        m
    }

    fn drop_floats(v: &mut Value) {
        match v {
            Value::Number(n) if n.is_f64() => *v = Value::Null,
            Value::Array(items) => items.iter_mut().for_each(drop_floats),
            Value::Object(map) => map.values_mut().for_each(drop_floats),
            _ => {}
        }
    }

    fn message_json(m: &Message<'static>) -> Value {
        let m = normalised(m);
        let content = match &m.content {
            Content::Absent => Value::Null,
            Content::Text(t) => json!(t),
            Content::Parts(parts) => Value::Array(
                parts
                    .iter()
                    .map(|p| match p {
                        Part::Text(t) => json!({"type": "text", "text": t}),
                        Part::Other { .. } => unreachable!(),
                    })
                    .collect(),
            ),
        };
        let mut v = json!({"role": m.role, "content": content, "tool_calls": m.tool_calls});
        if let Some(name) = &m.name {
            v["name"] = json!(name);
        }
        if let Some(id) = &m.tool_call_id {
            v["tool_call_id"] = json!(id);
        }
        v
    }
}
