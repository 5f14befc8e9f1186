#!/usr/bin/env bash
# Prometheus for the dashboard test (tests/e2e/test_dashboard.py): Debian's package, downloaded
# with apt-get and unpacked into build/prometheus/ (nothing installed, no service started).
# Idempotent. Needs Debian's package lists: when they are missing, `apt-get update` runs if we
# are root (as scripts/bootstrap.sh does for the wasm toolchain).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/build/prometheus"
bin="$dest/prometheus"

log() { printf 'prometheus: %s\n' "$*" >&2; }
die() { printf 'prometheus: error: %s\n' "$*" >&2; exit 1; }

if [ -x "$bin" ] && "$bin" --version >/dev/null 2>&1; then
    exit 0
fi
command -v apt-get >/dev/null 2>&1 || die "apt-get not found: install Prometheus and set PROMETHEUS_BIN"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# apt's download user must be able to write there.
chmod 755 "$tmp"
download() { (cd "$tmp" && apt-get download -q prometheus >&2); }
if ! download; then
    [ "$(id -u)" = 0 ] || die "apt-get download prometheus failed (run apt-get update as root)"
    log "updating Debian's package lists"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    download || die "apt-get download prometheus failed"
fi
dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/x"
mkdir -p "$dest"
cp "$tmp/x/usr/bin/prometheus" "$bin.new"
mv "$bin.new" "$bin"
log "$("$bin" --version 2>&1 | head -n 1) in $dest"
