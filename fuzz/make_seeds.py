#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets (fuzz/corpus/<target>/<name>).

Run by hand when the seeds should change; the output is committed. Seeds are realistic
inputs (what clients, workers, peers and operators send) plus a few malformed ones, small
enough that the corpus replay in `make test` takes well under a second. The plugin configs
are read from the shipped Envoy configs, so the seeds follow them.
"""

import json
import os
import re
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CORPUS = os.path.join(HERE, "corpus")


def write(target: str, name: str, data) -> None:
    if isinstance(data, (dict, list)):
        data = json.dumps(data, separators=(",", ":"))
    if isinstance(data, str):
        data = data.encode()
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


DOC = ("The quick brown fox jumps over the lazy dog while the engine prefills its KV cache "
       "block by block; a shared system prompt makes every later turn cheaper. ") * 6

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "required": ["city"],
                       "properties": {"unit": {"enum": ["c", "f"], "type": "string"},
                                      "city": {"type": "string"}}},
    },
}]

REQUESTS = {
    "completion_text": {"model": "mock-model", "prompt": DOC + "Summarise.", "max_tokens": 16},
    "completion_stream_usage": {"model": "mock-model", "prompt": DOC, "max_tokens": 8, "stream": True,
                                "stream_options": {"include_usage": True}, "temperature": 0.2},
    "completion_batch": {"model": "mock-model", "prompt": [DOC, "second prompt", "third"], "max_tokens": 4},
    "completion_token_ids": {"model": "mock-model", "prompt": list(range(1, 70)), "max_tokens": 4},
    "completion_token_batch": {"prompt": [[101, 2023, 2003, 1037, 3231, 102] * 6, [7, 8, 9]], "max_tokens": 1},
    "completion_salt": {"model": "m", "prompt": "tenant prompt " * 20, "cache_salt": "tenant-42", "max_tokens": 2},
    "completion_embeds": {"model": "m", "prompt_embeds": "AAAA", "max_tokens": 2},
    "chat_simple": {"model": "mock-model", "messages": [
        {"role": "system", "content": DOC},
        {"role": "user", "content": "What is in the cache?"}], "max_tokens": 8},
    "chat_multi_turn": {"model": "mock-model", "max_completion_tokens": 32, "max_tokens": 64, "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "name": "bob", "content": "Tell me about prefix caching, caf\u00e9 \u2603 \U0001F600."}]},
    "chat_tools": {"model": "mock-model", "tools": TOOLS, "tool_choice": "auto", "max_tokens": 16,
                   "stream": True, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\":21}"},
        {"role": "user", "content": "And tomorrow?"}]},
    "chat_parts": {"model": "mock-model", "max_tokens": 8, "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "Describe this image."},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
            {"type": "text", "text": "Briefly."}]}]},
    "chat_salt_stream": {"model": "mock-model", "cache_salt": "s1", "stream": True,
                         "stream_options": {"include_usage": True}, "max_tokens": 4,
                         "messages": [{"role": "user", "content": ""}, {"role": "user", "content": []}]},
}

MALFORMED = {
    "truncated": b'{"model":"m","prompt":"abc',
    "array_top": b'[{"prompt":"x"}]',
    "empty_messages": b'{"messages":[],"max_tokens":1}',
    "wrong_types": b'{"model":7,"prompt":{"a":1},"max_tokens":-1,"stream":"yes"}',
    "escapes": b'{"model":"m\\u00e9","prompt":"line\\nbreak \\ud83d\\ude00 \\"q\\"","max_tokens":1}',
    "deep": b'{"prompt":"x","extra":' + b"[" * 200 + b"]" * 200 + b"}",
    "duplicate_keys": b'{"prompt":"a","prompt":[1,2,3],"max_tokens":1,"max_tokens":2}',
}


def events() -> None:
    # Version 2 (what kvroute sends): each event is its tag, a u32 body length, the body.
    # Version 1 (unframed, still read): tag then body, back to back.
    def ev(tag, body, framed=True):
        return bytes([tag]) + (struct.pack("<I", len(body)) if framed else b"") + body

    def routed_body(i, worker, pw, hashes):
        return (struct.pack("<QQHHIII", i, 1_700_000_000_000 + i, worker, pw, 2, 3, 900)
                + struct.pack("<I", len(hashes)) + b"".join(struct.pack("<Q", h) for h in hashes))

    def head(ns, version=2):
        return bytes([version]) + struct.pack("<Q", ns)

    hashes = [0x9E3779B97F4A7C15 * (k + 1) % 2**64 for k in range(12)]
    write("events", "routed", head(123456789) + ev(1, routed_body(1 << 32 | 7, 2, 0xFFFF, hashes)))
    write("events", "routed_prefill", head(5) + ev(1, routed_body(9, 0, 4, hashes[:3])))
    write("events", "lifecycle", head(1) + ev(2, struct.pack("<Q", 9)) + ev(9, struct.pack("<Q", 9))
          + ev(3, struct.pack("<Q", 9)))
    write("events", "report", head(2) + ev(4, struct.pack("<HfIIQ", 1, 0.42, 3, 0xFFFFFFFF, 77))
          + ev(4, struct.pack("<HfIIQ", 0, 1.0, 0, 5, 78)))
    write("events", "health", head(3) + ev(5, struct.pack("<HQ", 3, 1000)) + ev(6, struct.pack("<H", 3)))
    write("events", "forget_calibrate", head(4) + ev(7, struct.pack("<HI", 1, 2) + struct.pack("<QQ", 11, 22))
          + ev(8, struct.pack("<d", 3.7)))
    write("events", "empty_batch", head(0))
    write("events", "truncated", head(7) + ev(1, routed_body(1, 1, 0xFFFF, hashes))[:-5])
    write("events", "bad_event_skipped", head(8) + ev(2, struct.pack("<Q", 1)) + ev(200, b"??")
          + ev(3, struct.pack("<Q", 1)))
    write("events", "bad_version", head(0, version=3))
    write("events", "v1_routed", head(6, version=1) + ev(1, routed_body(3, 1, 0xFFFF, hashes[:2]), framed=False)
          + ev(3, struct.pack("<Q", 3), framed=False))


def feedback() -> None:
    w = lambda n, d: write("feedback", n, d)
    w("orca_text", "TEXT named_metrics.kv_cache_usage_perc=0.31,named_metrics.num_requests_waiting=2,"
      "named_metrics.num_requests_running=5")
    w("orca_json", 'JSON {"cpu_utilization":0.3,"named_metrics":{"kv_cache_usage_perc":0.5,'
      '"num_requests_running":7,"num_requests_waiting":1}}')
    w("orca_bare", "named_metrics.num_requests_waiting=4, cpu_utilization=0.3")
    w("orca_garbage", "TEXT named_metrics.kv_cache_usage_perc=NaN,=,,named_metrics.num_requests_waiting=1e99")
    chunk = lambda i: ('data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,'
                       f'"text":" tok{i}","finish_reason":null}}],"usage":null}}\n\n')
    usage = ('data: {"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":1135,"completion_tokens":16,'
             '"total_tokens":1151,"prompt_tokens_details":{"cached_tokens":1120}}}\n\n')
    w("sse_tail", "".join(chunk(i) for i in range(8)) + usage + "data: [DONE]\n\n")
    w("sse_no_usage", "".join(chunk(i) for i in range(4)) + "data: [DONE]\n\n")
    w("json_body", json.dumps({"id": "cmpl-2", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": 'the "usage" word'}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 42, "completion_tokens": 8, "total_tokens": 50}}))
    w("usage_broken", '{"usage": {"prompt_tokens": -1}, "usage" : {"prompt_tokens": 5')


def configs() -> None:
    import yaml  # only needed when regenerating

    def plugin_configs(node):
        if isinstance(node, dict):
            for v in node.values():
                yield from plugin_configs(v)
        elif isinstance(node, list):
            for v in node:
                yield from plugin_configs(v)
        elif isinstance(node, str) and '"workers"' in node:
            yield node

    shipped = ["envoy/demo.yaml", "examples/docker-compose/envoy.yaml", "deploy/istio/kvroute-envoyfilter.yaml"]
    for rel in shipped:
        with open(os.path.join(ROOT, rel)) as f:
            for n, doc in enumerate(yaml.safe_load_all(f)):
                for k, cfg in enumerate(plugin_configs(doc)):
                    name = re.sub(r"[^a-z0-9]+", "_", rel.lower()).strip("_")
                    write("config", f"shipped_{name}_{n}_{k}", cfg)
    full = {
        "workers": [{"name": "a", "cluster": "pool-a", "endpoint": "10.0.0.1:8000", "role": "both", "kv_blocks": 8192},
                    {"name": "p_1", "endpoint": "prefill.svc:8000", "role": "prefill"}],
        "block_size": 32, "chars_per_token": 3.6, "routes": ["/v1/completions", "/v1/chat/completions"],
        "models": ["llama"], "steering": {"mode": "endpoint", "header": "x-gateway-destination-endpoint", "fallbacks": 0},
        "scoring": {"overlap_credit": 1.0, "prefill_load_scale": 1.0, "staged_decode": True, "temperature": 0.1,
                    "cache_balance": 1.0, "cache_balance_half_life_ms": 60000},
        "busy": {"kv_usage": 0.95, "waiting_requests": 16, "inflight_requests": 64, "report_max_age_ms": 5000,
                 "reject_when_all_busy": True},
        "disaggregation": {"threshold_tokens": 2048, "mode": "llm-d", "decode_header": "x-kvroute-decode-endpoint",
                           "prefiller_header": "x-prefiller-host-port"},
        "index": {"ttl_ms": 120000, "default_kv_blocks": 16384},
        "load": {"request_ttl_ms": 600000, "prefill_decay": True, "prefill_tokens_per_s": 8000.0,
                 "prefill_overhead_ms": 20},
        "health": {"cooldown_ms": 5000}, "debug_headers": False, "seed": 7,
    }
    write("config", "every_key", json.dumps(full, indent=1))
    write("config", "minimal", {"workers": [{"name": "w"}]})
    write("config", "bad_endpoint", {"workers": [{"name": "w", "endpoint": "no-port"}]})
    write("config", "unknown_key", {"workers": [{"name": "w"}], "temprature": 0.5})
    write("config", "only_prefill", {"workers": [{"name": "p", "role": "prefill", "endpoint": "h:1"}]})
    write("config", "empty", b"")


def main() -> None:
    for name, body in REQUESTS.items():
        for target in ("request", "hashing"):
            write(target, name, body)
    for name, body in MALFORMED.items():
        write("request", name, body)
    events()
    feedback()
    configs()


if __name__ == "__main__":
    main()
