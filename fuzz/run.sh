#!/usr/bin/env bash
# Runs each fuzz target for a bounded time, one after the other, and prints executions and
# crashes per target. Used by `make fuzz` (mk/fuzz.mk), which sets the variables below.
#
# New corpus entries go to build/fuzz/corpus/<target> (the committed seeds in
# fuzz/corpus/<target> are read, never written); crashes and slow inputs to
# build/fuzz/artifacts/<target>/. Exit status 1 when any target crashed.
set -uo pipefail

: "${CARGO_FUZZ:?}" "${FUZZ_SECONDS:=120}" "${FUZZ_TARGETS:=request hashing events feedback config relay_zmtp relay_msgpack relay_vllm relay_watch relay_nats}"
: "${FUZZ_MAX_LEN:=16384}" "${FUZZ_TIMEOUT:=10}" "${FUZZ_NICE:=10}"
OUT=build/fuzz
FLAGS=(--sanitizer none --fuzz-dir fuzz --target-dir "$OUT/target" -O --debug-assertions)

# One build of every target first, so the time budget is spent fuzzing.
nice -n "$FUZZ_NICE" "$CARGO_FUZZ" fuzz build "${FLAGS[@]}" || exit 2

summary=()
failed=0
for t in $FUZZ_TARGETS; do
    mkdir -p "$OUT/corpus/$t" "$OUT/artifacts/$t"
    log="$OUT/$t.log"
    before=$(ls "$OUT/artifacts/$t" | wc -l)
    echo "fuzz: $t for ${FUZZ_SECONDS}s (log: $log)"
    nice -n "$FUZZ_NICE" "$CARGO_FUZZ" fuzz run "${FLAGS[@]}" "$t" "$OUT/corpus/$t" "fuzz/corpus/$t" -- \
        -max_total_time="$FUZZ_SECONDS" -max_len="$FUZZ_MAX_LEN" -timeout="$FUZZ_TIMEOUT" \
        -print_final_stats=1 -artifact_prefix="$OUT/artifacts/$t/" >"$log" 2>&1
    rc=$?
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
    if [ -z "$execs" ]; then
        execs=$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#')
    fi
    crashes=$(( $(ls "$OUT/artifacts/$t" | wc -l) - before ))
    if [ "$rc" -ne 0 ] && [ "$crashes" -eq 0 ]; then
        crashes=1 # libFuzzer failed without writing an artifact: count it, show the log
    fi
    corpus=$(ls "$OUT/corpus/$t" | wc -l)
    summary+=("$(printf '%-13s execs %12s  crashes %d  corpus %d (+%d seeds)' \
        "$t" "${execs:-?}" "$crashes" "$corpus" "$(ls "fuzz/corpus/$t" | wc -l)")")
    if [ "$crashes" -ne 0 ]; then
        failed=1
        grep -E 'panicked|ERROR|SUMMARY|Test unit written' "$log" | head -20
    fi
done
echo "fuzz summary (${FUZZ_SECONDS}s per target):"
printf '  %s\n' "${summary[@]}"
if [ "$failed" -ne 0 ]; then
    echo "fuzz: crashes found; reproducers in $OUT/artifacts/<target>/ (replay: $CARGO_FUZZ fuzz run ${FLAGS[*]} <target> <file>)"
fi
exit "$failed"
