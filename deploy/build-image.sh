#!/usr/bin/env bash
# Build hybridrec:latest with no network: wheelhouse on the host, local base
# image (debootstrap) when no registry can be reached, then `docker build
# --network none`.
#
#     bash deploy/build-image.sh
#
# Environment:
#   IMAGE        tag to build                    (hybridrec:latest)
#   BASE_IMAGE   base image                      (hybridrec-base:bookworm; built
#                                                 by deploy/build-base.sh when it
#                                                 is that tag and missing)
#   NETWORK      docker build --network value    (none)
# Prints the image size and the time each step took.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
IMAGE=${IMAGE:-hybridrec:latest}
BASE_IMAGE=${BASE_IMAGE:-hybridrec-base:bookworm}
NETWORK=${NETWORK:-none}

say() { echo "[build-image] $*" >&2; }
docker info >/dev/null 2>&1 || { say "ERROR: no Docker engine answers (start one: sudo bash .ci/docker-engine.sh)"; exit 1; }

t0=$SECONDS
bash "$here/build-wheelhouse.sh"
t1=$SECONDS
if [ "$BASE_IMAGE" = hybridrec-base:bookworm ]; then
    BASE_IMAGE=$BASE_IMAGE bash "$here/build-base.sh"
fi
t2=$SECONDS
old_id=$(docker image inspect -f '{{.Id}}' "$IMAGE" 2>/dev/null || true)

say "docker build $IMAGE from $BASE_IMAGE (--network $NETWORK)"
# The classic builder: BuildKit needs the buildx plugin, which Debian's
# docker.io (20.10) does not ship; nothing here needs BuildKit features.
DOCKER_BUILDKIT=0 docker build --quiet --force-rm --network "$NETWORK" \
    --build-arg BASE_IMAGE="$BASE_IMAGE" \
    -t "$IMAGE" -f "$here/Dockerfile" "${BUILD_DIR:-$here/.build}/wheels" >/dev/null \
    2> >(grep -vE 'DEPRECATED: The legacy builder|BuildKit is currently disabled|environment-variable\.$|^$' >&2)
t3=$SECONDS

# Drop the image this build replaced so repeated builds do not fill the
# disk (not `docker image prune`: that also drops the untagged stage images
# the next build reuses as its cache).
new_id=$(docker image inspect -f '{{.Id}}' "$IMAGE")
if [ -n "$old_id" ] && [ "$old_id" != "$new_id" ]; then
    docker rmi "$old_id" >/dev/null 2>&1 || true
fi
# Stage images a day old are unlikely to be reused as cache: drop them.
docker image prune -f --filter until=24h >/dev/null 2>&1 || true
size=$(docker image inspect -f '{{.Size}}' "$IMAGE")
say "built $IMAGE: $(awk -v s="$size" 'BEGIN{printf "%.0f MB", s/1e6}')" \
    "(wheelhouse $((t1 - t0))s, base $((t2 - t1))s, docker build $((t3 - t2))s, total $((t3 - t0))s)"
