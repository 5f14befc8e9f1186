#!/usr/bin/env bash
# End-to-end test of the docker-compose quickstart on a real Docker engine: builds what is
# missing, starts examples/docker-compose under a unique project name on free loopback ports,
# checks routing, disaggregation, failover and metrics through Envoy, precise mode (both
# gateways' relay streams live), affinity across the two gateways and the loss of a gateway,
# and removes every container, network and volume it created, also when it fails or is
# interrupted.
#
#   scripts/compose-test.sh            (make compose-test)
#
# No Docker engine: a skip (exit 0) with the reason, or a failure when
# KVROUTE_REQUIRE_DOCKER=1 (CI). Environment: KVROUTE_WASM (use this wasm instead of
# `make wasm`), KVROUTE_KEEP=1 (leave the stack up for a look; prints how to remove it).
# All traffic goes to 127.0.0.1: the published Envoy ports.
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
compose_file=examples/docker-compose/docker-compose.yaml
started=$(date +%s)

say() { printf 'compose-test: %s\n' "$*"; }
die() { printf 'compose-test: error: %s\n' "$*" >&2; exit 1; }

skip_or_fail() {
    if [ "${KVROUTE_REQUIRE_DOCKER:-0}" = 1 ]; then
        die "$1 (KVROUTE_REQUIRE_DOCKER=1, so this is a failure)"
    fi
    say "skipped: $1 (set KVROUTE_REQUIRE_DOCKER=1 to make this a failure)"
    exit 0
}

# ---- preconditions
command -v docker >/dev/null 2>&1 || skip_or_fail "docker is not installed"
timeout 20 docker info >/dev/null 2>&1 || skip_or_fail "no Docker engine answers 'docker info'"
if docker compose version >/dev/null 2>&1; then
    compose_cmd=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
    compose_cmd=(docker-compose)
else
    skip_or_fail "neither 'docker compose' nor 'docker-compose' is installed"
fi
for tool in curl python3; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool is required"
done

# ---- inputs: the wasm and the images (both steps are no-ops when up to date)
if [ -n "${KVROUTE_WASM:-}" ]; then
    [ -f "$KVROUTE_WASM" ] || die "KVROUTE_WASM=$KVROUTE_WASM does not exist"
    KVROUTE_WASM=$(cd "$(dirname "$KVROUTE_WASM")" && pwd)/$(basename "$KVROUTE_WASM")
else
    make --no-print-directory wasm >&2 || die "make wasm failed"
    KVROUTE_WASM=$root/build/kvroute.wasm
fi
export KVROUTE_WASM
# The Envoy image build-images.sh makes (envoy/VERSION unless ENVOY_VERSION says otherwise).
ENVOY_VERSION=${ENVOY_VERSION:-$(cat envoy/VERSION)}
export ENVOY_VERSION ENVOY_IMAGE=${ENVOY_IMAGE:-envoyproxy/envoy:v$ENVOY_VERSION}
# And the nats-server image (the Makefile's NATS_VERSION unless NATS_VERSION says otherwise).
NATS_VERSION=${NATS_VERSION:-$(sed -n 's/^NATS_VERSION *:= *//p' Makefile)}
export NATS_VERSION NATS_IMAGE=${NATS_IMAGE:-kvroute/nats:$NATS_VERSION}
scripts/build-images.sh || die "building the images failed"
inputs_ready=$(date +%s)

# ---- a unique project on free ports, so parallel runs and `make run` never collide
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
project=kvroute-test-$$-$(date +%s)
KVROUTE_PORT=$(free_port)
KVROUTE_ADMIN_PORT=$(free_port)
KVROUTE_PORT_2=$(free_port)
KVROUTE_ADMIN_PORT_2=$(free_port)
export KVROUTE_PORT KVROUTE_ADMIN_PORT KVROUTE_PORT_2 KVROUTE_ADMIN_PORT_2
# Fresh secrets for this run: the relay token (relays and Envoys) and NATS's relay password.
KVROUTE_RELAY_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
KVROUTE_NATS_PASSWORD=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
export KVROUTE_RELAY_TOKEN KVROUTE_NATS_PASSWORD
unset KVROUTE_BIND KVROUTE_ENVOY_CONFIG
base1=http://127.0.0.1:$KVROUTE_PORT
admin1=http://127.0.0.1:$KVROUTE_ADMIN_PORT
base2=http://127.0.0.1:$KVROUTE_PORT_2
admin2=http://127.0.0.1:$KVROUTE_ADMIN_PORT_2
# The gateway the single-gateway checks use; envoy-2 once envoy-1 has been killed.
base=$base1
admin=$admin1
tmp=$(mktemp -d)
compose() { "${compose_cmd[@]}" -p "$project" -f "$compose_file" "$@"; }

torn_down=0
teardown() {
    [ "$torn_down" = 1 ] && return
    torn_down=1
    if [ "${KVROUTE_KEEP:-0}" = 1 ]; then
        say "KVROUTE_KEEP=1: stack left up; remove it with: ${compose_cmd[*]} -p $project -f $compose_file down -v --remove-orphans"
        return
    fi
    compose down -v --remove-orphans --timeout 5 >"$tmp/down.log" 2>&1 \
        || { say "compose down failed:"; cat "$tmp/down.log"; }
}
on_exit() {
    local rc=$?
    teardown
    rm -rf "$tmp"
    exit "$rc"
}
trap on_exit EXIT
trap 'say "interrupted"; exit 130' INT TERM

passed=0
failed=0
pass() { passed=$((passed + 1)); say "ok   $1"; }
fail() { failed=$((failed + 1)); say "FAIL $1"; }
check() { local name=$1; shift; if "$@"; then pass "$name"; else fail "$name"; fi; }

# ---- HTTP helpers. post PATH BODY_FILE NAME: writes $tmp/NAME.{h,b}, echoes the status.
# post_at BASE_URL PATH BODY_FILE NAME: the same through a given gateway.
post_at() {
    curl -s -m 60 -o "$tmp/$4.b" -D "$tmp/$4.h" -w '%{http_code}' \
        -H 'content-type: application/json' --data-binary "@$3" "$1$2" || echo 000
}
post() { post_at "$base" "$@"; }
# hdr NAME HEADER: the value of a response header (case-insensitive), empty if absent.
hdr() {
    awk -v h="$(tr '[:upper:]' '[:lower:]' <<<"$2")" -F': ' \
        'tolower($1) == h { sub(/\r$/, "", $2); print $2; exit }' "$tmp/$1.h" 2>/dev/null
}
# cached NAME: usage.prompt_tokens_details.cached_tokens of a non-streaming answer.
cached() {
    python3 -c 'import json,sys; u=json.load(open(sys.argv[1]))["usage"]; print((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0))' \
        "$tmp/$1.b" 2>/dev/null || echo -1
}
# prompt FILE SEED CHARS [STREAM]: a completions body with a prompt of about CHARS
# characters of varied words, the same for the same seed.
prompt() {
    python3 - "$@" <<'EOF'
import json, random, sys
path, seed, chars = sys.argv[1], sys.argv[2], int(sys.argv[3])
r = random.Random(seed)
words = ["kernel", "router", "token", "cache", "prefix", "engine", "decode", "memory",
         "tensor", "matrix", "shard", "replica", "queue", "vector", "window", "budget"]
out, n = [], 0
while n < chars:
    w = f"{r.choice(words)}{r.randrange(10000)}"
    out.append(w)
    n += len(w) + 1
json.dump({"model": "mock-model", "prompt": " ".join(out), "max_tokens": 4}, open(path, "w"))
EOF
}
# chat FILE SEED TURNS: turn TURNS of one conversation (a chat body whose messages extend
# those of turn TURNS-1), about 400 characters per user message.
chat() {
    python3 - "$@" <<'EOF'
import json, random, sys
path, seed, turns = sys.argv[1], sys.argv[2], int(sys.argv[3])
r = random.Random(seed)
words = ["kernel", "router", "token", "cache", "prefix", "engine", "decode", "memory",
         "tensor", "matrix", "shard", "replica", "queue", "vector", "window", "budget"]
msgs = [{"role": "system", "content": f"You are assistant {seed}."}]
for t in range(turns):
    if t:
        msgs.append({"role": "assistant", "content": f"Answer {t} about {r.choice(words)}."})
    msgs.append({"role": "user", "content": " ".join(f"{r.choice(words)}{r.randrange(10000)}" for _ in range(40))})
json.dump({"model": "mock-model", "messages": msgs, "max_tokens": 4}, open(path, "w"))
EOF
}
# prom ADMIN_URL METRIC: the sum of a metric's series in that Envoy's /stats/prometheus.
prom() {
    curl -s -m 5 "$1/stats/prometheus" 2>/dev/null \
        | awk -v m="$2" '$1 == m || index($1, m "{") == 1 { s += $NF; n++ } END { if (n) print s + 0; else print "absent" }'
}

dump_logs() {
    local s
    for s in envoy-1 envoy-2 relay-1 relay-2 nats; do
        say "---- last $s log lines"
        compose logs --no-color --tail 25 "$s" 2>&1 | sed 's/^/    /'
    done
}

# ---- start
say "project $project: envoy-1 on 127.0.0.1:$KVROUTE_PORT (admin $KVROUTE_ADMIN_PORT), envoy-2 on 127.0.0.1:$KVROUTE_PORT_2 (admin $KVROUTE_ADMIN_PORT_2) ($(${compose_cmd[@]} version --short 2>/dev/null || echo compose))"
if ! compose up -d >"$tmp/up.log" 2>&1; then
    cat "$tmp/up.log"
    fail "stack starts"
    dump_logs
    say "$passed passed, $failed failed"
    exit 1
fi

# Ready = both Envoys are LIVE and every cluster has all its hosts resolved and passing
# /health. 6 worker clusters plus decode-pool; host counts from envoy.yaml (worker + its
# fallbacks).
declare -A want=([decode-1]=4 [decode-2]=4 [decode-3]=4 [decode-4]=4 [prefill-1]=2 [prefill-2]=2 [decode-pool]=4)
healthy_at() {
    curl -s -m 2 "$1/ready" 2>/dev/null | grep -q LIVE || return 1
    curl -s -m 2 "$1/clusters" >"$tmp/clusters" 2>/dev/null || return 1
    local c n
    for c in "${!want[@]}"; do
        n=$(grep -c "^$c::.*::health_flags::healthy$" "$tmp/clusters")
        [ "$n" -eq "${want[$c]}" ] || return 1
    done
}
all_healthy() { healthy_at "$admin1" && healthy_at "$admin2"; }
running() {
    local id
    id=$(compose ps -q "$1" 2>/dev/null)
    [ -n "$id" ] && [ "$(docker inspect -f '{{.State.Running}}' "$id" 2>/dev/null)" = true ]
}
# Envoy and the relay exit at once on a bad config or a wasm that does not load.
stack_running() { running envoy-1 && running envoy-2 && running relay-1 && running relay-2; }
deadline=$(( $(date +%s) + 60 ))
until all_healthy; do
    if [ "$(date +%s)" -ge "$deadline" ] || ! stack_running; then break; fi
    sleep 0.5
done
if all_healthy; then
    pass "stack up: both Envoys ready, 6 workers healthy in $(( $(date +%s) - inputs_ready ))s (wasm and images ready in $(( inputs_ready - started ))s)"
else
    fail "stack up within 60 s"
    grep health_flags "$tmp/clusters" 2>/dev/null | sed 's/^/    /'
    dump_logs
    say "$passed passed, $failed failed"
    exit 1
fi

# ---- 0. precise mode: each gateway holds a live gRPC stream to its own relay (the relays
# connect to the six workers' KV event sockets and to NATS at start-up).
streams_live() {
    [ "$(prom "$admin1" kvroute_precise_stream_live)" = 1 ] && [ "$(prom "$admin2" kvroute_precise_stream_live)" = 1 ]
}
deadline=$(( $(date +%s) + 30 ))
until streams_live || [ "$(date +%s)" -ge "$deadline" ]; do sleep 0.5; done
check "both gateways' relay streams are live (kvroute_precise_stream_live: envoy-1 $(prom "$admin1" kvroute_precise_stream_live), envoy-2 $(prom "$admin2" kvroute_precise_stream_live))" streams_live
# ...with authentication on: the relays demand the token (which the Envoys sent), and both
# reached NATS as its user (the server refuses anonymous clients).
auth_on() {
    local r
    for r in relay-1 relay-2; do
        # To a file first: `grep -q` ends the pipe early, and pipefail would count that.
        compose logs --no-color "$r" >"$tmp/$r.log" 2>&1 || return 1
        grep -q "gRPC clients must send the relay token" "$tmp/$r.log" || return 1
        grep -q 'NATS user "relay"' "$tmp/$r.log" || return 1
    done
}
check "both relays require the token and log in to NATS as user relay" auth_on

# ---- 1. traffic kvroute does not route passes through (GET /v1/models -> decode-pool)
code=$(curl -s -m 10 -o "$tmp/models.b" -D "$tmp/models.h" -w '%{http_code}' "$base/v1/models" || echo 000)
check "GET /v1/models passes through (HTTP $code)" test "$code" = 200

# ---- 2. prefix affinity: one prompt (~750 tokens, below the prefill threshold) five times.
# The shipped config has kvroute's debug headers off; each worker names itself in x-worker-id.
prompt "$tmp/affine.json" affinity 3000
affine_served=()
affine_ok=1
for i in 1 2 3 4 5; do
    code=$(post /v1/completions "$tmp/affine.json" "affine$i")
    [ "$code" = 200 ] || affine_ok=0
    affine_served+=("$(hdr "affine$i" x-worker-id)")
done
affine=${affine_served[0]}
check "completions answer 200 through kvroute" test "$affine_ok" = 1
debug=$(grep -il '^x-kvroute-' "$tmp"/affine*.h | wc -l)
check "no kvroute debug headers reach clients ($debug of 5 responses carry x-kvroute-*)" test "$debug" = 0
check "responses name the serving worker (x-worker-id: ${affine:-absent})" test -n "$affine"
same=1
for i in 0 1 2 3 4; do
    [ "${affine_served[$i]}" = "$affine" ] || same=0
done
check "same prompt x5 -> same worker (served by ${affine_served[*]})" test "$same" = 1 -a -n "$affine"
c5=$(cached affine5)
check "repeat hits the worker's prefix cache (cached_tokens $c5 of the 5th request)" test "$c5" -gt 0

# ---- 3. disaggregation: a cold ~28k-char prompt (~6000+ tokens > threshold 5000)
prompt "$tmp/long.json" "long-$project" 28000
code=$(post /v1/completions "$tmp/long.json" long1)
# A prefill worker that hands off relays the decode worker's response: x-worker-id is the
# decode worker, and the prefill worker adds its own name in x-prefill-worker-id.
pw=$(hdr long1 x-prefill-worker-id)
dw=$(hdr long1 x-worker-id)
check "long cold prompt answers 200 (HTTP $code)" test "$code" = 200
check "long cold prompt goes to the prefill pool, which hands off to a decode worker (prefill ${pw:-absent}, decode ${dw:-absent})" \
    bash -c '[[ $0 == prefill-[12] && $1 == decode-[1-4] ]]' "$pw" "$dw"
# Again: kvroute knows the KV now sits on $dw, so it goes there directly (no prefill) and
# the decode worker finds almost all of the prompt cached: proof the hand-off went where
# kvroute decided.
code=$(post /v1/completions "$tmp/long.json" long2)
c2=$(cached long2)
p2=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["usage"]["prompt_tokens"])' "$tmp/long2.b" 2>/dev/null || echo 0)
check "same long prompt again stays on $dw without prefill (worker $(hdr long2 x-worker-id), prefill '$(hdr long2 x-prefill-worker-id)', cached $c2 of $p2)" \
    test "$code" = 200 -a "$(hdr long2 x-worker-id)" = "$dw" -a -z "$(hdr long2 x-prefill-worker-id)" -a "$c2" -gt $((p2 * 9 / 10))

# ---- 4. streaming chat goes through Envoy intact
cat >"$tmp/chat.json" <<'EOF'
{"model":"mock-model","messages":[{"role":"user","content":"Say hello."}],"max_tokens":5,"stream":true,"stream_options":{"include_usage":true}}
EOF
code=$(post /v1/chat/completions "$tmp/chat.json" chat)
events=$(grep -c '^data: {' "$tmp/chat.b" 2>/dev/null)
events=${events:-0}
check "streaming chat: 200, $events SSE events, ends with [DONE]" \
    test "$code" = 200 -a "$events" -ge 6 -a "$(grep -c '^data: \[DONE\]' "$tmp/chat.b" 2>/dev/null)" = 1

# ---- 5. metrics
curl -s -m 5 "$admin/stats/prometheus" >"$tmp/prom" 2>/dev/null
kv_lines=$(grep -c '^kvroute_' "$tmp/prom")
decisions=$(awk '/^kvroute_worker_decisions_total/ { s += $NF } END { print s + 0 }' "$tmp/prom")
check "kvroute_ metrics in /stats/prometheus ($kv_lines series)" test "$kv_lines" -gt 0
check "kvroute_worker_decisions_total counts the routed requests (sum $decisions)" test "$decisions" -ge 8

# ---- 6. two gateways, one view: a conversation whose turns alternate between envoy-1 and
# envoy-2 stays on one worker. Each gateway learns where the other sent the conversation
# from its relay: the other gateway's decision over NATS at once, the engine's own KV events
# right after the prefill.
conv=conv-$project
conv_served=()
conv_ok=1
for t in 1 2 3 4 5 6; do
    chat "$tmp/conv$t.json" "$conv" "$t"
    if [ $((t % 2)) = 1 ]; then gw=$base1; else gw=$base2; fi
    code=$(post_at "$gw" /v1/chat/completions "$tmp/conv$t.json" "conv$t")
    [ "$code" = 200 ] || conv_ok=0
    conv_served+=("$(hdr "conv$t" x-worker-id)")
done
home=${conv_served[0]}
same=1
for w in "${conv_served[@]}"; do [ "$w" = "$home" ] || same=0; done
check "a conversation alternating envoy-1/envoy-2 stays on one worker (turns served by ${conv_served[*]})" \
    test "$conv_ok" = 1 -a "$same" = 1 -a -n "$home"
received=$(prom "$admin2" kvroute_peers_received_total)
check "envoy-2 received envoy-1's decisions through the relays and NATS (kvroute_peers_received_total $received)" \
    test "$received" != absent -a "${received%.*}" -gt 0 2>/dev/null

# ---- 7. a gateway dies: the conversation goes on through envoy-2 while envoy-1 is killed
# (docker kill: no drain, its relay stream just breaks). Not one request may fail, and the
# conversation keeps its worker.
(
    for t in $(seq 7 16); do
        chat "$tmp/conv$t.json" "$conv" "$t"
        code=$(post_at "$base2" /v1/chat/completions "$tmp/conv$t.json" "conv$t")
        printf '%s %s\n' "$code" "$(hdr "conv$t" x-worker-id)" >>"$tmp/gw-loss"
        sleep 0.3
    done
) &
loop=$!
sleep 1
if compose kill envoy-1 >"$tmp/kill.log" 2>&1; then
    pass "killed envoy-1 while requests go through envoy-2 ($(wc -l <"$tmp/gw-loss" 2>/dev/null || echo 0) of 10 sent before the kill)"
else
    fail "kill envoy-1: $(tail -n 1 "$tmp/kill.log")"
fi
wait "$loop"
gw_ok=$(awk '$1 == 200' "$tmp/gw-loss" | wc -l)
gw_home=$(awk -v w="$home" '$1 == 200 && $2 == w' "$tmp/gw-loss" | wc -l)
check "envoy-1 gone: envoy-2 answered $gw_ok/10 requests 200, $gw_home of them on the conversation's worker $home (served by $(awk '{ printf "%s ", $2 }' "$tmp/gw-loss"))" \
    test "$gw_ok" = 10 -a "$gw_home" = 10
check "envoy-2's relay stream is still live after envoy-1's death" \
    test "$(prom "$admin2" kvroute_precise_stream_live)" = 1
# The rest runs through the surviving gateway.
base=$base2
admin=$admin2

# ---- 8. failover: kill a decode worker; every request must still get an answer (envoy-2)
victim=${affine:-decode-1}
case $victim in decode-[1-4]) ;; *) victim=decode-1 ;; esac
victim_id=$(compose ps -q "$victim" 2>/dev/null)
if [ -z "$victim_id" ] || ! docker kill "$victim_id" >/dev/null 2>&1; then
    fail "kill $victim"
else
    pass "killed $victim (the affinity worker)"
    fo_ok=0
    fo_total=0
    retried=0
    served_by=()
    # Requests right after the kill (Envoy has not noticed yet: retries do the work), then
    # after the health checks and DNS have dropped the worker.
    for round in early late; do
        [ "$round" = late ] && sleep 3
        for i in 1 2 3 4 5 6; do
            if [ "$i" -le 2 ]; then
                body=$tmp/affine.json              # kvroute still prefers the dead worker
            else
                prompt "$tmp/fo-$round-$i.json" "fo-$round-$i-$project" 1500
                body=$tmp/fo-$round-$i.json
            fi
            code=$(post /v1/completions "$body" "fo-$round-$i")
            fo_total=$((fo_total + 1))
            [ "$code" = 200 ] && [ "$(hdr "fo-$round-$i" x-worker-id)" != "$victim" ] && fo_ok=$((fo_ok + 1))
            [ "$(hdr "fo-$round-$i" x-envoy-attempt-count)" -gt 1 ] 2>/dev/null && retried=$((retried + 1))
            served_by+=("$(hdr "fo-$round-$i" x-worker-id)")
        done
    done
    check "with $victim dead, $fo_ok/$fo_total requests answered 200 by live workers ($retried needed a retry; served by ${served_by[*]})" \
        test "$fo_ok" = "$fo_total"
fi

# ---- 9. teardown leaves nothing behind
[ "$failed" = 0 ] || dump_logs
teardown
leftover=$(
    docker ps -aq --filter "label=com.docker.compose.project=$project"
    docker network ls -q --filter "label=com.docker.compose.project=$project"
    docker volume ls -q --filter "label=com.docker.compose.project=$project"
    docker ps -aq --filter "name=^$project[-_]"
    docker network ls -q --filter "name=^$project[-_]"
)
if [ "${KVROUTE_KEEP:-0}" != 1 ]; then
    check "down -v removed every container, network and volume of $project" test -z "$leftover"
fi

say "finished in $(( $(date +%s) - started ))s"
say "$passed passed, $failed failed"
[ "$failed" = 0 ]
