"""The long fuzz runs: every target of tests/fuzz/targets.py for --runs executions or --seconds, whichever
comes first (10^6 and 600 by default), from its seed corpus. Writes JSON: per target the executions, the
seconds, libFuzzer's coverage (`cov`: edges of the instrumented Python code; `ft`: features), the corpus it
grew to, its peak RSS, and the crashes (inputs that raised anything but the target's own error, or passed the
memory limit), with the crash files kept under --work.

    python benchmarks/fuzz.py --out results/fuzz.json [--targets codec frames] [--parallel 2]
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.fuzz.run import RSS_LIMIT_MB  # noqa: E402
from tests.fuzz.targets import MAX_LEN, RUNS  # noqa: E402

_STATUS = re.compile(r"#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/\S+ .*?rss: (\d+)Mb")


def run(name: str, runs: int, seconds: int, work: Path) -> dict:
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "tests.fuzz.run", name, f"-runs={runs}",
                          f"-max_total_time={seconds}", f"--work={folder}"], cwd=REPO, capture_output=True,
                         text=True)
    statuses = _STATUS.findall(out.stderr)
    last = statuses[-1] if statuses else ("0", "0", "0", "0", "0")
    done = re.search(r"Done (\d+) runs in (\d+) second", out.stderr)
    crashes = sorted(p.name for p in folder.iterdir() if p.name.startswith(("crash-", "oom-", "timeout-")))
    return {"target": name, "exit_code": out.returncode, "executions": int(done.group(1)) if done else int(last[0]),
            "seconds": round(time.monotonic() - started, 1), "coverage_edges": int(last[1]),
            "features": int(last[2]), "corpus": int(last[3]), "peak_rss_mb": max(int(s[4]) for s in statuses)
            if statuses else None, "crashes": crashes,
            "uncaught": "Uncaught Python exception" in out.stderr,
            "tail": out.stderr[-1500:] if out.returncode else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=int, default=600)
    parser.add_argument("--targets", nargs="*", default=sorted(RUNS))
    parser.add_argument("--parallel", type=int, default=1, help="targets at once (one core each)")
    parser.add_argument("--work", type=Path, default=REPO / "results" / "fuzz")
    args = parser.parse_args()
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda name: run(name, args.runs, args.seconds, args.work), args.targets))
    for r in results:
        print(f"{r['target']:10s} {r['executions']:>9,} execs {r['seconds']:>6} s cov {r['coverage_edges']:>4} "
              f"rss {r['peak_rss_mb']} MB crashes {len(r['crashes'])}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": args.runs, "seconds": args.seconds, "max_len": MAX_LEN,
                                    "rss_limit_mb": RSS_LIMIT_MB, "targets": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
