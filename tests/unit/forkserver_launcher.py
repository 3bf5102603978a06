"""A launcher stand-in for tests/unit/test_forkserver.py, in a process of its own: a fork server makes its
owner a child subreaper, which the test process must not become.

Reads one JSON object per line on stdin and answers each with one line on stdout:
  {"spawn": [ARGV...], "log": PATH}  ->  {"pid": N, "forkserver": PID of its parent}  (or {"error": TEXT})
  {"wait": PID}                      ->  {"code": EXIT_CODE}
  {"ready": true}                    ->  {"light": PID, "dense": PID} once both parents have imported
  {"config": PATH}                   ->  {} (the run's config: the light parent compiles the PS kernels)
    python tests/unit/forkserver_launcher.py LOG_DIR [CLEAN_UP_PATH]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from hybridrec.app.run.forkserver import ForkServerError, ForkServers, needs_dense


def main() -> None:
    log_dir = Path(sys.argv[1])
    server = ForkServers(log_dir)
    server.start()
    if len(sys.argv) > 2:
        server.clean_up_on_death(sys.argv[2])
    children = {}
    for line in sys.stdin:
        request = json.loads(line)
        if "spawn" in request:
            try:
                child = server.spawn(request["spawn"], Path(request["log"]))
            except ForkServerError as exc:
                reply = {"error": str(exc)}
            else:
                children[child.pid] = child
                parent = server.dense if needs_dense(request["spawn"]) else server.light
                reply = {"pid": child.pid, "forkserver": parent.pid}
        elif "wait" in request:
            reply = {"code": children[request["wait"]].wait(timeout=120)}
        elif "config" in request:
            server.configure(Path(request["config"]))
            reply = {}
        else:
            server.light.wait_ready()
            server.dense.wait_ready()
            reply = {"light": server.light.pid, "dense": server.dense.pid}
        print(json.dumps(reply), flush=True)
    server.close()


if __name__ == "__main__":
    main()
