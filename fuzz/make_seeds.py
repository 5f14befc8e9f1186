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


# --- kvroute-relay's targets (fuzz/src/relay.rs) ---------------------------------------------

def mp(v) -> bytes:
    """MessagePack of ints, floats, str, bytes, None, lists and dicts (compact forms)."""
    if v is None:
        return b"\xc0"
    if isinstance(v, bool):
        return b"\xc3" if v else b"\xc2"
    if isinstance(v, int):
        if 0 <= v < 0x80:
            return bytes([v])
        if -32 <= v < 0:
            return struct.pack("b", v)
        if 0 <= v <= 0xFFFFFFFF:
            return (b"\xcc" + struct.pack(">B", v)) if v <= 0xFF else (
                (b"\xcd" + struct.pack(">H", v)) if v <= 0xFFFF else b"\xce" + struct.pack(">I", v))
        if v >= 0:
            return b"\xcf" + struct.pack(">Q", v)
        return b"\xd3" + struct.pack(">q", v)
    if isinstance(v, float):
        return b"\xcb" + struct.pack(">d", v)
    if isinstance(v, str):
        b = v.encode()
        return (bytes([0xA0 | len(b)]) if len(b) < 32 else b"\xd9" + bytes([len(b)])) + b
    if isinstance(v, bytes):
        return b"\xc4" + bytes([len(v)]) + v
    if isinstance(v, list):
        head = bytes([0x90 | len(v)]) if len(v) < 16 else b"\xdc" + struct.pack(">H", len(v))
        return head + b"".join(mp(x) for x in v)
    if isinstance(v, dict):
        head = bytes([0x80 | len(v)]) if len(v) < 16 else b"\xde" + struct.pack(">H", len(v))
        return head + b"".join(mp(k) + mp(x) for k, x in v.items())
    raise TypeError(v)


def stored_event(hashes, parent, tokens, bs=4, as_map=False, lora=None):
    if as_map:
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                "token_ids": tokens, "block_size": bs, "lora_id": None, "medium": "GPU",
                "lora_name": lora, "extra_keys": None, "group_idx": 0, "kv_cache_spec_kind": "full"}
    return ["BlockStored", hashes, parent, tokens, bs, None, "GPU", lora]


def vllm_batches():
    """(name, payload) of KV event batches as vLLM publishes them (array and map form)."""
    chain = stored_event([11, 12, 13], None, list(range(12)))
    under = stored_event([14], 13, [100, 101, 102, 103])
    yield "array_stored_chain", mp([1764300000.25, [chain, under]])
    yield "array_with_dp_rank", mp([1764300000.5, [chain], 0])
    yield "map_stored_removed", mp({"ts": 1764300001.0, "events": [
        stored_event([21, 22], None, list(range(8)), as_map=True),
        {"type": "BlockRemoved", "block_hashes": [22], "medium": "GPU", "group_idx": 0}]})
    yield "bytes_hashes_lora", mp([2.0, [stored_event([b"\x01" * 32, b"\x02" * 32], b"\x00" * 32,
                                                    list(range(8)), lora="adapter-a")]])
    yield "cleared_then_stored", mp([3.0, [["AllBlocksCleared"], chain, ["BlockRemoved", [11, 12], "GPU"]]])
    yield "negative_hashes", mp([4.0, [stored_event([-5, -6], None, list(range(8)))]])
    yield "unknown_event", mp([5.0, [["SomethingNew", 1, 2], chain]])
    yield "size_mismatch", mp([6.0, [stored_event([31], None, list(range(16)), bs=16)]])
    yield "bad_token_count", mp([7.0, [stored_event([41, 42], None, [1, 2, 3])]])
    # Sixty blocks in one chain: more than the fuzz index holds, so eviction runs.
    yield "long_chain", mp([8.0, [stored_event(list(range(1000, 1060)), None, list(range(240)))]])
    yield "truncated", mp([1.0, [chain, under]])[:-7]
    # One engine hash stored twice with other tokens: the first kvroute hash must be removed.
    yield "restored_other_tokens", mp([9.0, [stored_event([51], None, [1, 2, 3, 4]),
                                             stored_event([51], None, [5, 6, 7, 8])]])


def zmtp_frame(body: bytes, more=False, command=False) -> bytes:
    flags = (1 if more else 0) | (4 if command else 0)
    if len(body) > 255:
        return bytes([flags | 2]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def zmtp_peer(messages, mechanism=b"NULL") -> bytes:
    """The bytes a ROUTER (vLLM's replay socket) sends a DEALER: greeting, READY, messages."""
    greeting = b"\xff" + b"\x00" * 7 + b"\x01\x7f" + bytes([3, 0]) + mechanism.ljust(20, b"\x00") + b"\x01" + b"\x00" * 31
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"ROUTER"
    out = greeting + zmtp_frame(ready, command=True)
    for frames in messages:
        for i, f in enumerate(frames):
            out += zmtp_frame(f, more=i + 1 < len(frames))
    return out


def grpc_message(payload: bytes, compressed=False) -> bytes:
    return bytes([1 if compressed else 0]) + struct.pack(">I", len(payload)) + payload


def pb_varint(n: int) -> bytes:
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def pb_bytes(tag: int, b) -> bytes:
    if isinstance(b, str):
        b = b.encode()
    return pb_varint(tag << 3 | 2) + pb_varint(len(b)) + b


def watch_request(gateway="gw-a", block_size=16, decisions=(), group="g1") -> bytes:
    out = pb_bytes(1, gateway) + pb_varint(2 << 3) + pb_varint(block_size)
    for d in decisions:
        out += pb_bytes(3, d)
    return out + pb_bytes(4, group)


def share_msg(relay=7, group="g1", peers=(), alive=(), gone=()) -> bytes:
    out = pb_varint(1 << 3 | 1) + struct.pack("<Q", relay) + pb_bytes(2, group)
    for gw, decisions, sent in peers:
        inner = pb_bytes(1, gw) + b"".join(pb_bytes(2, d) for d in decisions) + pb_varint(3 << 3) + pb_varint(sent)
        out += pb_bytes(3, inner)
    for a in alive:
        out += pb_bytes(4, a)
    for g in gone:
        out += pb_bytes(5, g)
    return out


def relay() -> None:
    batches = list(vllm_batches())
    for name, payload in batches:
        write("relay_vllm", name, payload)
    for name, payload in batches[:4]:
        write("relay_msgpack", name, payload)
    write("relay_msgpack", "every_type", mp([None, True, False, -1, -200, 300, 70000, 2**40, -(2**40),
                                             1.5, "s" * 40, b"\x00\x01", {"k": [1, {"n": None}]}])
          + b"\xca" + struct.pack(">f", 2.5) + b"\xd4\x01\x02" + b"\xc7\x02\x05ab")
    write("relay_msgpack", "huge_header", b"\xdd\xff\xff\xff\xff\x01")
    write("relay_msgpack", "deep_nesting", b"\x91" * 100 + b"\xc0")

    seq = lambda n: struct.pack(">Q", n)  # noqa: E731
    end = [b"", seq(2**64 - 1), b""]
    write("relay_zmtp", "replay_two_batches", zmtp_peer([
        [b"", b"kv-events", seq(0), batches[0][1]], [b"", seq(1), batches[2][1]], end]))
    write("relay_zmtp", "replay_end_only", zmtp_peer([end]))
    write("relay_zmtp", "ping_then_long_frame", zmtp_peer([]) + zmtp_frame(b"\x04PING\x00\x00", command=True)
          + b"".join(zmtp_frame(f, more=i < 2) for i, f in enumerate([b"", seq(5), b"x" * 300])) + b"".join(
              zmtp_frame(f, more=i < 2) for i, f in enumerate(end)))
    write("relay_zmtp", "curve_mechanism", zmtp_peer([end], mechanism=b"CURVE"))
    write("relay_zmtp", "short_sequence", zmtp_peer([[b"", b"\x00\x01", b"p"], end]))
    write("relay_zmtp", "truncated", zmtp_peer([[b"", seq(0), batches[0][1]]])[:-10])

    first = watch_request(decisions=[b"\x02" + b"\x00" * 20])
    write("relay_watch", "first_request", b"\x00" + grpc_message(first))
    write("relay_watch", "first_then_decisions", b"\x07" + grpc_message(first) + grpc_message(
        watch_request(gateway="", block_size=0, group="", decisions=[b"\x02abc", b"\x02" * 64])))
    write("relay_watch", "empty_gateway", b"\x01" + grpc_message(watch_request(gateway="", group="")))
    write("relay_watch", "compressed_flag", b"\x00" + grpc_message(first, compressed=True))
    write("relay_watch", "oversized_length", b"\x00\x00\x7f\xff\xff\xff" + first)
    write("relay_watch", "cut_mid_message", b"\x03" + grpc_message(first)[:-3])

    write("relay_nats", "decisions", share_msg(peers=[("gw-b", [b"\x02" + b"\x01" * 30], 1764300000000000000)]))
    write("relay_nats", "heartbeat", share_msg(alive=["gw-b", "gw-c"]))
    write("relay_nats", "gone", share_msg(gone=["gw-b"]))
    write("relay_nats", "everything", share_msg(relay=2**63, group="g2", peers=[("gw-b", [b"x", b"y"], 1), ("gw-d", [], 0)],
                                                alive=["gw-b"], gone=["gw-e", "gw-a"]))
    write("relay_nats", "not_protobuf", b"\xff\xff\xff\xff")


def main() -> None:
    for name, body in REQUESTS.items():
        for target in ("request", "hashing"):
            write(target, name, body)
    for name, body in MALFORMED.items():
        write("request", name, body)
    events()
    feedback()
    configs()
    relay()


if __name__ == "__main__":
    main()
