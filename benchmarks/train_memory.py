"""Peak RSS and seconds per `train_step` at real-model shapes (issue 21, "Measured").

Each point (model shape, N samples x L tokens) runs in a fresh subprocess: random params
(`init_params`, fp32), `TrainState.create` with the default optimizer, a fake RolloutBatch
(prompt 32 tokens, outputs fill the rest, finite behavior log-probs) through `make_batch`,
then `--steps` train steps with the default TrainConfig (plus `--donate`). Reported per
point: RSS right after params + optimizer init (the floor), peak RSS (ru_maxrss after the
steps), seconds of each step (the last one is after compile), the load average at the time
(the machine is shared: times move with load, RSS does not), and computed / real tokens of
the packing. `--analysis` adds XLA's compiled memory plan of the update
(`memory_analysis()`: arguments + outputs - aliased + temp); `--steps 0 --analysis` only
compiles (the plan of a point too slow to run here). Growth per extra 1k tokens is the
least-squares slope of peak RSS (points that ran steps) and of the plan over the points at
or above the token budget. A GRPO batch with random output lengths is packed (host only)
for its computed / real tokens. `--append` adds points to an existing --json (run full
fine-tuning and LoRA in turn that way). `--lora-rank R` trains LoRA adapters of rank R
(`--lora-alpha`, `--lora-targets` as PEFT's; default q_proj,v_proj) over the frozen random
base instead of the whole model; `--interleave K` times full fine-tuning and that LoRA in
one process, steps in turn (K rounds after a compiling one). Each row also carries tokens/s
(N x L over the fastest step after the first, or the first) and `estimate_step_bytes`'s
state and total.

    python -m benchmarks.train_memory [--points smollm2:8x128,qwen05:8x512] [--donate]
        [--single-thread] [--steps 2] [--analysis] [--json PATH] [--md PATH] [--append]
        [--lora-rank R [--lora-alpha A] [--lora-targets all-linear] [--interleave K]]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import resource
import subprocess
import sys
import time

import numpy as np

from benchmarks.timing import write_report

GIB = 2 ** 30
PROMPT = 32
MODELS = {  # ModelConfig fields of each shape (random params: only the shapes matter)
    "smollm2": dict(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                    head_dim=64, d_ff=1536, max_seq_len=8192, rope_theta=100000.0,
                    norm_eps=1e-5, tie_embeddings=True),
    "qwen05": dict(vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2,
                   head_dim=64, d_ff=4864, max_seq_len=32768, rope_theta=1000000.0,
                   norm_eps=1e-6, tie_embeddings=True, qkv_bias=True),
}
DEFAULT_POINTS = ("smollm2:8x128,smollm2:16x128,smollm2:32x128,smollm2:32x512,"
                  "smollm2:64x512,smollm2:64x1024,qwen05:8x512,qwen05:32x1024")
TARGETS = {("smollm2", 32, 512): 6.0, ("smollm2", 64, 1024): 8.0}  # peak RSS GiB
GROWTH_TARGET = 0.1  # GiB per extra 1k tokens


def _status_kib(field: str) -> int:
    """VmRSS / VmHWM of this process in KiB (/proc/self/status)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(f"/proc/self/status has no {field}")


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _sample(prompt: tuple, out: int, group: int, vocab: int, rng):
    """A version-0 Sample of `out` random output ids with behavior log-probs in [-4, 0)."""
    from jaxrl_cache.rollout.types import Sample

    return Sample(prompt_ids=prompt, output_ids=tuple(int(t) for t in rng.integers(0, vocab, out)),
                  output_logprobs=rng.uniform(-4, 0, out).astype(np.float32),
                  behavior_version=0, token_versions=np.zeros(out, np.int64),
                  cached_tokens=0, finish_reason="length", group=group)


def _rollouts(samples: list, group: int, max_new: int):
    from jaxrl_cache.rollout.sampling import SamplingParams
    from jaxrl_cache.rollout.types import RolloutBatch

    return RolloutBatch(samples=samples, version=0,
                        sampling=SamplingParams(n=group, max_new_tokens=max_new),
                        prefill_tokens=sum(len(s.prompt_ids) for s in samples),
                        reused_tokens=0, cached_tokens=0, decode_steps=max_new,
                        decode_chunks=1, prefill_launches=1, seconds=0.0)


def fake_rollouts(n: int, length: int, vocab: int, group: int = 8, seed: int = 0):
    """A RolloutBatch of n samples of `length` tokens (PROMPT random prompt ids + outputs),
    groups of `group`."""
    rng = np.random.default_rng(seed)
    samples = [_sample(tuple(int(t) for t in rng.integers(0, vocab, PROMPT)), length - PROMPT,
                       i // group, vocab, rng) for i in range(n)]
    return _rollouts(samples, group, length - PROMPT)


def _update_memory_plan(state, batch, cfg) -> dict:
    """XLA's compiled memory plan (bytes) of the jitted update `train_step` runs."""
    import jax.numpy as jnp

    from jaxrl_cache.rl import train
    from jaxrl_cache.rl.logprobs import knobs_of
    from jaxrl_cache.rl.memory import resolve_remat

    packed = train.pack_batch(batch, cfg)
    length = packed.tokens.shape[-1]  # remat "auto" resolved as train_step does
    cfg = resolve_remat(state.config, cfg, row_length=length, lora=state.lora)
    knobs, kind = knobs_of(batch.sampling, state.config.vocab_size)
    nums = train.step_numbers(cfg)
    core = train.TRAIN_JITS[cfg.donate]
    compiled = core.lower(state.params, state.opt_state, state.frozen, state.version, packed, None, None,
                          knobs, jnp.zeros(cfg.updates, jnp.float32), nums, jnp.float32(jnp.inf),
                          tx=state.tx,
                          config=state.config, kind=kind, cfg=train._structure(cfg)).compile()
    m = compiled.memory_analysis()
    return {k: int(getattr(m, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                            "alias_size_in_bytes", "temp_size_in_bytes",
                                            "generated_code_size_in_bytes")}


def run_point(model: str, n: int, length: int, steps: int, donate: bool,
              analysis: bool, knobs: dict | None = None, lora: dict | None = None) -> dict:
    """One point in this process (meant to be a fresh one): floor, peak RSS, step seconds.
    lora: LoraConfig fields (rank, alpha, targets) to train adapters only, or None."""
    import jax

    from jaxrl_cache.models.config import ModelConfig
    from jaxrl_cache.models.llama import init_params
    from jaxrl_cache.models.lora import LoraConfig
    from jaxrl_cache.rl.batch import make_batch, pack_batch
    from jaxrl_cache.rl.memory import estimate_step_bytes
    from jaxrl_cache.rl.train import TrainState, train_step
    from jaxrl_cache.rl.train_config import TrainConfig

    config = ModelConfig(**MODELS[model])
    lora_config = None if lora is None else LoraConfig(**lora)
    params = init_params(config, jax.random.key(0))
    state = TrainState.create(params, config=config, lr_schedule=1e-6, lora=lora_config)
    del params
    jax.block_until_ready(state)
    floor_kib, init_peak_kib = _status_kib("VmRSS"), _status_kib("VmHWM")
    rollouts = fake_rollouts(n, length, config.vocab_size)
    rewards = np.random.default_rng(1).uniform(0, 1, n)
    batch = make_batch(rollouts, rewards)
    cfg = TrainConfig(donate=donate, **(knobs or {}))
    packed = pack_batch(batch, cfg)
    shape = [int(d) for d in packed.tokens.shape]
    computed = packed.computed_tokens
    del packed
    plan = _update_memory_plan(state, batch, cfg) if analysis else None
    seconds, loads = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = jax.block_until_ready(train_step(state, batch, cfg))
        seconds.append(time.perf_counter() - t0)
        loads.append(_load())
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    estimate = estimate_step_bytes(config, cfg, shape[-1], lora_config)
    timed = seconds[1:] or seconds
    planned = None if plan is None else (plan["argument_size_in_bytes"]
                                         + plan["output_size_in_bytes"]
                                         - plan["alias_size_in_bytes"]
                                         + plan["temp_size_in_bytes"])
    return dict(model=model, n=n, length=length, tokens=n * length, donate=donate,
                knobs=knobs or {}, steps=steps, xla_flags=os.environ.get("XLA_FLAGS", ""),
                lora=None if lora_config is None else dict(
                    rank=lora_config.rank, alpha=lora_config.alpha,
                    targets=list(lora_config.targets)),
                trainable_params=sum(x.size for x in jax.tree.leaves(state.params)),
                packed_shape_UMBR=shape, computed_tokens=computed,
                real_tokens=batch.real_tokens,
                computed_over_real=round(computed / batch.real_tokens, 4),
                floor_gib=round(floor_kib / 2**20, 3),
                init_peak_gib=round(init_peak_kib / 2**20, 3),
                peak_rss_gib=round(peak_kib / 2**20, 3),
                step_seconds=[round(s, 2) for s in seconds], load_after_step=loads,
                tokens_per_s=round(n * length / min(timed), 1) if seconds else None,
                estimate_gib={k: round(estimate[k] / GIB, 3) for k in ("state", "total")},
                loss=float(metrics["loss"]) if steps else None, memory_plan=plan,
                planned_gib=None if planned is None else round(planned / GIB, 3))


def interleaved_point(model: str, n: int, length: int, rounds: int, donate: bool,
                      knobs: dict | None, lora: dict) -> dict:
    """Seconds per train step of full fine-tuning and of LoRA (`lora`) in one process, in turn
    (one warm-up step each, then full, LoRA, full, ... `rounds` times): a load change on the
    shared machine hits both alike. No per-mode peak RSS (both states are live)."""
    import jax
    import jax.numpy as jnp

    from jaxrl_cache.models.config import ModelConfig
    from jaxrl_cache.models.llama import init_params
    from jaxrl_cache.models.lora import LoraConfig
    from jaxrl_cache.rl.batch import make_batch
    from jaxrl_cache.rl.train import TrainState, train_step
    from jaxrl_cache.rl.train_config import TrainConfig

    config = ModelConfig(**MODELS[model])
    params = init_params(config, jax.random.key(0))
    states = {"full": TrainState.create(jax.tree.map(jnp.copy, params), config=config,
                                        lr_schedule=1e-6),  # own copy: donation frees it
              "lora": TrainState.create(params, config=config, lr_schedule=1e-6,
                                        lora=LoraConfig(**lora))}
    batch = make_batch(fake_rollouts(n, length, config.vocab_size),
                       np.random.default_rng(1).uniform(0, 1, n))
    cfg = TrainConfig(donate=donate, **(knobs or {}))
    seconds = {name: [] for name in states}
    loads = []
    for _ in range(rounds + 1):  # the first round compiles
        for name in states:
            t0 = time.perf_counter()
            states[name], _ = jax.block_until_ready(train_step(states[name], batch, cfg))
            seconds[name].append(round(time.perf_counter() - t0, 2))
        loads.append(_load())
    best = {name: min(s[1:]) for name, s in seconds.items()}
    return dict(model=model, n=n, length=length, tokens=n * length, donate=donate,
                knobs=knobs or {}, lora=dict(lora, targets=list(LoraConfig(**lora).targets)),
                rounds=rounds, step_seconds=seconds, load_after_round=loads,
                best_seconds=best,
                tokens_per_s={k: round(n * length / v, 1) for k, v in best.items()},
                lora_speedup=round(best["full"] / best["lora"], 3))


def grpo_packing(prompts: int = 32, group: int = 8, max_new: int = 1024, seed: int = 0,
                 mini_batches=(1, 4)) -> list[dict]:
    """Computed / real tokens of `pack_batch` on a GRPO batch with random prompt (16-128)
    and output (1-max_new, uniform) lengths, default token budget (host only)."""
    from jaxrl_cache.rl.batch import make_batch, pack_batch
    from jaxrl_cache.rl.train_config import TrainConfig

    rng = np.random.default_rng(seed)
    samples = []
    for p in range(prompts):
        prompt = tuple(int(t) for t in rng.integers(0, 49152, rng.integers(16, 129)))
        samples += [_sample(prompt, int(rng.integers(1, max_new + 1)), p, 49152, rng)
                    for _ in range(group)]
    rollouts = _rollouts(samples, group, max_new)
    batch = make_batch(rollouts, rng.uniform(0, 1, len(samples)))
    rows = []
    for m in mini_batches:
        packed = pack_batch(batch, TrainConfig(mini_batches=m))
        rows.append(dict(prompts=prompts, group=group, max_new_tokens=max_new, mini_batches=m,
                         packed_shape_UMBR=[int(d) for d in packed.tokens.shape],
                         computed_tokens=packed.computed_tokens,
                         real_tokens=batch.real_tokens,
                         computed_over_real=round(packed.computed_tokens / batch.real_tokens,
                                                  4)))
    return rows


def _growth(rows: list[dict], budget: int, key: str) -> float | None:
    """Least-squares GiB of `key` per extra 1k tokens over points with >= budget tokens."""
    big = [r for r in rows if r["tokens"] >= budget and r.get(key) is not None
           and (r["steps"] or key != "peak_rss_gib")]
    if len({r["tokens"] for r in big}) < 2:  # a slope needs two sizes
        return None
    x = np.array([r["tokens"] / 1000 for r in big])
    y = np.array([r[key] for r in big])
    return round(float(np.polyfit(x, y, 1)[0]), 4)


def markdown(result: dict) -> str:
    env = result["env"]
    lines = [f"# train_step memory on CPU ({result['date']})", "",
             f"fp32, default TrainConfig (token_budget {result['token_budget']}, remat full), "
             f"make_optimizer(); XLA_FLAGS={env['XLA_FLAGS']!r}; {env['cpus']} CPUs, "
             f"jax {env['jax']}. Each point a fresh process; floor = RSS after params + "
             "optimizer init; peak = ru_maxrss after `steps` train steps (steps 0: after "
             "compiling the update only); plan = XLA's compiled memory plan of the update "
             "(arguments + outputs - aliased + temp); time = last step (after compile) when "
             "steps = 2, else the first step (compile included); load = 1/5/15-min load "
             "average after it.", "",
             "| model | N x L | training | donate | XLA 1-thread | steps | packed [U,M,B,R] "
             "| computed/real | floor GiB | peak GiB | plan GiB | estimate GiB | target GiB "
             "| s/step | tok/s | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["points"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['n']}x{r['length']} | {_training(r)} | "
                         f"{r['donate']} | | | failed: {r['error']} | | | | | | | | | |")
            continue
        target = TARGETS.get((r["model"], r["n"], r["length"]))
        secs = r["step_seconds"]
        lines.append(
            f"| {r['model']} | {r['n']}x{r['length']} | {_training(r)} | {r['donate']} | "
            f"{'eigen=false' in r.get('xla_flags', '')} | {r['steps']} | "
            f"{r['packed_shape_UMBR']} | {r['computed_over_real']} | {r['floor_gib']} | "
            f"{r['peak_rss_gib']} | {r['planned_gib'] or ''} | "
            f"{(r.get('estimate_gib') or {}).get('total', '')} | {target or ''} | "
            f"{secs[-1] if secs else ''}{'' if len(secs) > 1 or not secs else ' (1st)'} | "
            f"{r.get('tokens_per_s') or ''} | "
            f"{r['load_after_step'][-1] if secs else r['load_before']} |")
    lines += ["", "Growth per extra 1k tokens (least squares over points >= the budget; "
              f"target <= {GROWTH_TARGET} GiB of peak RSS):", ""]
    for key, value in result["growth_gib_per_1k_tokens"].items():
        lines.append(f"- {key}: {value}")
    if result.get("interleaved"):
        lines += ["", "Full fine-tuning and LoRA in one process, steps in turn (`--interleave`; "
                  "best of the rounds after a compiling one):", "",
                  "| model | N x L | LoRA | rounds | full s/step | LoRA s/step | full tok/s | "
                  "LoRA tok/s | speedup | load after each round |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["interleaved"]:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['n']}x{r['length']} | | | failed: "
                             f"{r['error']} | | | | | |")
                continue
            b, t = r["best_seconds"], r["tokens_per_s"]
            lines.append(f"| {r['model']} | {r['n']}x{r['length']} | "
                         f"{_training(r).removeprefix('LoRA ')} | {r['rounds']} | {b['full']} | "
                         f"{b['lora']} | {t['full']} | {t['lora']} | {r['lora_speedup']} | "
                         f"{r['load_after_round']} |")
    lines += ["", "GRPO batch with random lengths (prompt 16-128, output 1-max_new uniform):", "",
              "| prompts x group | max_new | mini_batches | packed [U,M,B,R] | computed/real |",
              "|---|---|---|---|---|"]
    for g in result["grpo_packing"]:
        lines.append(f"| {g['prompts']}x{g['group']} | {g['max_new_tokens']} | "
                     f"{g['mini_batches']} | {g['packed_shape_UMBR']} | "
                     f"{g['computed_over_real']} |")
    return "\n".join(lines) + "\n"


def _training(row: dict) -> str:
    """'full' or 'LoRA r16 a32 q_proj,v_proj', plus TrainConfig knobs set on the command line."""
    lora = row.get("lora")
    what = "full" if not lora else (f"LoRA r{lora['rank']} a{lora['alpha']:g} "
                                    + ("all-linear" if len(lora["targets"]) == 7
                                       else ",".join(lora["targets"])))
    return " ".join([what] + [f"{k}={v}" for k, v in (row.get("knobs") or {}).items()])


def _lora(args) -> dict | None:
    """LoraConfig fields of --lora-rank/--lora-alpha/--lora-targets (None: full fine-tuning)."""
    if not args.lora_rank:
        return None
    out = dict(rank=args.lora_rank, alpha=args.lora_alpha)
    if args.lora_targets:
        out["targets"] = tuple(args.lora_targets.split(","))
    return out


def _knobs(args) -> dict:
    """TrainConfig fields set on the command line (--logprob-chunk, --compute-dtype, --remat)."""
    return {k: getattr(args, k) for k in ("logprob_chunk", "compute_dtype", "remat")
            if getattr(args, k) is not None}


def _child_main(args) -> None:
    model, nl = args.child.split(":")
    n, length = (int(x) for x in nl.split("x"))
    if args.interleave:
        row = interleaved_point(model, n, length, args.interleave, args.donate, _knobs(args),
                                _lora(args))
    else:
        row = run_point(model, n, length, args.steps, args.donate, args.analysis,
                        _knobs(args), _lora(args))
    print("RESULT " + json.dumps(row), flush=True)


def _run_child(point: str, args, timeout: float) -> dict:
    model, nl = point.split(":")
    n, length = (int(x) for x in nl.split("x"))
    cmd = [sys.executable, "-m", "benchmarks.train_memory", "--child", point,
           "--steps", str(args.steps), f"--interleave={args.interleave}"] + \
        ["--donate"] * args.donate + \
        ["--analysis"] * args.analysis + [f"--{k.replace('_', '-')}={v}"
                                          for k, v in _knobs(args).items()] + \
        ([f"--lora-rank={args.lora_rank}", f"--lora-alpha={args.lora_alpha}"]
         + [f"--lora-targets={args.lora_targets}"] * bool(args.lora_targets)
         if args.lora_rank else [])
    t0 = time.time()
    load_before = _load()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(model=model, n=n, length=length, tokens=n * length, donate=args.donate,
                    steps=args.steps, lora=_lora(args), knobs=_knobs(args),
                    error=f"timeout after {timeout:.0f} s")
    found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not found:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
        return dict(model=model, n=n, length=length, tokens=n * length, donate=args.donate,
                    steps=args.steps, lora=_lora(args), knobs=_knobs(args),
                    error=f"rc {proc.returncode}: {tail}")
    row = json.loads(found[-1][len("RESULT "):])
    row.update(load_before=load_before, wall_seconds=round(time.time() - t0, 1))
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", default=DEFAULT_POINTS,
                   help="comma-separated model:NxL (models: " + ", ".join(MODELS) + ")")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--donate", action="store_true", help="TrainConfig(donate=True)")
    p.add_argument("--logprob-chunk", type=int, help="TrainConfig.logprob_chunk")
    p.add_argument("--compute-dtype", choices=["float32", "bfloat16"])
    p.add_argument("--remat", choices=["full", "dots", "none"])
    p.add_argument("--lora-rank", type=int, default=0,
                   help="train LoRA adapters of this rank over the frozen base (0: full)")
    p.add_argument("--lora-alpha", type=float, default=8.0, help="LoRA alpha [8, PEFT's]")
    p.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                   help="time full fine-tuning and the --lora-* config in one process, steps "
                        "in turn, ROUNDS each after a compiling one (no peak RSS)")
    p.add_argument("--lora-targets", help="comma-separated PEFT module names or all-linear "
                                          "[q_proj,v_proj]")
    p.add_argument("--analysis", action="store_true",
                   help="also compile the update for XLA's memory plan (more compile time)")
    p.add_argument("--single-thread", action="store_true",
                   help="XLA_FLAGS=--xla_cpu_multi_thread_eigen=false in the children")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per point")
    p.add_argument("--json", type=pathlib.Path)
    p.add_argument("--md", type=pathlib.Path)
    p.add_argument("--append", action="store_true",
                   help="add the points to an existing --json (same settings) and rewrite --md")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.interleave and not args.lora_rank:
        p.error("--interleave compares full fine-tuning with LoRA: give --lora-rank R")
    if args.child:
        return _child_main(args)
    if args.single_thread:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_cpu_multi_thread_eigen=false").strip()
    import jax

    from jaxrl_cache.rl.train_config import TrainConfig

    if args.append and args.json and args.json.exists():
        result = json.loads(args.json.read_text())
    else:
        result = dict(date=datetime.date.today().isoformat(),
                      token_budget=TrainConfig().token_budget, prompt_tokens=PROMPT,
                      env=dict(XLA_FLAGS=os.environ.get("XLA_FLAGS", ""),
                               cpus=os.cpu_count(), jax=jax.__version__,
                               python=platform.python_version(), machine=platform.machine()),
                      points=[], grpo_packing=grpo_packing())
    for point in args.points.split(","):
        row = _run_child(point, args, args.timeout)
        print(json.dumps(row), flush=True)
        if args.interleave:
            result.setdefault("interleaved", []).append(row)
        else:
            result["points"].append(row)
    groups = sorted({(r["model"], r["donate"], _training(r)) for r in result["points"]})
    result["growth_gib_per_1k_tokens"] = {
        f"{m} donate={d}{'' if t == 'full' else ' ' + t} {key}": _growth(
            [r for r in result["points"] if (r["model"], r["donate"], _training(r)) == (m, d, t)],
            result["token_budget"], key)
        for m, d, t in groups for key in ("peak_rss_gib", "planned_gib")}
    write_report(result, args.json, args.md, markdown)


if __name__ == "__main__":
    main()
