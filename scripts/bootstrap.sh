#!/usr/bin/env bash
# Makes sure this machine can build kvroute to wasm and run the wasm test suite, then writes
# build/toolchain.mk, which the Makefile includes. Idempotent and quick when everything is
# already present. Prints one line per tool saying which path it took.
#
# wasm toolchain, first that works:
#   1. rustup: the active toolchain already has wasm32-wasip1 and wasm32-unknown-unknown.
#   2. debian: Debian's rustc-web ships the std sources, lld and wasi-libc, so std is built
#      from source with -Zbuild-std (installed with apt-get when missing and we are root).
#   3. rustup-add: `rustup target add` (works where rustup can download).
# wasm-bindgen-test-runner: the version in Cargo.lock, else `cargo install` of exactly it.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
out="$root/build/toolchain.mk"
mkdir -p "$root/build"

log() { printf 'bootstrap: %s\n' "$*" >&2; }
die() { printf 'bootstrap: error: %s\n' "$*" >&2; exit 1; }

has_rustup_targets() {
    command -v rustc >/dev/null 2>&1 || return 1
    local sysroot
    sysroot=$(rustc --print sysroot 2>/dev/null) || return 1
    [ -d "$sysroot/lib/rustlib/wasm32-wasip1/lib" ] && [ -d "$sysroot/lib/rustlib/wasm32-unknown-unknown/lib" ]
}

debian_src() { ls -d /usr/src/rustc-*/library 2>/dev/null | sort -V | tail -n 1; }

# Debian's rustc expects `rust-lld`, which it does not ship; LLVM's wasm-ld is the same linker.
wasm_linker() {
    command -v rust-lld 2>/dev/null || ls /usr/lib/llvm-*/bin/wasm-ld 2>/dev/null | sort -V | tail -n 1
}

has_debian_recipe() {
    [ -x /usr/bin/rustc ] && [ -x /usr/bin/cargo ] && [ -n "$(debian_src)" ] \
        && [ -d /usr/lib/wasm32-wasi ] && [ -n "$(wasm_linker)" ]
}

install_debian_recipe() {
    [ "$(id -u)" = 0 ] || return 1
    command -v apt-get >/dev/null 2>&1 || return 1
    log "installing Debian's rustc-web toolchain (rustc-web cargo-web rust-web-src lld-22 wasi-libc)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2 || return 1
    apt-get install -y -qq --no-install-recommends \
        rustc-web cargo-web rust-web-src lld-22 wasi-libc >&2 || return 1
}

write_rustup() {
    cat >"$out" <<EOF
# written by scripts/bootstrap.sh: rustup toolchain with installed wasm targets
WASM_CARGO := cargo
WASM_ENV :=
WASM_STD_FLAGS :=
WASIP1_RUSTFLAGS :=
EOF
}

write_debian() {
    cat >"$out" <<EOF
# written by scripts/bootstrap.sh: Debian rustc-web, std built from source
WASM_CARGO := /usr/bin/cargo
WASM_ENV := RUSTC=/usr/bin/rustc RUSTDOC=/usr/bin/rustdoc RUSTC_BOOTSTRAP=1 PATH=/usr/bin:\$(PATH) CARGO_TARGET_WASM32_WASIP1_LINKER=$(wasm_linker) CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_LINKER=$(wasm_linker)
WASM_STD_FLAGS := -Zbuild-std=std,panic_abort
WASIP1_RUSTFLAGS := -L /usr/lib/wasm32-wasi -C link-self-contained=no
EOF
}

# ---- wasm toolchain (KVROUTE_WASM_TOOLCHAIN=debian|rustup forces a path, for testing both)
force=${KVROUTE_WASM_TOOLCHAIN:-}
if [ "$force" != debian ] && has_rustup_targets; then
    write_rustup
    log "wasm toolchain: rustup ($(rustc --version)) with wasm32-wasip1 + wasm32-unknown-unknown installed"
elif [ "$force" != rustup ] && { has_debian_recipe || install_debian_recipe; }; then
    has_debian_recipe || die "Debian rustc-web toolchain incomplete after install"
    write_debian
    log "wasm toolchain: debian ($(/usr/bin/rustc --version), std from $(debian_src))"
elif command -v rustup >/dev/null 2>&1 \
        && timeout 300 rustup target add wasm32-wasip1 wasm32-unknown-unknown >&2 \
        && has_rustup_targets; then
    write_rustup
    log "wasm toolchain: rustup-add (downloaded wasm32 targets)"
else
    die "no wasm32 toolchain: install the wasm32-wasip1 and wasm32-unknown-unknown targets (rustup target add ...) or, on Debian as root, rerun to install rustc-web"
fi

# ---- wasm-bindgen-test-runner, exactly the wasm-bindgen version in Cargo.lock
want=$(awk '/^name = "wasm-bindgen"$/ { getline; gsub(/[^0-9.]/, ""); print; exit }' "$root/Cargo.lock")
[ -n "$want" ] || die "wasm-bindgen not found in Cargo.lock"
have=$(wasm-bindgen-test-runner --version 2>/dev/null | awk '{print $2}' || true)
if [ "$have" = "$want" ]; then
    log "wasm-bindgen-test-runner: $want already installed"
else
    command -v node >/dev/null 2>&1 || die "node is required to run the wasm test suite"
    log "wasm-bindgen-test-runner: installing wasm-bindgen-cli $want (a few minutes, once)"
    # --locked first for a reproducible build; some pinned transitive versions can be missing
    # from the registry mirror, so fall back to fresh resolution.
    cargo install -q wasm-bindgen-cli --version "$want" --locked >&2 \
        || cargo install -q wasm-bindgen-cli --version "$want" >&2 \
        || die "cargo install wasm-bindgen-cli $want failed"
fi
echo "WASM_BINDGEN_RUNNER := $(command -v wasm-bindgen-test-runner || echo "$HOME/.cargo/bin/wasm-bindgen-test-runner")" >>"$out"
