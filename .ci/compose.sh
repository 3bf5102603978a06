#!/usr/bin/env bash
# Both Compose flavours the product supports, so CI tests both: Debian's
# docker-compose 1.29 and the Compose v2 plugin (`docker compose`). Bookworm
# packages no v2 plugin; trixie's `docker-compose` package is the v2 plugin, a
# static Go binary, so only its .deb is fetched from Debian's archive and the
# binary installed as a CLI plugin. Idempotent; run as root.
#
# The archive is the one this machine's apt already uses, or $DEBIAN_MIRROR
# (deploy/debian-mirror.sh).
set -euo pipefail
say() { echo "[compose] $*" >&2; }
# shellcheck source=deploy/debian-mirror.sh
. "$(dirname "$0")/../deploy/debian-mirror.sh"
export DEBIAN_FRONTEND=noninteractive

# The one-line apt source of trixie's main component on the archive `$1`.
trixie_source() {
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $1 trixie main"
}

if ! command -v docker-compose >/dev/null 2>&1; then
    apt-get install -y -qq --no-install-recommends docker-compose >/dev/null \
        || { apt-get update -qq && apt-get install -y -qq --no-install-recommends docker-compose >/dev/null; }
fi
if ! docker compose version >/dev/null 2>&1; then
    mirror=$(debian_mirror)
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    mkdir -p "$tmp/lists/partial" "$tmp/deb"
    trixie_source "$mirror" > "$tmp/trixie.list"
    apt_opts=(-o "Dir::Etc::SourceList=$tmp/trixie.list" -o "Dir::Etc::SourceParts=-" -o "Dir::State::Lists=$tmp/lists")
    say "fetching the Compose v2 plugin (trixie's docker-compose package) from $mirror"
    chown -R _apt "$tmp" 2>/dev/null || true
    apt-get "${apt_opts[@]}" update -qq >/dev/null
    (cd "$tmp/deb" && apt-get "${apt_opts[@]}" download docker-compose >/dev/null)
    dpkg-deb -x "$tmp"/deb/docker-compose_*.deb "$tmp/x"
    # the package also ships a small /usr/bin wrapper script; the plugin is the big binary
    plugin=$(find "$tmp/x" -type f -name docker-compose -size +1M | head -n 1)
    [ -n "$plugin" ] || { say "ERROR: no docker-compose binary in the trixie package"; exit 1; }
    install -D -m 0755 "$plugin" /usr/local/lib/docker/cli-plugins/docker-compose
fi
docker compose version >/dev/null 2>&1 || { say "ERROR: docker compose (v2) does not work after installing it"; exit 1; }
say "$(docker compose version) / docker-compose $(docker-compose version --short 2>/dev/null)"
