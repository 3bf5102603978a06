"""Two test runs compared on the tests they share: from the output of `.ci/run` (or of the README's test command)
of two trees, each test's seconds as pytest's `--durations` printed them (setup, call and teardown added; the
project's pytest options print every test of 3 s or more), and the total each run reported. Writes JSON.

Why: two trees months apart hold different tests, so their whole runs say little about a change to what every
test pays (a service's start, say). The tests both runs timed do: `common` sums each run's seconds over the
tests the first run timed that the second run holds (timed, or under 3 s there: counted as 3 s, an upper
bound). `added` lists the second run's timed tests the first did not hold.

    python benchmarks/ci_durations.py BEFORE.log AFTER.log --out results/ci.json
"""
from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

LINE = re.compile(r"^(\d+\.\d+)s (?:call|setup|teardown)\s+(\S+)")
SUMMARY = re.compile(r"=+ (.*) in (\d+\.\d+)s")
STEP = re.compile(r"^::: \[(\d+) s\] done")
FLOOR_S = 3.0
"""pytest prints no test under this many seconds (the project's `--durations-min`)."""


def durations(text: str) -> dict[str, float]:
    """Each printed test's seconds (its phases added)."""
    out: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        match = LINE.match(line)
        if match:
            out[match.group(2)] += float(match.group(1))
    return dict(out)


def totals(text: str) -> dict:
    """The run's summary line (counts and pytest's seconds) and `.ci/run`'s own seconds where it printed them."""
    summary = [m for m in map(SUMMARY.search, text.splitlines()) if m]
    done = [m for m in map(STEP.match, text.splitlines()) if m]
    return {"summary": summary[-1].group(1) if summary else None,
            "pytest_s": float(summary[-1].group(2)) if summary else None,
            "ci_run_s": int(done[-1].group(1)) if done else None}


def held_in(tree: Path, test: str) -> bool:
    """Whether the tree holds `test` (a node id): its file is there and defines its function."""
    path, _, name = test.partition("::")
    file = tree / path
    function = name.split("[")[0].split("::")[-1]
    return file.is_file() and re.search(rf"^\s*(async )?def {re.escape(function)}\(", file.read_text(),
                                         re.MULTILINE) is not None


def compare(before: str, after: str, tree: Path) -> dict:
    """`before` and `after` runs' output compared (module docstring) over the tests the first run timed that
    `tree` (the second run's) holds."""
    a, b = durations(before), durations(after)
    shared = [k for k in a if k in b or held_in(tree, k)]
    after_s = sum(b.get(k, FLOOR_S) for k in shared)
    added = sorted(set(b) - set(a), key=lambda k: -b[k])
    return {"before": totals(before), "after": totals(after),
            "common": {"tests": len(shared), "before_s": round(sum(a[k] for k in shared), 1),
                       "after_s": round(after_s, 1),
                       "ratio": round(after_s / sum(a[k] for k in shared), 4) if shared else None,
                       "under_floor_in_after": sorted(k for k in shared if k not in b)},
            "added": {"tests": len(added), "seconds": round(sum(b[k] for k in added), 1),
                      "largest": [[k, round(b[k], 1)] for k in added[:15]]},
            "gone": sorted(k for k in a if k not in shared)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path, nargs="+", help="one or more later runs, each compared with BEFORE")
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the later runs' tree, for the tests it holds (default: this checkout)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    before = args.before.read_text(errors="replace")
    result = {"before": str(args.before),
              "runs": {str(path): compare(before, path.read_text(errors="replace"), args.tree)
                       for path in args.after}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for run, r in result["runs"].items():
        common = r["common"]
        print(f"{run}: {common['tests']} common tests {common['before_s']} s -> {common['after_s']} s "
              f"(x{common['ratio']}); {r['added']['tests']} added, {r['added']['seconds']} s; whole run "
              f"{r['before']['ci_run_s']} s -> {r['after']['ci_run_s']} s")


if __name__ == "__main__":
    main()
