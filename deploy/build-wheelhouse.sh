#!/usr/bin/env bash
# Build the wheelhouse the image installs from, on the host, so that the
# image build itself needs no network, no pip configuration and no CA
# certificates (the same route an air-gapped cluster's build takes):
#
#     bash deploy/build-wheelhouse.sh          # -> deploy/.build/wheels/
#
# * hybridrec itself is built fresh from the working tree every time (a
#   clean copy, so stale build/ files never end up in the wheel);
# * its dependencies are fetched or built only when pyproject.toml changed
#   since the last run (a stamp file remembers its hash).
# torch is pinned to 2.13.0 in pyproject.toml; on these machines pip's
# find-links (/opt/wheels) holds the CPU build 2.13.0+cpu, which pip prefers
# over the CUDA build of the same version. Elsewhere set PIP_EXTRA_INDEX_URL
# to a PyTorch CPU wheel index to get it.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
build=${BUILD_DIR:-$here/.build}
wheels=$build/wheels
PYTHON=${PYTHON:-python3}

say() { echo "[build-wheelhouse] $*" >&2; }

pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$pyver" != "3.11" ]; then
    say "ERROR: $PYTHON is Python $pyver; the base image's python3 is 3.11 and the wheels must match."
    say "       Set PYTHON=/path/to/python3.11."
    exit 1
fi

start=$SECONDS
mkdir -p "$wheels"
rm -f "$wheels"/*.whl  # layout before deps/ and app/
src=$(mktemp -d "$build/src.XXXXXX")
trap 'rm -rf "$src"' EXIT
# A clean copy of the working tree (tracked and untracked files alike, but
# no virtualenv, VCS data, build leftovers or results).
tar -C "$repo" \
    --exclude=./.git --exclude=./.venv --exclude=./deploy/.build --exclude=./build \
    --exclude=./dist --exclude='*.egg-info' --exclude=__pycache__ --exclude='*.pyc' \
    --exclude=./runs --exclude=./data --exclude=./results --exclude=./.pytest_cache \
    -cf - . | tar -C "$src" -xf -

# deps/ holds every dependency, app/ only hybridrec: the image installs them
# in separate layers, so a code change rebuilds only a small one.
mkdir -p "$wheels/deps" "$wheels/app"
rm -f "$wheels"/app/*.whl
quiet_pip() {
    # The host's pip config names local indexes that may not exist; pip
    # warns once per package about them.
    "$PYTHON" -m pip "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}
stamp=$wheels/.deps-stamp
want=$(sha256sum "$repo/pyproject.toml" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! ls "$wheels"/deps/*.whl >/dev/null 2>&1; then
    say "fetching/building dependency wheels (pyproject.toml changed)"
    rm -f "$wheels"/deps/*.whl
    quiet_pip wheel --quiet --wheel-dir "$wheels/deps" "$src"
    mv "$wheels"/deps/hybridrec-*.whl "$wheels/app/"
    echo "$want" >"$stamp"
else
    say "dependency wheels up to date; rebuilding hybridrec only"
    quiet_pip wheel --quiet --no-deps --wheel-dir "$wheels/app" "$src"
fi

# Triton's server for `serve inference --engine triton` (the nvidia-pytriton wheel, installed --no-deps:
# its metadata pins numpy below 2) and numpy below 2 for its Python backend alone
# (services/inference/triton_server.py BACKEND_SITE): installed apart from deps/ by the Dockerfile.
mkdir -p "$wheels/triton"
if ! ls "$wheels"/triton/nvidia_pytriton-0.7.0-*.whl "$wheels"/triton/numpy-1.*.whl >/dev/null 2>&1; then
    say "fetching the Triton server wheel and numpy<2 for its backend"
    quiet_pip download --quiet --no-deps --only-binary :all: --dest "$wheels/triton" \
        nvidia-pytriton==0.7.0 "numpy<2"
fi

if ls "$wheels"/deps/torch-*.whl | grep -qv '+cpu'; then
    say "WARNING: the torch wheel is not a +cpu build; the image will carry CUDA libraries:"
    ls "$wheels"/deps/torch-*.whl >&2
fi
say "$(ls "$wheels"/deps/*.whl "$wheels"/app/*.whl | wc -l) wheels, $(du -sh "$wheels" | cut -f1), in $((SECONDS - start))s"
