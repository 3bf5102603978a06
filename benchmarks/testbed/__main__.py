"""`python -m benchmarks.testbed run CONFIG [--rate R] [--spec SPEC.yaml] [--set k=v ...]` and `... cleanup`."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

from benchmarks.testbed.bed import Fault, TestbedError, run_testbed
from benchmarks.testbed.net import NetError, cleanup
from benchmarks.testbed.spec import SpecError, cpus_option, load_spec, two_hosts
from hybridrec.core.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.testbed", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one training run across testbed hosts")
    run.add_argument("config", type=Path)
    run.add_argument("--spec", type=Path, help="YAML testbed spec (hosts, services, link rates); default: two hosts")
    run.add_argument("--rate", default=None, help="embedding host's link rate both ways (default spec), e.g. 1gbit")
    run.add_argument("--trainer-rate", default=None, help="trainer host's link rate both ways (default spec)")
    run.add_argument("--cpus", default=None,
                     help="default spec: TRAINER/EMBEDDING CPU lists (e.g. 0/1) or 'split' (halves of the CPUs); "
                          "default: both hosts on every CPU")
    run.add_argument("--loader-host", action="store_true",
                     help="default spec: the data loader on a third host, `data` (unshaped, the embedding CPUs)")
    run.add_argument("--set", dest="overrides", action="append", default=[], help="config override key=value")
    run.add_argument("--run-dir", type=Path, default=None)
    run.add_argument("--prefix", default="hrtb", help="name prefix of namespaces and shm files")
    run.add_argument("--fault", action="append", default=[],
                     help="HOST:down:AT_S:DURATION_S or HOST:slow:AT_S:DURATION_S[:FACTOR]")
    run.add_argument("--timeout", type=float, default=1800.0)
    clean = sub.add_parser("cleanup", help="remove namespaces, links, processes and shm files of a prefix")
    clean.add_argument("--prefix", default="hrtb")
    args = parser.parse_args(argv)

    if args.command == "cleanup":
        removed = cleanup(args.prefix)
        print("\n".join(f"removed {r}" for r in removed) or f"nothing with prefix {args.prefix!r}")
        return 0
    try:
        config = load_config(args.config, args.overrides)
        spec = load_spec(yaml.safe_load(args.spec.read_text())) if args.spec else two_hosts(
            args.rate, args.trainer_rate, cpus=cpus_option(args.cpus), loader_host=args.loader_host)
        faults = [parse_fault(f) for f in args.fault]
    except (ConfigError, SpecError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run_dir = args.run_dir or Path("runs") / f"testbed-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        result = run_testbed(config, spec, run_dir, prefix=args.prefix, faults=faults, timeout_s=args.timeout)
    except (SpecError, NetError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TestbedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; everything torn down", file=sys.stderr)
        return 130
    s = result["summary"]
    print(json.dumps({"mode": s["mode"], "samples_per_sec": round(s["samples_per_sec"], 1), "auc": s["auc"],
                      "exposed_wait_per_step_s": s["exposed_wait_per_step_s"],
                      "compute_per_step_s": s["compute_per_step_s"], "lost_updates": s["lost_updates"],
                      "skipped_batches": s["skipped_batches"], "bytes_per_step": result["bytes_per_step"],
                      "cpu_per_host_s": result["cpu_per_host_s"], "rates": result["rates"],
                      "run_dir": str(run_dir)}, indent=1))
    return 0


def parse_fault(text: str) -> Fault:
    parts = text.split(":")
    if len(parts) not in (4, 5) or parts[1] not in ("down", "slow", "lost") or (len(parts) == 5 and parts[1] != "slow"):
        raise ValueError(f"--fault {text!r}: expected HOST:down:AT_S:DURATION_S, HOST:lost:AT_S:DURATION_S or "
                         f"HOST:slow:AT_S:DURATION_S[:FACTOR]")
    return Fault(at_s=float(parts[2]), host=parts[0], kind=parts[1], duration_s=float(parts[3]),
                 factor=float(parts[4]) if len(parts) == 5 else 10.0)


if __name__ == "__main__":
    sys.exit(main())
