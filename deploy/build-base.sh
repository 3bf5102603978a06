#!/usr/bin/env bash
# Build the local base image for machines that cannot pull from a registry
# (this one, an air-gapped cluster's build host): Debian bookworm "minbase"
# made with debootstrap from Debian's archive, plus python3 (3.11, the
# version the wheelhouse is built for), python3-venv, libpython3.11 (the
# interpreter Triton's Python backend embeds: `serve inference --engine
# triton`), ca-certificates and
# nats-server (the NATS JetStream broker of online training: the compose
# profile `online` and deploy/k8s/components/online run it from this image),
# turned into an image with `docker import`.
#
#     sudo bash deploy/build-base.sh            # -> hybridrec-base:bookworm
#
# Idempotent: does nothing when the image already exists and was made from
# what this script includes (the image's label org.hybridrec.base records the
# suite and the package list); an image made by an older version of the
# script, with other packages or no label, is rebuilt. FORCE=1 always rebuilds.
# Needs root (debootstrap), debootstrap (installed with apt-get when
# missing), a Docker engine, and a Debian archive: $DEBIAN_MIRROR, else the
# one this machine's apt uses (deploy/debian-mirror.sh).
set -euo pipefail

BASE_IMAGE=${BASE_IMAGE:-hybridrec-base:bookworm}
SUITE=${SUITE:-bookworm}
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=deploy/debian-mirror.sh
. "$here/debian-mirror.sh"
work=${BUILD_DIR:-$here/.build}/base-rootfs
# What debootstrap adds to minbase. Changing this list makes the next run
# rebuild an existing image (see the label below).
INCLUDE=python3,python3-venv,libpython3.11,ca-certificates,nats-server
LABEL=org.hybridrec.base
want="$SUITE minbase $INCLUDE"

say() { echo "[build-base] $*" >&2; }

if [ "${FORCE:-0}" != 1 ] && docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    have=$(docker image inspect -f "{{ index .Config.Labels \"$LABEL\" }}" "$BASE_IMAGE" 2>/dev/null || true)
    if [ "$have" = "$want" ]; then
        say "$BASE_IMAGE exists ($want); skipping (FORCE=1 rebuilds)"
        exit 0
    fi
    case $have in ""|"<no value>") have="no $LABEL label: an older build-base.sh" ;; esac
    say "$BASE_IMAGE exists but was made from $have; this script makes $want: rebuilding"
fi
old_id=$(docker image inspect -f '{{.Id}}' "$BASE_IMAGE" 2>/dev/null || true)
[ "$(id -u)" -eq 0 ] || { say "ERROR: debootstrap needs root"; exit 1; }
DEBIAN_MIRROR=$(debian_mirror) || exit 1
if ! command -v debootstrap >/dev/null 2>&1; then
    say "installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null \
        || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
fi

start=$SECONDS
rm -rf "$work"
mkdir -p "$work"
say "debootstrap $SUITE minbase from $DEBIAN_MIRROR into $work"
debootstrap --variant=minbase --include="$INCLUDE" \
    "$SUITE" "$work" "$DEBIAN_MIRROR" >"$work.log" 2>&1 \
    || { tail -n 30 "$work.log" >&2; say "ERROR: debootstrap failed (log: $work.log)"; exit 1; }

# Trim what a runtime image never reads: package caches and lists, docs,
# man pages, translations (apt-get update refills the lists if a derived
# image needs apt).
rm -rf "$work"/var/cache/apt/archives/*.deb "$work"/var/lib/apt/lists/* \
    "$work"/usr/share/doc/* "$work"/usr/share/man/* "$work"/usr/share/info/* \
    "$work"/usr/share/locale/* "$work"/var/log/*.log "$work"/var/cache/debconf/*-old
# The image gets its resolver config from the engine at run time.
: >"$work/etc/resolv.conf"

py=$(chroot "$work" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
nats=$(chroot "$work" nats-server --version)
say "python3 in the base is $py; $nats"

say "docker import -> $BASE_IMAGE"
tar -C "$work" --numeric-owner -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    --change "LABEL $LABEL=\"$want\"" \
    --message "debootstrap $SUITE minbase + $INCLUDE (python3 $py, $nats)" \
    - "$BASE_IMAGE" >/dev/null
rm -rf "$work"
# The image this one replaced, unless images built from it still need it.
if [ -n "$old_id" ] && [ "$old_id" != "$(docker image inspect -f '{{.Id}}' "$BASE_IMAGE")" ]; then
    docker rmi "$old_id" >/dev/null 2>&1 || true
fi
say "built $BASE_IMAGE in $((SECONDS - start))s ($(docker image inspect -f '{{.Size}}' "$BASE_IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
