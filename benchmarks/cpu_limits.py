"""The GRPO step against this CPU's limits (issue 64.4): a `jaxrl-cache grpo` run of the
e2e workload (benchmarks/peers/common.py: SmolLM2-135M-Instruct, chat prompts) with its
rollout calls and packed train batches observed, next to two measured ceilings:

- decode: each decode step reads every weight once and multiplies it by each running row,
  so a step costs at least max(weight bytes / read bandwidth, 2 x (matmul params + LM head)
  x rows / the dot rate at `rows` rows) (bandwidth: the best of a jitted sum over 1 GiB and
  numpy's; rows: the call's samples, all running at the start); reported against the
  rollout's seconds per decode step (prefill included: an upper bound of a decode step);
- train: the step's matmul FLOPs (6 x matmul params x the tokens the projections run on, the
  LM head on its scored tokens, fwd + bwd) per train second, against XLA:CPU's dot rate
  measured at the step's own shapes ([tokens, d] x [d, ff], fp32).

    .venv/bin/python benchmarks/cpu_limits.py --shape 2x8x24 --steps 3 \
        --json benchmarks/results/cpu-limits-2026-12-07-2x8x24.json
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "peers"))
import common  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl_cache.app import cli, demo  # noqa: E402
from jaxrl_cache.rl import train as rl_train  # noqa: E402
from jaxrl_cache.rollout.engine import RolloutEngine  # noqa: E402


def _best(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def read_bandwidth(gib: float = 1.0) -> float:
    """Bytes/s of reading `gib` GiB once: the best of a jitted XLA sum and numpy's."""
    n = int(gib * 2**30) // 4
    x = jnp.ones((n,), jnp.float32)
    total = jax.jit(jnp.sum)
    xla = _best(lambda: total(x).block_until_ready())
    host = np.ones((n,), np.float32)
    numpy = _best(lambda: host.sum())
    return n * 4 / min(xla, numpy)


def dot_rate(rows: int, d: int, ff: int) -> float:
    """FLOP/s of XLA:CPU's fp32 [rows, d] x [d, ff] dot (what the step's MLP runs)."""
    a = jnp.ones((rows, d), jnp.float32)
    b = jnp.ones((d, ff), jnp.float32)
    dot = jax.jit(jnp.dot)
    return 2 * rows * d * ff / _best(lambda: dot(a, b).block_until_ready())


def matmul_params(config) -> int:
    """Weights the projections multiply per token (no embedding gather, no LM head)."""
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    per_layer = config.d_model * (2 * q + 2 * kv) + 3 * config.d_model * config.d_ff
    return config.n_layers * per_layer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="2x8x24")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    common.set_shape(args.shape)
    calls, packs, steps = [], [], []
    rollout, pack_batch, grpo_step = RolloutEngine.rollout, rl_train.pack_batch, demo.grpo_step

    def observed_rollout(self, *a, **kw):
        out = rollout(self, *a, **kw)
        calls.append(dict(decode_steps=out.decode_steps, seconds=out.seconds,
                          rows=len(out.samples),
                          prefill_tokens=out.prefill_tokens,
                          weight_bytes=sum(x.nbytes for x in jax.tree.leaves(a[0]))))
        return out

    def observed_pack(*a, **kw):
        out = pack_batch(*a, **kw)
        packs.append(dict(computed=out.computed_tokens,
                          scored=int(np.asarray(out.scored < out.tokens.shape[-1]).sum()),
                          rows=int(np.prod(out.tokens.shape[2:]))))
        return out

    def observed_step(step, *a, **kw):
        first = len(calls)
        result = grpo_step(step, *a, **kw)
        steps.append(dict(step=step, calls=calls[first:], packs=packs[-1:],
                          train_seconds=result.record["train_seconds"],
                          rollout_seconds=result.record["rollout_seconds"]))
        return result

    RolloutEngine.rollout, rl_train.pack_batch = observed_rollout, observed_pack
    demo.grpo_step = observed_step
    out = tempfile.mkdtemp(prefix="cpu_limits_")
    argv = ["grpo", "--model", common.MODEL, "--dataset", str(common.TASK),
            "--answer-regex", r"(-?\d+)", "--steps", str(args.steps),
            "--prompts-per-step", str(common.PROMPTS_PER_STEP), "--group-size",
            str(common.GROUP), "--max-new-tokens", str(common.MAX_NEW_TOKENS),
            "--temperature", str(common.TEMPERATURE), "--lr", str(common.LR),
            "--warmup-steps", "0", "--seed", str(common.SEED), "--eval-prompts", "2",
            "--checkpoint-every", str(args.steps + 1), "--out", out]
    try:
        cli.main(argv)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    from jaxrl_cache.models.hf import config_from_hf
    from jaxrl_cache.models.hf_config import read_json
    config = config_from_hf(read_json(pathlib.Path(common.MODEL) / "config.json"))
    later = [s for s in steps if s["step"] > 0] or steps  # step 0 compiles
    bandwidth = read_bandwidth()
    weight_bytes = later[0]["calls"][0]["weight_bytes"]
    per_decode = statistics.median(
        sum(c["seconds"] for c in s["calls"]) / sum(c["decode_steps"] for c in s["calls"])
        for s in later)
    flops = [6 * (matmul_params(config) * s["packs"][0]["computed"]
                  + config.d_model * config.vocab_size * s["packs"][0]["scored"])
             for s in later]
    train_rate = statistics.median(f / s["train_seconds"] for f, s in zip(flops, later))
    rows = later[0]["packs"][0]["rows"]
    rate = dot_rate(rows, config.d_model, config.d_ff)
    decode_rows = later[0]["calls"][0]["rows"]
    decode_rate = dot_rate(decode_rows, config.d_model, config.d_ff)
    compute_floor = 2 * (matmul_params(config) + config.d_model * config.vocab_size) \
        * decode_rows / decode_rate
    floor = max(weight_bytes / bandwidth, compute_floor)
    result = dict(
        shape=args.shape, steps=args.steps, read_bandwidth_gbs=bandwidth / 1e9,
        weight_bytes=weight_bytes, decode_rows=decode_rows,
        decode_read_floor_ms=1e3 * weight_bytes / bandwidth,
        decode_dot_gflops=decode_rate / 1e9, decode_compute_floor_ms=1e3 * compute_floor,
        decode_ms_per_step=1e3 * per_decode, decode_vs_floor=per_decode / floor,
        train_gflops=train_rate / 1e9, dot_gflops=rate / 1e9, dot_rows=rows,
        train_vs_dot=train_rate / rate, steps_observed=later)
    print(json.dumps({k: v for k, v in result.items() if k != "steps_observed"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
