"""Whole-process peak RSS of a GRPO run, and its RSS over time by phase (issue 64.1): this
library through its CLI (`benchmarks/peers/jaxrl_grpo.py`: `jaxrl-cache grpo` in process,
model load, eval before and after, every step, checkpoints, HF export) against TRL
(`benchmarks/peers/trl_grpo.py --save`: model load, steps, `trainer.save_model`), on the
workload of `benchmarks/e2e_vs_peers.py` (its variants, e.g. jaxrl-mt, trl-2t).

Each child runs under `/usr/bin/time -v`, whose "Maximum resident set size" is the peak
reported; the child's VmRSS is also sampled every --interval seconds, and the `PHASE` lines
the peer scripts print on stderr mark the phases on that trace. Variants alternate round by
round; each run's JSON row holds the trace, the phases and the phase holding the peak.

    python benchmarks/run_memory.py --shape 2x8x24 --steps 5 --rounds 2 \
        --variants jaxrl-mt,trl-2t --json benchmarks/results/run-memory-cpu-2x8x24.json \
        [--plot PNG] [--jaxrl-src DIR] [--label after]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from e2e_vs_peers import PEERS, ROOT, VARIANTS, _workload  # noqa: E402

TIME = "/usr/bin/time"


def _rss_mib(pid: int) -> float | None:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def _child_of(pid: int) -> int | None:
    """The one child of `pid` (the peer script under /usr/bin/time)."""
    try:
        children = pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:
        return None
    return int(children[0]) if children else None


def run(name: str, steps: int, shape: str, interval: float, log_dir: pathlib.Path,
        jaxrl_src: str | None) -> dict:
    """One variant's run: the peak of `time -v`, the sampled trace [(s, MiB)] and the phases
    [(name, start s, end s)], seconds from the start."""
    system, python, script, extra, env = VARIANTS[name]
    if system.startswith("jaxrl"):
        env = {**env, "PYTHONPATH": jaxrl_src or str(ROOT)}
        python = python if python.exists() else pathlib.Path(sys.executable)
    else:
        extra = [*extra, "--save"]
    cmd = [str(python), str(PEERS / script), "--steps", str(steps), "--shape", shape, *extra]
    log = log_dir / f"{name}-{shape}-{int(time.time())}.log"
    t0 = time.time()
    proc = subprocess.Popen([TIME, "-v", *cmd], cwd=ROOT, env={**os.environ, **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    trace, edges, lines = [], [], []

    def read():
        for line in proc.stderr:
            lines.append(line)  # a progress bar may precede a PHASE on its line
            edges.extend(json.loads(m) for m in re.findall(r"PHASE (\{.*?\})", line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    child = None
    while proc.poll() is None:
        child = child or _child_of(proc.pid)
        rss = _rss_mib(child) if child else None
        if rss is not None:
            trace.append((round(time.time() - t0, 2), round(rss, 1)))
        time.sleep(interval)
    reader.join()
    log.write_text("".join(lines))
    text = "".join(lines)
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    peak_mib = int(peak.group(1)) / 1024 if peak else None
    phases, open_ = [], {}
    for e in edges:
        if e["edge"] == "start":
            open_[e["name"]] = e["t"] - t0
        elif e["name"] in open_:
            phases.append((e["name"], round(open_.pop(e["name"]), 2), round(e["t"] - t0, 2)))
    top = max(trace, key=lambda p: p[1]) if trace else (None, None)
    return dict(variant=name, system=system, shape=shape, steps=steps, rc=proc.returncode,
                command=" ".join([f"{k}={v!r}" for k, v in env.items()] + [TIME, "-v"] + cmd),
                peak_rss_mib=peak_mib, sampled_peak_mib=top[1], sampled_peak_at=top[0],
                peak_phase=_phase_at(phases, top[0]), seconds=round(time.time() - t0, 1),
                phase_peaks=_phase_peaks(trace, phases), phases=phases, trace=trace,
                log=str(log.relative_to(ROOT)))


def _phase_at(phases: list, t: float | None) -> str:
    """The innermost phase holding time t (the gaps between them: "other")."""
    holding = [p for p in phases if t is not None and p[1] <= t <= p[2]]
    return min(holding, key=lambda p: p[2] - p[1])[0] if holding else "other"


def _phase_peaks(trace: list, phases: list) -> dict:
    """The highest sampled RSS (MiB) within each phase; "other" for the samples outside."""
    out: dict = {}
    for t, rss in trace:
        name = _phase_at(phases, t)
        out[name] = max(out.get(name, 0.0), rss)
    return out


def markdown(runs: list[dict]) -> str:
    """Per run: the peak of `time -v`, the phase holding the sampled peak, and the peaks of
    the main phases."""
    out = ["| variant | label | shape | steps | peak RSS GiB (time -v) | peak in | load | "
           "steps (max) | eval after | checkpoint (last) | export | rc |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        pp = r["phase_peaks"]

        def gib(*names):
            values = [v for k, v in pp.items() if any(k.startswith(n) for n in names)]
            return f"{max(values) / 1024:.2f}" if values else "-"
        ckpts = sorted((k for k in pp if k.startswith("checkpoint")),
                       key=lambda k: int(k.split()[1]))
        out.append(f"| {r['variant']} | {r.get('label', '')} | {r['shape']} | {r['steps']} | "
                   f"**{r['peak_rss_mib'] / 1024:.2f}** | {r['peak_phase']} | {gib('load')} | "
                   f"{gib('step')} | {gib('eval after')} | "
                   f"{f'{pp[ckpts[-1]] / 1024:.2f}' if ckpts else '-'} | {gib('export')} | "
                   f"{r['rc']} |")
    return "\n".join(out) + "\n"


def plot(runs: list[dict], path: pathlib.Path) -> None:
    """RSS over time, one panel per run, its phases shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.3 * len(runs)), squeeze=False)
    colors = {"load": "tab:blue", "eval": "tab:green", "step": "tab:orange",
              "checkpoint": "tab:red", "export": "tab:purple"}
    for ax, r in zip(axes[:, 0], runs):
        ax.plot(*zip(*[(t, m / 1024) for t, m in r["trace"]]), color="black", lw=1)
        seen = set()
        for name, a, b in r["phases"]:
            kind = name.split()[0]
            ax.axvspan(a, b, color=colors.get(kind, "gray"), alpha=0.25,
                       label=kind if kind not in seen else None)
            seen.add(kind)
        ax.axhline(r["peak_rss_mib"] / 1024, color="gray", ls="--", lw=0.8)
        ax.set_title(f"{r['variant']} {r.get('label', '')} {r['shape']}: peak "
                     f"{r['peak_rss_mib'] / 1024:.2f} GiB in {r['peak_phase']}", fontsize=9)
        ax.set_ylabel("RSS GiB")
        ax.legend(loc="lower right", fontsize=7, ncol=5)
    axes[-1, 0].set_xlabel("seconds from start")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="2x8x24")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--variants", default="jaxrl-mt,trl-2t")
    p.add_argument("--interval", type=float, default=0.1, help="RSS sampling period, s")
    p.add_argument("--jaxrl-src", default=None, help="import jaxrl_cache from here")
    p.add_argument("--label", default="", help="a tag for these runs (e.g. before, after)")
    p.add_argument("--json", default=None, help="runs are appended to this file's")
    p.add_argument("--md", default=None)
    p.add_argument("--plot", default=None, help="PNG of every run's trace in --json")
    args = p.parse_args()
    out = pathlib.Path(args.json) if args.json else None
    runs = json.loads(out.read_text())["runs"] if out and out.exists() else []
    log_dir = ROOT / "runs/run_memory"
    log_dir.mkdir(parents=True, exist_ok=True)
    for rnd in range(args.rounds):
        for name in args.variants.split(","):
            print(f"round {rnd + 1}/{args.rounds}: {name} {args.shape} ...", file=sys.stderr,
                  flush=True)
            r = dict(run(name, args.steps, args.shape, args.interval, log_dir, args.jaxrl_src),
                     label=args.label, round=rnd)
            runs.append(r)
            print(json.dumps({k: v for k, v in r.items() if k not in ("trace", "phases")}),
                  file=sys.stderr, flush=True)
            if out:
                out.write_text(json.dumps(dict(
                    date=str(datetime.date.today()), machine="CPU, 2 cores, shared",
                    workload=_workload(args.shape), runs=runs), indent=1) + "\n")
    print(markdown(runs))
    if args.md:
        pathlib.Path(args.md).write_text(markdown(runs))
    if args.plot:
        plot(runs, pathlib.Path(args.plot))


if __name__ == "__main__":
    main()
