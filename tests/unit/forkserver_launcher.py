"""A launcher stand-in for tests/unit/test_forkserver.py, in a process of its own: a ForkServer makes its
owner a child subreaper, which the test process must not become.

Reads one JSON object per line on stdin and answers each with one line on stdout:
  {"spawn": [ARGV...], "log": PATH}  ->  {"pid": N, "forkserver": PID}  (or {"error": TEXT})
  {"wait": PID}                      ->  {"code": EXIT_CODE}
  {"ready": true}                    ->  {"forkserver": PID, "ready_s": SECONDS}
    python tests/unit/forkserver_launcher.py LOG_DIR [CLEAN_UP_PATH]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from hybridrec.app.forkserver import ForkServer, ForkServerError


def main() -> None:
    log_dir = Path(sys.argv[1])
    server = ForkServer(log_dir / "forkserver.log")
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
                reply = {"pid": child.pid, "forkserver": server.pid}
        elif "wait" in request:
            reply = {"code": children[request["wait"]].wait(timeout=120)}
        else:
            server.wait_ready()
            reply = {"forkserver": server.pid, "ready_s": server.ready_s}
        print(json.dumps(reply), flush=True)
    server.close()


if __name__ == "__main__":
    main()
