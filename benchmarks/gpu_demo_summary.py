"""One line per step of a `jaxrl-cache demo` run's metrics.jsonl: the numbers that say
whether the path users run is exact on this device (gpu_check.sh runs the demo with
--kernels pallas on a lent GPU).

    python -m benchmarks.gpu_demo_summary RUN_DIR [--label pallas]
"""
from __future__ import annotations

import argparse
import json
import pathlib

KEYS = ("step", "audit_tolerance", "audit_floor", "audit_exact_tokens", "audit_failed",
        "audit_checked_tokens", "logprob_mismatch_max", "cache_hit_rate", "step_seconds",
        "rollout_seconds", "train_seconds")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--label", default="")
    args = p.parse_args()
    path = pathlib.Path(args.run_dir) / "metrics.jsonl"
    if not path.exists():
        print(f"{args.label}: no metrics ({path} missing)")
        return
    for line in path.read_text().splitlines():
        row = json.loads(line)
        print(args.label, {k: row.get(k) for k in KEYS})


if __name__ == "__main__":
    main()
