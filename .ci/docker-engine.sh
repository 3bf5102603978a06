#!/usr/bin/env bash
# Make sure a Docker engine answers on this machine, installing and starting
# one when none does. Used by .ci/run before the container tests, and by
# developers on a fresh machine:
#
#     sudo bash .ci/docker-engine.sh
#
# What it does, each step only when needed:
#   1. installs Debian's docker.io (engine + containerd + runc) and
#      docker-compose (v1.29; the Compose v2 plugin is not packaged for
#      bookworm) with apt-get, non-interactively;
#   2. starts dockerd in the background (logs: $DOCKERD_LOG) when
#      `docker info` does not answer;
#   3. waits up to $DOCKER_WAIT_S seconds until `docker info` works.
# It exits non-zero with a message saying what failed and where to look.
# Idempotent: on a machine whose engine already answers it changes nothing.
set -euo pipefail

DOCKERD_LOG=${DOCKERD_LOG:-/var/log/hybridrec-dockerd.log}
DOCKER_WAIT_S=${DOCKER_WAIT_S:-60}

say() { echo "[docker-engine] $*" >&2; }
fail() {
    say "ERROR: $*"
    exit 1
}

engine_answers() { docker info >/dev/null 2>&1; }

if command -v docker >/dev/null 2>&1 && engine_answers; then
    say "engine already answers: $(docker version --format 'server {{.Server.Version}}' 2>/dev/null)"
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    fail "no Docker engine answers and this script is not root, so it cannot install or start one.
        Start an engine yourself (or run: sudo bash $0)."
fi

need_pkgs=()
command -v dockerd >/dev/null 2>&1 || need_pkgs+=(docker.io)
command -v docker >/dev/null 2>&1 || need_pkgs+=(docker.io)
# Compose: either the v2 plugin (`docker compose`) or Debian's v1.29.
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null 2>&1; then
    need_pkgs+=(docker-compose)
fi
if [ "${#need_pkgs[@]}" -gt 0 ]; then
    command -v apt-get >/dev/null 2>&1 \
        || fail "missing ${need_pkgs[*]} and no apt-get to install them; install a Docker engine by hand."
    say "installing ${need_pkgs[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null || fail "apt-get update failed (is Debian's archive reachable?)"
    # shellcheck disable=SC2046
    apt-get install -y -qq --no-install-recommends $(printf '%s\n' "${need_pkgs[@]}" | sort -u) \
        iptables >/dev/null \
        || fail "apt-get install ${need_pkgs[*]} failed"
fi
command -v dockerd >/dev/null 2>&1 || fail "dockerd not found after installing docker.io"

if ! engine_answers; then
    # A dockerd we started earlier may still be starting, or may have died
    # and left its pid file behind (dockerd refuses to start over it).
    if [ -f /var/run/docker.pid ] && ! kill -0 "$(cat /var/run/docker.pid)" 2>/dev/null; then
        rm -f /var/run/docker.pid
    fi
    if ! pgrep -x dockerd >/dev/null 2>&1; then
        say "starting dockerd in the background (log: $DOCKERD_LOG)"
        mkdir -p "$(dirname "$DOCKERD_LOG")"
        # setsid: the engine must outlive this script and the shell that ran it.
        setsid nohup dockerd >>"$DOCKERD_LOG" 2>&1 </dev/null &
    else
        say "dockerd is running but not answering yet; waiting"
    fi
fi

deadline=$((SECONDS + DOCKER_WAIT_S))
until engine_answers; do
    if [ "$SECONDS" -ge "$deadline" ]; then
        say "last lines of $DOCKERD_LOG:"
        tail -n 30 "$DOCKERD_LOG" >&2 2>/dev/null || true
        fail "no Docker engine answers after ${DOCKER_WAIT_S}s; see $DOCKERD_LOG"
    fi
    if ! pgrep -x dockerd >/dev/null 2>&1; then
        say "last lines of $DOCKERD_LOG:"
        tail -n 30 "$DOCKERD_LOG" >&2 2>/dev/null || true
        fail "dockerd exited while starting; see $DOCKERD_LOG"
    fi
    sleep 1
done
say "engine answers: $(docker version --format 'server {{.Server.Version}}, storage driver' 2>/dev/null) $(docker info --format '{{.Driver}}' 2>/dev/null)"
