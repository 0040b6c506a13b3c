"""GRPO end to end against the frameworks users would pick (issues 21, 34): this library
through its CLI (`jaxrl-cache grpo --model ... --dataset ...`, chat template, default settings),
TRL and tunix run the same workload (benchmarks/peers/common.py: SmolLM2-135M-Instruct,
examples/tasks/add.jsonl as one-user-message chat prompts, last-integer reward, `--shape`
prompts x group x new tokens, temperature 1, constant lr 2e-5, one AdamW update per step,
no KL) on this CPU, each in its own subprocess and venv, alternated round by round.

Variants: jaxrl-mt (XLA default, multi-threaded Eigen), jaxrl-st (XLA_FLAGS
single-threaded), jaxrl-bf16 (--compute-dtype bfloat16: the train step and the engine in
bf16, fp32 master weights; its own system beside jaxrl's fp32, as TRL's bf16), jaxrl-lora (jaxrl-mt training LoRA adapters over the frozen model, issue 37:
rank 16, alpha 32, all-linear, same lr; its own system "jaxrl-lora", compared with jaxrl's
best), jaxrl-mt-async / jaxrl-lora-async (the same with --async: a weight sync copies);
trl-{1,2}t[-nockpt][-bf16] (torch.set_num_threads; gradient checkpointing on unless
-nockpt; -bf16: HF Trainer's bf16 autocast, reported as its own system "trl-bf16" beside
TRL's best fp32), tunix-mt. Per variant: s/step = median of steps 2..N (step 1 is warm-up /
compile), generation / update seconds (medians over the same steps), peak RSS (the child's
VmHWM), mean reward of the first and last steps, load average before and after, and for
jaxrl the compiles in steps 2..N. "best" per system: its faster variant.

Benchmark-only installs (not project dependencies):
    /work/torchvenv/bin/pip install trl datasets      # keep torch 2.13.0+cpu as it is
    python3.11 -m venv /work/tunixvenv && /work/tunixvenv/bin/pip install google-tunix \
        "jax==0.10.*" "jaxlib==0.10.*"

    python benchmarks/e2e_vs_peers.py --shape 2x8x24 --steps 6 --rounds 2 [--isa avx2] \
        --json benchmarks/results/e2e-vs-peers-cpu-2026-12-03-2x8x24.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PEERS = ROOT / "benchmarks/peers"
ST_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
TORCH = pathlib.Path("/work/torchvenv/bin/python")
VARIANTS = {  # name: (system, python, script, extra args, extra env)
    "jaxrl-mt": ("jaxrl", ROOT / ".venv/bin/python", "jaxrl_grpo.py", [], {}),
    "jaxrl-st": ("jaxrl", ROOT / ".venv/bin/python", "jaxrl_grpo.py", [],
                 {"XLA_FLAGS": ST_FLAGS}),
    "jaxrl-bf16": ("jaxrl-bf16", ROOT / ".venv/bin/python", "jaxrl_grpo.py",
                   ["--compute-dtype", "bfloat16"], {}),  # bf16 train step and engine
    "jaxrl-lora": ("jaxrl-lora", ROOT / ".venv/bin/python", "jaxrl_grpo.py",  # issue 37
                   ["--lora-rank", "16", "--lora-alpha", "32", "--lora-targets", "all-linear"],
                   {}),
}
for _name in ("jaxrl-mt", "jaxrl-lora"):  # --async: each weight sync copies (sync_bytes)
    _system, _python, _script, _extra, _env = VARIANTS[_name]
    VARIANTS[_name + "-async"] = (_system + "-async", _python, _script, _extra + ["--async"], _env)
VARIANTS |= {
    "tunix-mt": ("tunix", pathlib.Path("/work/tunixvenv/bin/python"), "tunix_grpo.py", [], {}),
}
for _threads in (1, 2):
    for _ckpt in (True, False):
        for _bf16 in (False, True):
            VARIANTS[f"trl-{_threads}t{'' if _ckpt else '-nockpt'}{'-bf16' if _bf16 else ''}"] = (
                "trl-bf16" if _bf16 else "trl", TORCH, "trl_grpo.py",
                ["--threads", str(_threads)] + ([] if _ckpt else ["--no-gradient-checkpointing"])
                + (["--bf16"] if _bf16 else []), {"OMP_NUM_THREADS": str(_threads)})
ORDER = ["jaxrl-mt", "trl-1t", "trl-2t", "trl-1t-nockpt", "trl-2t-nockpt", "trl-1t-bf16",
         "trl-2t-bf16", "trl-2t-nockpt-bf16"]  # alternated; tunix-mt, jaxrl-st on request


ISA_ENV = {  # --isa avx2: every system on its AVX2 code path (user machines differ)
    "avx2": dict(xla="--xla_cpu_max_isa=AVX2",
                 torch={"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}),
}


def isa_env(system: str, env: dict, isa: str | None) -> dict:
    """env with the variables that hold `system` to `isa`'s code path (none: native)."""
    if isa is None:
        return env
    if system.startswith(("jaxrl", "tunix")):
        flags = " ".join(filter(None, [env.get("XLA_FLAGS", ""), ISA_ENV[isa]["xla"]]))
        return {**env, "XLA_FLAGS": flags}
    return {**env, **ISA_ENV[isa]["torch"]}


def run_variant(name: str, steps: int, log_dir: pathlib.Path, timeout: float,
                jaxrl_src: str | None = None, shape: str = "2x8x24",
                isa: str | None = None) -> dict:
    """Runs one child to completion; its STEP lines, exit status and load averages.
    jaxrl_src: a directory holding a jaxrl_cache package (e.g. `git archive COMMIT
    jaxrl_cache`) that the jaxrl variants import instead of the working tree. isa: "avx2"
    holds XLA (--xla_cpu_max_isa) and torch (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) to it."""
    system, python, script, extra, env = VARIANTS[name]
    env = isa_env(system, env, isa)
    if system.startswith("jaxrl"):  # the script's directory comes first on sys.path, not the tree's
        env = {**env, "PYTHONPATH": jaxrl_src or str(ROOT)}
    cmd = [str(python), str(PEERS / script), "--steps", str(steps), "--shape", shape, *extra]
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    log = log_dir / f"{name}-{int(time.time())}.log"
    rc = None
    with open(log, "w") as err:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                  stderr=err, text=True, timeout=timeout)
            rc, out = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            rc = "timeout"
    rows = [json.loads(line[5:]) for line in out.splitlines() if line.startswith("STEP ")]
    tail = log.read_text().splitlines()[-15:] if rc != 0 else []
    return dict(variant=name, system=system, command=" ".join(
        [f"{k}={v!r}" for k, v in env.items()] + cmd), env=env, rc=rc,
        wall_seconds=time.perf_counter() - t0, load_before=load_before,
        load_after=os.getloadavg(), steps=rows, log=str(log.relative_to(ROOT)),
        error_tail=tail)


def summarise(run: dict) -> dict:
    """s/step etc. of one run (steps 2..N; step 1 is warm-up)."""
    rows = run["steps"]
    timed = rows[1:]
    if not timed:
        return dict(variant=run["variant"], system=run["system"], ok=False, rc=run["rc"])

    def med(key):
        values = [r[key] for r in timed if r.get(key) is not None]
        return statistics.median(values) if values else None

    half = max(len(rows) // 4, 1)
    return dict(variant=run["variant"], system=run["system"], ok=run["rc"] == 0,
                rc=run["rc"], steps_timed=len(timed), s_per_step=med("seconds"),
                warmup_seconds=rows[0]["seconds"], generation_seconds=med("generation_seconds"),
                update_seconds=med("update_seconds"), audit_seconds=med("audit_seconds"),
                cores_busy=statistics.median(r["cpu_seconds"] / r["seconds"] for r in timed)
                if "cpu_seconds" in timed[0] else None,
                peak_rss_mib=max(r["peak_rss_mib"] for r in rows),
                reward_first=statistics.mean(r["reward"] for r in rows[:half]),
                reward_last=statistics.mean(r["reward"] for r in rows[-half:]),
                reward_steps=[round(r["reward"], 4) for r in rows],
                compiles_after_step_1=(sum(r["compiles"] for r in timed)
                                       if "compiles" in timed[0] else None),
                # jaxrl's audit of every step (step 1 included): the sampler/trainer gap
                logprob_mismatch_max=(max(r["logprob_mismatch_max"] for r in rows)
                                      if "logprob_mismatch_max" in rows[0] else None),
                audited_per_step=([r["audited"] for r in rows] if "audited" in rows[0]
                                  else None),
                load_before=run["load_before"], load_after=run["load_after"])


def combine(runs: list[dict]) -> dict:
    """Per variant (median s/step over its rounds) and per system (its best variant)."""
    variants = {}
    for run in runs:
        variants.setdefault(run["variant"], []).append(summarise(run))
    table = {}
    for name, rounds in variants.items():
        good = [r for r in rounds if r.get("s_per_step") is not None]
        table[name] = dict(rounds=rounds, s_per_step=statistics.median(
            r["s_per_step"] for r in good) if good else None)
    best = {}
    for name, entry in table.items():
        system = VARIANTS[name][0]
        if entry["s_per_step"] is not None and (
                system not in best or entry["s_per_step"] < table[best[system]]["s_per_step"]):
            best[system] = name
    return dict(variants=table, best={s: dict(variant=v, s_per_step=table[v]["s_per_step"])
                                      for s, v in best.items()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--shape", default="2x8x24", help="prompts x group x new tokens")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default=",".join(ORDER), help="comma list, in run order")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per child run")
    p.add_argument("--json", default=None)
    p.add_argument("--jaxrl-src", default=None,
                   help="import jaxrl_cache from this directory (a pinned commit's export) "
                        "instead of the working tree, which others may be editing")
    p.add_argument("--append", action="store_true",
                   help="add these runs to the runs already in --json")
    p.add_argument("--md", default=None, help="also write a markdown table of the runs here")
    p.add_argument("--isa", choices=sorted(ISA_ENV), default=None,
                   help="run every system on this code path (default: native)")
    args = p.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    out = pathlib.Path(args.json) if args.json else None
    runs = json.loads(out.read_text())["runs"] if args.append and out and out.exists() else []
    first_round = max((r["round"] for r in runs), default=-1) + 1
    log_dir = ROOT / "runs/e2e_vs_peers"
    log_dir.mkdir(parents=True, exist_ok=True)
    for rnd in range(args.rounds):
        for name in names:
            print(f"round {rnd + 1}/{args.rounds}: {name} ...", file=sys.stderr, flush=True)
            run = run_variant(name, args.steps, log_dir, args.timeout, args.jaxrl_src,
                              args.shape, args.isa)
            run["round"] = first_round + rnd
            runs.append(run)
            s = summarise(run)
            print(json.dumps({k: v for k, v in s.items() if k != "reward_steps"}),
                  file=sys.stderr, flush=True)
            if out:  # written after every run: a later failure keeps what was measured
                result = dict(date=str(datetime.date.today()), machine="CPU, 2 cores, shared",
                              platform=platform.platform(), cpus=os.cpu_count(),
                              steps=args.steps, rounds=first_round + args.rounds,
                              shape=args.shape, isa=args.isa or "native",
                              st_xla_flags=ST_FLAGS,
                              workload=_workload(args.shape), **combine(runs), runs=runs)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(combine(runs)["best"], indent=1))
    if args.md:
        pathlib.Path(args.md).write_text(markdown(runs, args.shape, args.steps))


def _worst_mismatch(rounds: list[dict]) -> str:
    """The largest log-prob mismatch of any step of any round ("-" for a peer without one)."""
    values = [r.get("logprob_mismatch_max") for r in rounds]
    return "-" if None in values else f"{max(values):g}"


def markdown(runs: list[dict], shape: str, steps: int) -> str:
    """Per variant: s/step (median over its rounds, each the median of steps 2..N), the
    phases, peak RSS, compiles after step 1; then each system's best and the ratios."""
    table = combine(runs)
    out = [f"# GRPO end to end vs peers, shape {shape} (prompts x group x new tokens), CPU "
           f"({datetime.date.today()})", "",
           f"SmolLM2-135M-Instruct, add.jsonl as chat prompts, {steps} steps per run (step 1 "
           "excluded), rounds alternated; `python benchmarks/e2e_vs_peers.py` (docstring).",
           "", "| variant | s/step per round | generation s | update s | peak RSS GiB | "
           "compiles after step 1 | log-prob mismatch max |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, entry in table["variants"].items():
        rounds = [r for r in entry["rounds"] if r.get("s_per_step") is not None]
        if not rounds:
            out.append(f"| {name} | failed ({entry['rounds'][0].get('rc')}) | | | | | |")
            continue
        def fmt(key):
            return " / ".join(f"{r[key]:.2f}" for r in rounds if r.get(key) is not None)

        compiles = [r.get("compiles_after_step_1") for r in rounds]
        out.append(f"| {name} | {fmt('s_per_step')} | {fmt('generation_seconds')} | "
                   f"{fmt('update_seconds')} | "
                   f"{max(r['peak_rss_mib'] for r in rounds) / 1024:.2f} | "
                   f"{' / '.join(map(str, compiles)) if None not in compiles else '-'} | "
                   f"{_worst_mismatch(rounds)} |")
    best = table["best"]
    out += ["", "Best per system (median over rounds): " + ", ".join(
        f"{s} {v['variant']} {v['s_per_step']:.2f} s/step" for s, v in best.items())]
    if "jaxrl" in best:
        ours = best["jaxrl"]["s_per_step"]
        peers = {s: v for s, v in best.items() if not s.startswith("jaxrl")}
        if peers:
            out.append("; ".join(f"{s}/jaxrl = {v['s_per_step'] / ours:.2f}x"
                                 for s, v in peers.items()) + " (above 1: this library is faster)")
        if "jaxrl-lora" in best:
            out.append(f"jaxrl-lora/jaxrl = {best['jaxrl-lora']['s_per_step'] / ours:.2f}x "
                       "(below 1: LoRA steps are faster than full fine-tuning)")
        mine = {s: v for s, v in best.items() if s in ("jaxrl", "jaxrl-bf16")}
        if peers and len(mine) > 1:
            fast_peer = min(peers, key=lambda s: peers[s]["s_per_step"])
            fast_mine = min(mine, key=lambda s: mine[s]["s_per_step"])
            out.append(f"faster peer / faster setting here: {fast_peer} / {fast_mine} = "
                       f"{peers[fast_peer]['s_per_step'] / mine[fast_mine]['s_per_step']:.2f}x")
    return "\n".join(out) + "\n"


def _workload(shape: str) -> dict:
    sys.path.insert(0, str(PEERS))
    import common
    common.set_shape(shape)
    return dict(model=common.MODEL, task=str(common.TASK.relative_to(ROOT)),
                prompts_per_step=common.PROMPTS_PER_STEP, group=common.GROUP,
                max_new_tokens=common.MAX_NEW_TOKENS, temperature=common.TEMPERATURE,
                lr=common.LR, prompts="one user message each; every system applies the "
                "model's chat template",
                reward="last -?\\d+ of the completion == answer")


if __name__ == "__main__":
    main()
