//! End-to-end tests against in-process workers on random 127.0.0.1 ports.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

fn stream_body(prompt: &str, max_tokens: usize) -> String {
    json!({"model": "mock-model", "prompt": prompt, "max_tokens": max_tokens, "stream": true,
           "stream_options": {"include_usage": true}})
    .to_string()
}

fn last_usage(r: &Resp) -> Value {
    let (chunks, done) = r.sse();
    assert!(done, "stream must end with [DONE]");
    chunks.last().unwrap()["usage"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_prompt_hits_cache_and_lowers_ttft() {
    // About 7000 tokens: a cold prefill pass models ~150 ms, a cached one ~17 ms.
    let w = worker("--speedup 4 --enable-prompt-tokens-details").await;
    let prompt = text(1, 6000);
    let a = post(w.addr, "/v1/completions", &stream_body(&prompt, 4), &[]).await;
    let b = post(w.addr, "/v1/completions", &stream_body(&prompt, 4), &[]).await;
    let (ua, ub) = (last_usage(&a), last_usage(&b));
    assert_eq!(ua["prompt_tokens"], ub["prompt_tokens"]);
    let n = ua["prompt_tokens"].as_u64().unwrap();
    assert!(n > 6000, "prompt_tokens {n}");
    assert_eq!(ua["prompt_tokens_details"]["cached_tokens"], 0);
    let cached = ub["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0 && cached >= n - 16, "cached {cached} of {n}");
    // The engine's own TTFT (immune to this machine's load): the cold prefill models ~150 ms
    // at speedup 4 ~ 38 ms, the cached one (the last few tokens) ~17 ms / 4.
    let (ta, tb) = (engine_timing(&a).unwrap().0, engine_timing(&b).unwrap().0);
    assert!(
        tb + 0.02 < ta,
        "cached TTFT {tb} should be well below cold TTFT {ta}"
    );
    assert_eq!(a.header("x-worker-id"), Some(w.name.as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_turn_chat_reuses_earlier_turns() {
    let w = worker("--speedup 50 --enable-prompt-tokens-details").await;
    let mut messages = vec![
        json!({"role": "system", "content": text(2, 300)}),
        json!({"role": "user", "content": "Summarise."}),
    ];
    let r1 = post(
        w.addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 40}).to_string(),
        &[],
    )
    .await;
    let j1 = r1.json();
    let answer = j1["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let p1 = j1["usage"]["prompt_tokens"].as_u64().unwrap();
    messages.push(json!({"role": "assistant", "content": answer}));
    messages.push(json!({"role": "user", "content": [{"type": "text", "text": "Shorter."}]}));
    let r2 = post(
        w.addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 4}).to_string(),
        &[],
    )
    .await;
    let cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // The first turn's prompt and most of the generated answer are served from cache.
    assert!(
        cached >= (p1 + 40) / 16 * 16 - 16,
        "cached {cached}, first prompt {p1}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_beyond_max_num_seqs_queues_and_raises_ttft() {
    // A wave of four takes 50 decode passes of ~0.57 ms, so queueing dominates connection
    // setup noise.
    let w = worker("--speedup 10 --max-num-seqs 4").await;
    let mut tasks = vec![];
    for i in 0..16 {
        let addr = w.addr;
        tasks.push(tokio::spawn(async move {
            post(
                addr,
                "/v1/completions",
                &stream_body(&text(100 + i, 60), 50),
                &[],
            )
            .await
        }));
    }
    let mut ttfts = vec![];
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200);
        // The engine's own TTFT: exact whatever else runs on this machine.
        ttfts.push(engine_timing(&r).unwrap().0);
    }
    ttfts.sort_by(f64::total_cmp);
    // Four run at once; the last ones wait for earlier waves of 50 decode passes each.
    assert!(ttfts[15] > ttfts[3] * 2.0, "ttfts {ttfts:?}");
    assert!(
        ttfts[15] - ttfts[0] > 2.0 * 50.0 * 0.000574,
        "ttfts {ttfts:?}"
    );
    let m = get(w.addr, "/metrics").await.body;
    assert_eq!(metric(&m, "vllm:request_success_total"), 16.0);
    assert_eq!(metric(&m, "vllm:time_to_first_token_seconds_count"), 16.0);
    assert_eq!(metric(&m, "vllm:generation_tokens_total"), 16.0 * 50.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_orca_on_streams_agrees_with_state() {
    // Four long requests occupy every slot; the rest queue and stay queued while we look.
    let w = worker("--speedup 1 --max-num-seqs 4 --orca-on-stream --preset legacy").await;
    let mut hold = vec![];
    for i in 0..10 {
        let addr = w.addr;
        hold.push(tokio::spawn(async move {
            post(
                addr,
                "/v1/completions",
                &stream_body(&text(200 + i, 50), 100_000),
                &[],
            )
            .await
        }));
    }
    // Let the first pass admit four.
    for _ in 0..100 {
        let l = w.shared.load();
        if l.running == 4 && l.waiting == 6 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let addr = w.addr;
    let probe_req = tokio::spawn(async move {
        post(
            addr,
            "/v1/completions",
            &stream_body("one more", 100_000),
            &[("endpoint-load-metrics-format", "TEXT")],
        )
        .await
    });
    // The streaming response's headers arrive at once; the request is still queued, so read
    // the header through a second, short-lived request instead of waiting for the stream.
    let json_req = {
        let addr = w.addr;
        tokio::spawn(async move {
            let c =
                hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                    .build_http::<http_body_util::Full<bytes::Bytes>>();
            let req = hyper::Request::post(format!("http://{addr}/v1/completions"))
                .header("endpoint-load-metrics-format", "JSON")
                .body(http_body_util::Full::new(bytes::Bytes::from(stream_body(
                    "and another",
                    100_000,
                ))))
                .unwrap();
            let r = c.request(req).await.unwrap();
            r.headers()["endpoint-load-metrics"]
                .to_str()
                .unwrap()
                .to_string()
        })
    };
    let orca_json = json_req.await.unwrap();
    let m = get(w.addr, "/metrics").await.body;
    let v: Value = serde_json::from_str(orca_json.strip_prefix("JSON ").unwrap()).unwrap();
    let nm = &v["named_metrics"];
    let waiting = metric(&m, "vllm:num_requests_waiting");
    assert!(waiting >= 7.0, "metrics waiting {waiting}");
    assert_eq!(
        nm["num_requests_running"].as_f64().unwrap(),
        metric(&m, "vllm:num_requests_running")
    );
    assert_eq!(metric(&m, "vllm:num_requests_running"), 4.0);
    // The JSON request was the 12th or the 11th to queue, depending on the TEXT one.
    let w_json = nm["num_requests_waiting"].as_f64().unwrap();
    assert!(
        w_json == waiting || w_json == waiting - 1.0,
        "header {w_json} vs metrics {waiting}"
    );
    let kv = nm["kv_cache_usage_perc"].as_f64().unwrap();
    assert!(
        kv > 0.0 && (kv - metric(&m, "vllm:kv_cache_usage_perc")).abs() < 0.001,
        "kv {kv}"
    );
    assert!(m.contains("vllm:cache_config_info{block_size=\"16\",enable_prefix_caching=\"True\",engine=\"0\",model_name=\"mock-model\",num_gpu_blocks=\"16384\"} 1"));
    probe_req.abort();
    for h in hold {
        h.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orca_text_format_on_a_finished_request() {
    let w = worker("--speedup 50").await;
    let body = r#"{"prompt":"hello there","max_tokens":2}"#;
    let r = post(
        w.addr,
        "/v1/completions",
        body,
        &[("endpoint-load-metrics-format", "TEXT")],
    )
    .await;
    // vLLM's report: waiting then KV usage, Python floats, ", " between them.
    assert_eq!(
        r.header("endpoint-load-metrics"),
        Some("TEXT named_metrics.num_requests_waiting=0.0, named_metrics.kv_cache_usage_perc=0.0")
    );
    let j = post(
        w.addr,
        "/v1/chat/completions",
        r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#,
        &[("endpoint-load-metrics-format", "json")],
    )
    .await;
    assert_eq!(
        j.header("endpoint-load-metrics"),
        Some(
            r#"JSON {"named_metrics": {"num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.0}}"#
        )
    );
    let plain = post(w.addr, "/v1/completions", body, &[]).await;
    assert!(plain.header("endpoint-load-metrics").is_none());
    // vLLM attaches no report to a streaming response.
    let s = post(
        w.addr,
        "/v1/completions",
        &stream_body("hello there", 2),
        &[("endpoint-load-metrics-format", "TEXT")],
    )
    .await;
    assert_eq!(s.status, 200);
    assert!(s.header("endpoint-load-metrics").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orca_reports_load_at_completion_of_a_non_streaming_request() {
    // Two long streams hold KV; a short non-streaming request reports the load it saw when it
    // finished: the streams' blocks in KV usage, nothing waiting, no running count.
    let w = worker("--speedup 10").await;
    let mut hold = vec![];
    for i in 0..2 {
        let addr = w.addr;
        hold.push(tokio::spawn(async move {
            post(
                addr,
                "/v1/completions",
                &stream_body(&text(300 + i, 400), 100_000),
                &[],
            )
            .await
        }));
    }
    for _ in 0..200 {
        if w.shared.load().running == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let r = post(
        w.addr,
        "/v1/completions",
        r#"{"prompt":"short","max_tokens":1}"#,
        &[("endpoint-load-metrics-format", "TEXT")],
    )
    .await;
    let h = r.header("endpoint-load-metrics").unwrap().to_string();
    assert!(
        h.starts_with(
            "TEXT named_metrics.num_requests_waiting=0.0, named_metrics.kv_cache_usage_perc="
        ),
        "{h}"
    );
    let kv: f64 = h.rsplit('=').next().unwrap().parse().unwrap();
    // Two prompts of ~400 words in 26,624 blocks of 16.
    assert!(kv > 40.0 / 26_624.0 && kv < 0.01, "{h}");
    assert!(!h.contains("running"), "vLLM does not report running: {h}");
    for t in hold {
        t.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_400_with_error_object() {
    let w = worker("--speedup 50 --max-model-len 200").await;
    let long = text(3, 400);
    let cases: Vec<(&str, String, u16, Option<&str>)> = vec![
        ("/v1/completions", "".into(), 400, None),
        ("/v1/completions", "{not json".into(), 400, None),
        ("/v1/completions", "[1,2]".into(), 400, None),
        (
            "/v1/completions",
            r#"{"model":"mock-model"}"#.into(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            r#"{"prompt":42}"#.into(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            r#"{"prompt":[1,"a"]}"#.into(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            r#"{"prompt":"hi","max_tokens":"5"}"#.into(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            r#"{"prompt":"hi","max_tokens":-1}"#.into(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            r#"{"prompt":"hi","stream":"yes"}"#.into(),
            400,
            Some("stream"),
        ),
        (
            "/v1/completions",
            json!({"prompt": long}).to_string(),
            400,
            Some("input_tokens"),
        ),
        (
            "/v1/completions",
            r#"{"prompt":"hi","max_tokens":500}"#.into(),
            400,
            Some("input_tokens"),
        ),
        (
            "/v1/chat/completions",
            r#"{"prompt":"hi"}"#.into(),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            r#"{"messages":"hi"}"#.into(),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            r#"{"messages":[{"content":"x"}]}"#.into(),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":5}]}"#.into(),
            400,
            Some("messages"),
        ),
        (
            "/v1/completions",
            r#"{"model":"other","prompt":"hi"}"#.into(),
            404,
            Some("model"),
        ),
    ];
    for (path, body, status, param) in cases {
        let r = post(w.addr, path, &body, &[]).await;
        assert_eq!(r.status, status, "{path} {body:?}: {}", r.body);
        let e = &r.json()["error"];
        assert!(
            e["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{body}"
        );
        let kind = if status == 404 {
            "NotFoundError"
        } else {
            "BadRequestError"
        };
        assert_eq!(e["type"], kind);
        assert_eq!(e["code"], status, "the code is the HTTP status, an integer");
        if let Some(p) = param {
            assert_eq!(e["param"], p, "{body}");
        }
    }
    // Byte for byte where vLLM defines the text.
    assert_eq!(
        post(
            w.addr,
            "/v1/completions",
            r#"{"model":"other","prompt":"hi"}"#,
            &[]
        )
        .await
        .body,
        r#"{"error":{"message":"The model `other` does not exist.","type":"NotFoundError","param":"model","code":404}}"#
    );
    let nothing = post(w.addr, "/v1/nothing", "{}", &[]).await;
    assert_eq!(
        (nothing.status, nothing.body.as_str()),
        (404, r#"{"detail":"Not Found"}"#)
    );
    let wrong = get(w.addr, "/v1/completions").await;
    assert_eq!(
        (wrong.status, wrong.body.as_str()),
        (405, r#"{"detail":"Method Not Allowed"}"#)
    );
    // The worker is still fine afterwards.
    assert_eq!(get(w.addr, "/health").await.status, 200);
    assert_eq!(
        get(w.addr, "/v1/models").await.json()["data"][0]["id"],
        "mock-model"
    );
    let ok = post(
        w.addr,
        "/v1/completions",
        r#"{"prompt":[[5,6,7]],"max_tokens":3}"#,
        &[],
    )
    .await;
    assert_eq!(ok.json()["usage"]["prompt_tokens"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_is_valid_sse_with_usage_last() {
    // Slow enough (decode passes of ~5.7 ms) that tokens visibly arrive one by one.
    let w = worker("--speedup 1").await;
    let r = post(
        w.addr,
        "/v1/completions",
        &stream_body("Tell me a story about caches.", 20),
        &[],
    )
    .await;
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let (chunks, done) = r.sse();
    assert!(done);
    assert!(
        r.frames.len() > 1,
        "tokens stream as they are produced, got {} frame(s)",
        r.frames.len()
    );
    let texts: Vec<&Value> = chunks
        .iter()
        .filter(|c| !c["choices"].as_array().unwrap().is_empty())
        .collect();
    assert_eq!(texts.len(), 20);
    assert_eq!(texts[19]["choices"][0]["finish_reason"], "length");
    assert!(texts[0]["choices"][0]["finish_reason"].is_null());
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 20);
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 3);

    let chat = post(
        w.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3, "stream": true}).to_string(),
        &[],
    )
    .await;
    let (chunks, done) = chat.sse();
    assert!(done);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, " the of and");
    assert!(
        chunks.iter().all(|c| c.get("usage").is_none()),
        "no usage without include_usage"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_reports_hits_without_changing_state() {
    let w = worker("--speedup 50").await;
    let body = json!({"prompt": text(4, 300), "max_tokens": 2}).to_string();
    let cold = post(w.addr, "/v1/cache/probe", &body, &[]).await.json();
    assert_eq!(cold["cached_tokens"], 0);
    post(w.addr, "/v1/completions", &body, &[]).await;
    let before = get(w.addr, "/metrics").await.body;
    let p1 = post(w.addr, "/v1/cache/probe", &body, &[]).await.json();
    let p2 = post(w.addr, "/v1/cache/probe", &body, &[]).await.json();
    let after = get(w.addr, "/metrics").await.body;
    assert_eq!(p1, p2);
    assert_eq!(p1["prompt_tokens"], cold["prompt_tokens"]);
    let n = p1["prompt_tokens"].as_u64().unwrap();
    assert_eq!(p1["cached_tokens"].as_u64().unwrap(), (n - 1) / 16 * 16);
    assert_eq!(before, after, "probing changed engine state");
    // A chat body is detected by `messages`.
    let chat = post(
        w.addr,
        "/v1/cache/probe",
        r#"{"messages":[{"role":"user","content":"x"}]}"#,
        &[],
    )
    .await
    .json();
    assert_eq!(chat["cached_tokens"], 0);
    assert!(chat["prompt_tokens"].as_u64().unwrap() > 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_hands_off_to_decode_worker() {
    let d = worker("--speedup 5 --role decode --name dec --enable-prompt-tokens-details").await;
    let p = worker("--speedup 5 --role prefill --name pre --enable-prompt-tokens-details").await;
    let ep = d.addr.to_string();
    let prompt = text(5, 900);
    let r = post(
        p.addr,
        "/v1/completions",
        &stream_body(&prompt, 12),
        &[
            ("x-kvroute-decode-endpoint", &ep),
            ("endpoint-load-metrics-format", "TEXT"),
        ],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-worker-id"), Some("dec"));
    assert_eq!(r.header("x-prefill-worker-id"), Some("pre"));
    assert_eq!(r.header("x-prefill-cached-tokens"), Some("0"));
    // A stream carries no ORCA report, from either worker.
    assert!(r.header("endpoint-load-metrics").is_none());
    assert!(r.header("x-decode-endpoint-load-metrics").is_none());
    let (chunks, done) = r.sse();
    assert!(done);
    assert!(
        r.frames.len() > 1,
        "relayed chunk by chunk: {} frame(s)",
        r.frames.len()
    );
    assert_eq!(
        chunks
            .iter()
            .filter(|c| !c["choices"].as_array().unwrap().is_empty())
            .count(),
        12
    );
    let usage = &chunks.last().unwrap()["usage"];
    let n = usage["prompt_tokens"].as_u64().unwrap();
    // Everything but the last prompt token arrived as KV; the engine recomputes that one.
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        n - 1
    );
    let dm = get(d.addr, "/metrics").await.body;
    assert_eq!(metric(&dm, "vllm:generation_tokens_total"), 12.0);
    assert_eq!(
        metric(&dm, "vllm:prefix_cache_hits"),
        0.0,
        "transferred KV is not a local hit"
    );
    let pm = get(p.addr, "/metrics").await.body;
    assert_eq!(metric(&pm, "vllm:prompt_tokens_total"), n as f64);
    // Both now hold the prompt: a probe on each shows it cached.
    let probe = json!({"prompt": prompt}).to_string();
    for a in [d.addr, p.addr] {
        assert_eq!(
            post(a, "/v1/cache/probe", &probe, &[]).await.json()["cached_tokens"]
                .as_u64()
                .unwrap(),
            (n - 1) / 16 * 16
        );
    }
    // Non-streaming works through the relay too; without the header the prefill worker serves.
    let body = json!({"prompt": prompt, "max_tokens": 5}).to_string();
    let r = post(
        p.addr,
        "/v1/completions",
        &body,
        &[
            ("x-kvroute-decode-endpoint", &ep),
            ("endpoint-load-metrics-format", "TEXT"),
        ],
    )
    .await;
    assert_eq!(r.json()["usage"]["completion_tokens"], 5);
    for h in ["endpoint-load-metrics", "x-decode-endpoint-load-metrics"] {
        assert!(r.header(h).unwrap().starts_with("TEXT "), "{h}");
    }
    assert_eq!(
        r.header("x-prefill-cached-tokens").unwrap(),
        ((n - 1) / 16 * 16).to_string()
    );
    let local = post(p.addr, "/v1/completions", &body, &[]).await;
    assert_eq!(local.header("x-worker-id"), Some("pre"));
    assert_eq!(local.json()["usage"]["completion_tokens"], 5);
    // A dead decode worker is a 502, not a hang.
    let dead = post(
        p.addr,
        "/v1/completions",
        &body,
        &[("x-kvroute-decode-endpoint", "127.0.0.1:1")],
    )
    .await;
    assert_eq!(dead.status, 502);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_hands_off_only_to_allowed_decode_endpoints() {
    let d = worker("--speedup 20 --role decode --name dec").await;
    let ep = d.addr.to_string();
    // A listener the prefill worker must never contact.
    let trap = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    trap.set_nonblocking(true).unwrap();
    let trap_ep = trap.local_addr().unwrap().to_string();
    let p = worker(&format!(
        "--speedup 20 --role prefill --name pre --allowed-decode-endpoints 127.0.0.1:1,{ep}"
    ))
    .await;
    let body = json!({"prompt": text(6, 300), "max_tokens": 3}).to_string();
    let r = post(
        p.addr,
        "/v1/completions",
        &body,
        &[("x-kvroute-decode-endpoint", &trap_ep)],
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["type"], "BadRequestError");
    assert!(
        r.body.contains("not an allowed decode endpoint"),
        "{}",
        r.body
    );
    assert!(
        trap.accept().is_err(),
        "the prefill worker connected to {trap_ep}"
    );
    let pm = get(p.addr, "/metrics").await.body;
    assert_eq!(
        metric(&pm, "vllm:prompt_tokens_total"),
        0.0,
        "nothing computed"
    );
    let ok = post(
        p.addr,
        "/v1/completions",
        &body,
        &[("x-kvroute-decode-endpoint", &ep)],
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert_eq!(ok.header("x-worker-id"), Some("dec"));
    // A decode (or both) worker ignores the header, so it is not checked there.
    let direct = post(
        d.addr,
        "/v1/completions",
        &body,
        &[("x-kvroute-decode-endpoint", &trap_ep)],
    )
    .await;
    assert_eq!(direct.status, 200, "{}", direct.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_tokens_details_only_with_the_vllm_flag() {
    let body = json!({"prompt": text(9, 200), "max_tokens": 2}).to_string();
    let stream = stream_body(&text(9, 200), 2);
    // Default, like vLLM without --enable-prompt-tokens-details: null in a JSON response,
    // absent from the stream's usage chunk, even on a cache hit.
    let w = worker("--speedup 50").await;
    for _ in 0..2 {
        let u = &post(w.addr, "/v1/completions", &body, &[]).await.json()["usage"];
        assert!(u["prompt_tokens"].as_u64().unwrap() > 100);
        assert!(u.as_object().unwrap().contains_key("prompt_tokens_details"));
        assert!(u["prompt_tokens_details"].is_null(), "{u}");
        let su = last_usage(&post(w.addr, "/v1/completions", &stream, &[]).await);
        assert!(su.get("prompt_tokens_details").is_none(), "{su}");
    }
    // With the flag: reported, a cold prompt included (cached_tokens 0).
    let w = worker("--speedup 50 --enable-prompt-tokens-details").await;
    let cold = post(w.addr, "/v1/completions", &body, &[]).await.json();
    // vLLM 0.32's fields: created_cache_tokens is null on completions.
    assert_eq!(
        cold["usage"]["prompt_tokens_details"],
        json!({"cached_tokens": 0, "created_cache_tokens": null, "multimodal_tokens": null})
    );
    assert!(cold["usage"]["completion_tokens_details"].is_null());
    let su = last_usage(&post(w.addr, "/v1/completions", &stream, &[]).await);
    assert!(
        su["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 100
    );
    // Stream chunks leave the null fields out, as vLLM's do.
    assert_eq!(
        su["prompt_tokens_details"].as_object().unwrap().len(),
        1,
        "{su}"
    );
    // Chat: the prompt tokens the request added to the cache, its full blocks (16 tokens)
    // less its hit: all of them cold, none on a repeat.
    let chat = json!({"messages": [{"role": "user", "content": text(3, 200)}], "max_tokens": 2})
        .to_string();
    let first = post(w.addr, "/v1/chat/completions", &chat, &[])
        .await
        .json();
    let p = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        first["usage"]["prompt_tokens_details"]["created_cache_tokens"],
        json!(p / 16 * 16)
    );
    let again = post(w.addr, "/v1/chat/completions", &chat, &[])
        .await
        .json();
    assert_eq!(
        again["usage"]["prompt_tokens_details"],
        json!({"cached_tokens": p / 16 * 16 - if p % 16 == 0 { 16 } else { 0 },
               "created_cache_tokens": if p % 16 == 0 { 16 } else { 0 }, "multimodal_tokens": null})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_length_limits_and_default_max_tokens_as_vllm() {
    let w = worker("--speedup 50 --max-model-len 100").await;
    let ids = |n: usize| json!((1..=n).collect::<Vec<usize>>());
    // prompt + max_tokens over max_model_len: vLLM's message and param.
    let r = post(
        w.addr,
        "/v1/completions",
        &json!({"prompt": ids(60), "max_tokens": 41}).to_string(),
        &[],
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(
        r.body,
        r#"{"error":{"message":"You passed 60 input tokens and requested 41 output tokens. However, the model's context length is only 100 tokens, resulting in a maximum input length of 59 tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value=60)","type":"BadRequestError","param":"input_tokens","code":400}}"#
    );
    // A prompt of max_model_len tokens or more is refused even without max_tokens.
    for n in [100, 101] {
        let r = post(
            w.addr,
            "/v1/completions",
            &json!({"prompt": ids(n)}).to_string(),
            &[],
        )
        .await;
        assert_eq!(r.status, 400, "{n}");
        assert!(
            r.body.contains(&format!(
                "You passed {n} input tokens and requested 0 output tokens"
            )),
            "{}",
            r.body
        );
    }
    // Exactly full is fine.
    let r = post(
        w.addr,
        "/v1/completions",
        &json!({"prompt": ids(60), "max_tokens": 40}).to_string(),
        &[],
    )
    .await;
    assert_eq!(r.json()["usage"]["completion_tokens"], 40);
    // Without max_tokens: completions default to 16, chat to the rest of the context.
    let r = post(
        w.addr,
        "/v1/completions",
        &json!({"prompt": ids(10)}).to_string(),
        &[],
    )
    .await;
    assert_eq!(r.json()["usage"]["completion_tokens"], 16);
    let r = post(
        w.addr,
        "/v1/completions",
        &json!({"prompt": ids(90)}).to_string(),
        &[],
    )
    .await;
    assert_eq!(r.json()["usage"]["completion_tokens"], 10);
    let chat = post(
        w.addr,
        "/v1/chat/completions",
        r#"{"messages":[{"role":"user","content":"hi"}]}"#,
        &[],
    )
    .await
    .json();
    let u = &chat["usage"];
    assert_eq!(u["total_tokens"], 100, "{u}");
    // A context longer than the KV cache is cut to the cache, where vLLM would not start.
    let small = worker("--kv-blocks 8 --block-size 16").await;
    let models = get(small.addr, "/v1/models").await.json();
    assert_eq!(models["data"][0]["max_model_len"], 128);
}

/// The mock's own token ids for `text` (what its prefix cache hashes), as JSON.
fn engine_ids(text: &str) -> Value {
    json!(mock_worker::tokenizer::encode(text))
}

/// A labelled series of the Prometheus text, e.g. `name{...,route="/tokenize"}`.
fn series(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{') && l.contains(label))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} with {label} missing"))
}

/// What vllm-router 0.1.17's `cache_aware` policy sends to every worker before it routes a
/// request over HTTP: the request body itself (with the fields it adds) to the render route of
/// its API, and after a 404 there a minimal `/tokenize` body. The ids it gets back must be the
/// ids this worker caches, and the chat form must tokenize the prompt the chat template renders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_router_preparation_bodies_get_the_cached_ids() {
    let w = worker("--speedup 50 --enable-prompt-tokens-details").await;
    let prompt = text(31, 400);
    let ids = engine_ids(&prompt);
    let n = ids.as_array().unwrap().len() as u64;

    // Completions: render (a list, one entry per prompt), then the /tokenize fallback.
    let body = json!({"model": "mock-model", "prompt": prompt, "max_tokens": 64, "stream": true,
        "stream_options": {"include_usage": true}, "echo": false, "no_stop_trim": false,
        "ignore_eos": false, "skip_special_tokens": true, "return_hidden_states": false});
    let r = post(w.addr, "/v1/completions/render", &body.to_string(), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = r.json();
    assert_eq!(r.as_array().unwrap().len(), 1);
    assert_eq!(r[0]["token_ids"], ids);
    assert_eq!(r[0]["stream"], true);
    let t = post_json(
        w.addr,
        "/tokenize",
        &json!({"model": "mock-model", "prompt": prompt}),
    )
    .await;
    assert_eq!(t["tokens"], ids);
    assert_eq!(t["count"], n);

    // The engine caches exactly these ids: serve the text, then send the ids as the prompt.
    let first = post_json(
        w.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1}),
    )
    .await;
    assert_eq!(first["usage"]["prompt_tokens"], n);
    let again = post_json(
        w.addr,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 1}),
    )
    .await;
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        (n - 1) / 16 * 16
    );

    // Chat: the ids of the prompt the mock's chat template renders, whichever route asks.
    let msgs = json!([{"role": "system", "content": text(32, 60)},
                      {"role": "user", "content": text(33, 200)}]);
    let rendered = mock_worker::api::render_chat(msgs.as_array().unwrap(), None, true).unwrap();
    let chat_ids = engine_ids(&rendered);
    let cn = chat_ids.as_array().unwrap().len() as u64;
    let cbody = json!({"model": "mock-model", "messages": msgs, "stream": true,
        "stream_options": {"include_usage": true}, "max_tokens": 64, "logprobs": false,
        "no_stop_trim": false, "ignore_eos": false, "continue_final_message": false,
        "skip_special_tokens": true, "separate_reasoning": true, "stream_reasoning": true,
        "return_hidden_states": false, "include_reasoning": true});
    let cr = post(
        w.addr,
        "/v1/chat/completions/render",
        &cbody.to_string(),
        &[],
    )
    .await;
    assert_eq!(cr.status, 200, "{}", cr.body);
    assert_eq!(cr.json()["token_ids"], chat_ids);
    let ct = post_json(
        w.addr,
        "/tokenize",
        &json!({"model": "mock-model", "continue_final_message": false, "messages": msgs}),
    )
    .await;
    assert_eq!(ct["tokens"], chat_ids);
    assert_eq!(ct["count"], cn);
    // The completion form of the rendered text gives the same ids.
    let as_text = post_json(w.addr, "/tokenize", &json!({"prompt": rendered})).await;
    assert_eq!(as_text["tokens"], chat_ids);
    // Serve the chat, then its rendered text as a completion: every full block is a hit.
    let chat = post_json(
        w.addr,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 1}),
    )
    .await;
    assert_eq!(chat["usage"]["prompt_tokens"], cn);
    let same = post_json(
        w.addr,
        "/v1/completions",
        &json!({"prompt": rendered, "max_tokens": 1}),
    )
    .await;
    assert_eq!(
        same["usage"]["prompt_tokens_details"]["cached_tokens"],
        (cn - 1) / 16 * 16
    );

    // Counted per route; none of it reached the engine (only the four inference requests).
    let m = get(w.addr, "/metrics").await.body;
    let name = "mock:tokenize_requests_total";
    assert_eq!(series(&m, name, "route=\"/tokenize\""), 3.0);
    assert_eq!(series(&m, name, "route=\"/v1/completions/render\""), 1.0);
    assert_eq!(
        series(&m, name, "route=\"/v1/chat/completions/render\""),
        1.0
    );
    assert_eq!(metric(&m, "vllm:request_success_total"), 4.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_render_give_the_ids_the_engine_caches() {
    let w = worker("--speedup 50 --enable-prompt-tokens-details").await;
    let prompt = text(21, 300);
    let tok = post(
        w.addr,
        "/tokenize",
        &json!({"prompt": prompt}).to_string(),
        &[],
    )
    .await
    .json();
    let ids = tok["tokens"].as_array().unwrap().clone();
    assert_eq!(tok["count"], ids.len());
    assert_eq!(tok["max_model_len"], 131_072);
    assert!(tok["token_strs"].is_null());
    let render = post(
        w.addr,
        "/v1/completions/render",
        &json!({"model": "mock-model", "prompt": [prompt, "second"], "max_tokens": 3}).to_string(),
        &[],
    )
    .await
    .json();
    let list = render.as_array().unwrap();
    assert_eq!(list.len(), 2, "one entry per prompt");
    assert_eq!(list[0]["token_ids"].as_array().unwrap(), &ids);
    assert_eq!(list[0]["model"], "mock-model");
    assert_eq!(list[0]["sampling_params"]["max_tokens"], 3);
    assert!(list[0]["request_id"].as_str().unwrap().starts_with("cmpl-"));
    // Serve the text, then the ids: the ids hit everything the text cached.
    let first = post(
        w.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1}).to_string(),
        &[],
    )
    .await
    .json();
    assert_eq!(first["usage"]["prompt_tokens"], ids.len());
    let again = post(
        w.addr,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 1}).to_string(),
        &[],
    )
    .await
    .json();
    let n = ids.len() as u64;
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        (n - 1) / 16 * 16
    );
    // Chat: tokenize and render apply the same template as inference.
    let msgs =
        json!([{"role": "system", "content": text(22, 50)}, {"role": "user", "content": "hi"}]);
    let ct = post(
        w.addr,
        "/tokenize",
        &json!({"messages": msgs}).to_string(),
        &[],
    )
    .await
    .json();
    let cr = post(
        w.addr,
        "/v1/chat/completions/render",
        &json!({"messages": msgs, "max_tokens": 2}).to_string(),
        &[],
    )
    .await
    .json();
    assert_eq!(cr["token_ids"], ct["tokens"]);
    assert!(cr["request_id"].as_str().unwrap().starts_with("chatcmpl-"));
    let chat = post(
        w.addr,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 2}).to_string(),
        &[],
    )
    .await
    .json();
    assert_eq!(chat["usage"]["prompt_tokens"], ct["count"]);
    // Errors as vLLM's.
    let bad = post(w.addr, "/tokenize", r#"{"model":"x","prompt":"a"}"#, &[]).await;
    assert_eq!(bad.status, 404);
    // Nothing reached the engine: only the two completions and the chat ran.
    let m = get(w.addr, "/metrics").await.body;
    assert_eq!(metric(&m, "vllm:request_success_total"), 3.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_timing_is_the_model_even_when_the_engine_thread_stalls() {
    use mock_worker::engine::pass_ms;
    let w = worker("--speedup 1").await;
    let body = json!({"prompt": (1..=100).collect::<Vec<u32>>(), "max_tokens": 10}).to_string();
    // 100 prompt tokens in 7 blocks of 16 (of 26,624), then 9 decode passes on those blocks.
    let p = 7.0 / 26_624.0;
    let ttft = pass_ms(100, 0.0, false, p) / 1000.0;
    let e2e = ttft + 9.0 * pass_ms(0, 0.0, true, p) / 1000.0;
    let addr = w.addr;
    let req = tokio::spawn(async move { post(addr, "/v1/completions", &body, &[]).await });
    // Stall the engine from 25 to 125 ms, past the request's modelled end (~70 ms), as a
    // starved CPU would. (A shorter stall is absorbed: the passes after it run back to back
    // until the schedule is met.)
    tokio::time::sleep(Duration::from_millis(25)).await;
    {
        let _held = w.shared.state.lock().unwrap();
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = req.await.unwrap();
    let (t, e) = engine_timing(&r).expect("timing header");
    assert!((t - ttft).abs() < 1e-5, "engine ttft {t} vs model {ttft}");
    assert!((e - e2e).abs() < 1e-5, "engine e2e {e} vs model {e2e}");
    // The client saw the stall; the engine's schedule did not stretch.
    assert!(
        r.first_frame.as_secs_f64() > e2e + 0.03,
        "{:?}",
        r.first_frame
    );
    // Streams carry the same report as an SSE comment before [DONE], with the wall-clock
    // stamps of the request's receipt and its first token's send.
    let unix = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
    };
    let before = unix();
    let s = post(
        w.addr,
        "/v1/completions",
        &stream_body("hello there", 3),
        &[],
    )
    .await;
    assert!(
        s.body.contains("\n\n: x-mock-engine-timing ttft="),
        "{}",
        s.body
    );
    assert!(s.body.ends_with("data: [DONE]\n\n"));
    let (st, se) = engine_timing(&s).unwrap();
    assert!(st > 0.0 && se > st);
    let (arrived, first_sent) = engine_wall_stamps(&s).expect("wall stamps");
    let after = unix();
    assert!(
        before <= arrived && arrived <= first_sent && first_sent <= after,
        "{before} {arrived} {first_sent} {after}"
    );
    // The first token cannot leave before the engine's schedule produced it.
    assert!(
        first_sent - arrived >= st - 1e-3,
        "{arrived} {first_sent} {st}"
    );
    let plain = worker("--no-engine-timing").await;
    let r = post(
        plain.addr,
        "/v1/completions",
        r#"{"prompt":"a","max_tokens":1}"#,
        &[],
    )
    .await;
    assert!(engine_timing(&r).is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemptions_under_kv_pressure_show_in_metrics() {
    // 16 blocks of 16 tokens; three requests each grow to 40 + 100 tokens (9 blocks).
    let w = worker("--speedup 100 --kv-blocks 16 --block-size 16").await;
    let mut tasks = vec![];
    for i in 0..3u32 {
        let addr = w.addr;
        let body =
            json!({"prompt": (i * 1000..i * 1000 + 40).collect::<Vec<u32>>(), "max_tokens": 100});
        tasks.push(tokio::spawn(async move {
            post(addr, "/v1/completions", &body.to_string(), &[]).await
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().json()["usage"]["completion_tokens"], 100);
    }
    let m = get(w.addr, "/metrics").await.body;
    assert!(metric(&m, "vllm:num_preemptions_total") >= 1.0, "{m}");
    assert!(m.contains("# TYPE vllm:num_preemptions_total counter"));
}
