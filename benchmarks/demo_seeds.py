"""The built-in demo's learning across seeds and XLA:CPU code paths (issue 60): `jaxrl-cache
demo` exactly as a new user runs it (default settings, `--seed S`), seeds 0-4, each natively
and with XLA_FLAGS=--xla_cpu_max_isa=AVX2 (the AVX2 code path on an AVX-512 CPU), one run at
a time. Per run: the warm start's eval exact match, the eval after GRPO, the audit's
failures, the sampler/trainer log-prob mismatch, the job's wall time; then the median and
range over seeds per path, and the CPU it ran on.

    python benchmarks/demo_seeds.py --json benchmarks/results/demo-seeds-cpu-DATE.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATHS = {"native": None, "avx2": "--xla_cpu_max_isa=AVX2"}


def cpu_model() -> str:
    info = pathlib.Path("/proc/cpuinfo").read_text()
    for line in info.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip() + (" (AVX-512)" if "avx512f" in info
                                                     else " (AVX2, no AVX-512)")
    return platform.processor() or "unknown"


def run_one(seed: int, xla_flags: str | None, extra: list[str]) -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "run"
        argv = [sys.executable, "-m", "jaxrl_cache.app.cli", "demo", "--seed", str(seed),
                "--out", str(out), *extra]
        t0 = time.perf_counter()
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if done.returncode != 0:
            raise RuntimeError(f"seed {seed} ({xla_flags}): rc {done.returncode}\n"
                               f"{done.stderr[-2000:]}")
        record = json.loads((out / "run.json").read_text())
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        rl = re.search(r"after GRPO ([0-9.]+)", done.stdout)  # the CLI's summary table
        warm = re.search(r"stopped after (\d+) steps", done.stdout)
    return dict(seed=seed, xla_flags=xla_flags, seconds=round(seconds, 1),
                sft_exact_match=record["sft_exact_match"],
                rl_exact_match=float(rl.group(1)),
                sft_steps=int(warm.group(1)) if warm else None,
                audit_failures=sum(r["audit_failed"] for r in rows),
                logprob_mismatch_max=max(r["logprob_mismatch_max"] for r in rows),
                reward_first=rows[0]["reward"], reward_last=rows[-1]["reward"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--paths", default="native,avx2")
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("extra", nargs="*", help="more demo flags (after --)")
    args = parser.parse_args()
    runs = []
    for path in args.paths.split(","):
        for seed in map(int, args.seeds.split(",")):
            run = dict(run_one(seed, PATHS[path], args.extra), path=path)
            print(json.dumps(run), flush=True)
            runs.append(run)
    table = {}
    for path in args.paths.split(","):
        mine = [r for r in runs if r["path"] == path]
        rl = [r["rl_exact_match"] for r in mine]
        table[path] = dict(rl_median=statistics.median(rl), rl_min=min(rl), rl_max=max(rl),
                           sft_max=max(r["sft_exact_match"] for r in mine),
                           seconds_max=max(r["seconds"] for r in mine))
        print(path, json.dumps(table[path]))
    result = dict(date=datetime.date.today().isoformat(), cpu=cpu_model(),
                  cores=os.cpu_count(), argv=args.extra, runs=runs, table=table)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
