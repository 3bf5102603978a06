#!/usr/bin/env bash
# Train the synthetic example with docker-compose.yml and clean up: the
# whole cluster starts, nn-worker-0's exit ends the run, the summary is
# printed, and every container (with its PS store volume) is removed.
# The data, results and checkpoints volumes stay (`docker compose down -v`
# drops them).
#
#     bash deploy/compose/train.sh                  # 1,000,000 synthetic rows
#     HYBRIDREC_SYNTH_ROWS=100000 bash deploy/compose/train.sh
#     COMPOSE_FILES="docker-compose.yml docker-compose.gpu.yml" bash deploy/compose/train.sh
#
# Uses Compose v2 (`docker compose`) when present, else docker-compose 1.29
# (COMPOSE=docker-compose picks one).
# Exit code: nn-worker-0's (0 when training and evaluation finished).
set -euo pipefail
cd "$(dirname "$0")/../.."

if [ -n "${COMPOSE:-}" ]; then
    read -ra compose <<<"$COMPOSE"       # e.g. COMPOSE=docker-compose
elif docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
    compose=(docker-compose)
else
    echo "train.sh: neither 'docker compose' nor 'docker-compose' is installed" >&2
    exit 1
fi
for f in ${COMPOSE_FILES:-docker-compose.yml}; do compose+=(-f "$f"); done

started=$SECONDS
rc=0
"${compose[@]}" up --exit-code-from nn-worker-0 nn-worker-0 || rc=$?
wall=$((SECONDS - started))
container=$("${compose[@]}" ps -a -q nn-worker-0 2>/dev/null | head -n 1)
if [ -n "$container" ] && docker cp "$container:/results/summary.json" - 2>/dev/null | tar -xO >"${SUMMARY_OUT:-/dev/stdout}"; then
    echo >&2
else
    echo "train.sh: no /results/summary.json (nn-worker-0 exit code $rc)" >&2
    [ "$rc" -ne 0 ] || rc=1
fi
echo "train.sh: compose run took ${wall}s, exit code $rc" >&2
if [ "${KEEP:-0}" != 1 ]; then
    "${compose[@]}" rm -f -s -v >/dev/null 2>&1 || true
    "${compose[@]}" down --remove-orphans >/dev/null 2>&1 || true
fi
exit "$rc"
