"""Issue-9 figures for the scheduler engine, measured side by side in one process on CPU
(timed runs interleaved round by round, fastest kept, so load on a shared machine hits both
sides of a ratio alike).

1. GRPO workload with more samples than slots: 64 prompts x n=8 (512 samples), 64-token
   prompts sharing a 32-token prefix, outputs of random length (32 stop ids of a 2048 vocab,
   so ~1/64 per step), up to 128 new tokens. Generated tokens/s of the scheduler (64 slots,
   16-step chunks) vs one static batch (all 512 rows admitted at once, one 128-step chunk:
   every row runs until the longest finishes), both with pools that hold everything; and
   the scheduler again with a pool holding a quarter of the workload's worst case.
2. Decode step time of the engine's decode chunk vs a plain jitted dense-KV loop, 64 rows at
   context 256, vocab 2048.
3. Prefill tokens computed for 8 prompts sharing a 192-token prefix + 64 own tokens, n=8.

    python -m benchmarks.engine_v2 [--json benchmarks/results/engine-v2-cpu-DATE.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.test_bench_engine import _dense_decode_loop
from jaxrl_cache.models import ModelConfig, init_kv_cache, init_params
from jaxrl_cache.rollout import (CacheConfig, RolloutEngine, SamplingParams, SchedulerConfig,
                                 core)
from jaxrl_cache.rollout.scheduler import row_pages
from jaxrl_cache.shapes import page_width_bucket
from benchmarks.timing import best_interleaved

VOCAB, PS = 2048, 16
CONFIG = ModelConfig.tiny(vocab_size=VOCAB, max_seq_len=512)


def grpo_workload(rounds: int) -> dict:
    rng = np.random.default_rng(0)
    prefix = rng.integers(64, VOCAB, 32).tolist()
    prompts = [prefix + rng.integers(64, VOCAB, 32).tolist() for _ in range(64)]
    sp = SamplingParams(n=8, max_new_tokens=128, temperature=1.0,
                        stop_token_ids=tuple(range(32)))
    params = init_params(CONFIG, jax.random.key(0))
    worst = 512 * row_pages(64, 128, PS)
    runs = {
        "scheduler": (CacheConfig(num_pages=worst + 64, page_size=PS), SchedulerConfig()),
        "static_batch": (CacheConfig(num_pages=worst + 64, page_size=PS),
                         SchedulerConfig(max_num_seqs=512, chunk_steps=128,
                                         max_prefill_tokens=64 * 64)),
        "scheduler_quarter_pool": (CacheConfig(num_pages=worst // 4 + 1, page_size=PS),
                                   SchedulerConfig()),
    }
    calls, batches = {}, {}
    for name, (cache, sched) in runs.items():
        engine = RolloutEngine(CONFIG, cache, scheduler_config=sched, backend="xla")

        def call(name=name, engine=engine, version=iter(range(10**6))):
            # a new version each call: no cross-call prefix reuse
            batches[name] = engine.rollout(params, next(version), prompts, sp,
                                           rng=jax.random.key(1))

        call()  # compile
        calls[name] = call
    best = best_interleaved(calls, rounds)
    out = {}
    for name, (cache, _) in runs.items():
        batch, seconds = batches[name], best[name]
        out[name] = dict(seconds=seconds, generated_tokens=batch.generated_tokens,
                         tokens_per_s=batch.generated_tokens / seconds,
                         decode_steps=batch.decode_steps, decode_chunks=batch.decode_chunks,
                         prefill_launches=batch.prefill_launches,
                         pool_pages=cache.num_pages - 1, worst_case_pages=worst)
    out["timing"] = f"fastest of {rounds} rounds, the three engines interleaved"
    out["scheduler_over_static"] = (out["scheduler"]["tokens_per_s"]
                                    / out["static_batch"]["tokens_per_s"])
    return out


def decode_vs_dense(rounds: int) -> dict:
    rows, ctx, steps = 64, 256, 32
    params = init_params(CONFIG, jax.random.key(0))
    rng = np.random.default_rng(0)
    width = page_width_bucket(row_pages(ctx, steps, PS))  # the engine's table width: 20
    pool = init_kv_cache(CONFIG, rows * width + 1, PS)
    pool = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), pool)
    table = np.asarray(1 + np.arange(rows * width).reshape(rows, width), np.int32)
    zeros = np.zeros(rows, np.int32)
    knobs = SamplingParams(temperature=1.0).as_arrays()
    state = {"pool": pool}

    def paged():
        out = core.decode_chunk(
            params, state["pool"], jnp.zeros((rows, VOCAB), jnp.float32), np.zeros(rows, bool),
            zeros, np.full(rows, ctx, np.int32), table, np.zeros(0, np.int32),
            np.full(rows, steps, np.int32),
            np.arange(rows, dtype=np.int32), zeros, -np.ones(1, np.int32), np.int32(rows + 1),
            **knobs, key=jax.random.key(0), config=CONFIG, backend="xla", steps=steps)
        state["pool"] = out[-1]
        return jax.block_until_ready(out[0])

    dense = _dense_decode_loop(CONFIG, steps)
    cache = tuple((jnp.asarray(rng.standard_normal(
        (rows, ctx + steps, CONFIG.n_kv_heads, CONFIG.head_dim)), jnp.float32),) * 2
        for _ in range(CONFIG.n_layers))  # per layer (k, v) [B, S, Hkv, D]
    run_dense = lambda: jax.block_until_ready(  # noqa: E731
        dense(params, cache, jnp.zeros(rows, jnp.int32), jnp.full(rows, ctx, jnp.int32),
              jax.random.key(0)))
    paged(), run_dense()
    best = best_interleaved(dict(paged=paged, dense=run_dense), 3 * rounds)
    paged_s, dense_s = best["paged"], best["dense"]
    return dict(rows=rows, context=ctx, steps=steps, vocab=VOCAB,
                timing=f"fastest of {3 * rounds} interleaved rounds each",
                paged_ms_per_step=paged_s / steps * 1e3, dense_ms_per_step=dense_s / steps * 1e3,
                paged_over_dense=dense_s / paged_s)


def shared_prefix_prefill() -> dict:
    rng = np.random.default_rng(1)
    system = rng.integers(64, VOCAB, 192).tolist()
    prompts = [system + rng.integers(64, VOCAB, 64).tolist() for _ in range(8)]
    engine = RolloutEngine(CONFIG, CacheConfig(num_pages=1024, page_size=PS), backend="xla")
    batch = engine.rollout(init_params(CONFIG, jax.random.key(0)), 0, prompts,
                           SamplingParams(n=8, max_new_tokens=8), rng=jax.random.key(0))
    total = batch.prompt_tokens
    return dict(prompt_tokens=total, computed=batch.prefill_tokens,
                computed_fraction=batch.prefill_tokens / total,
                ideal=192 + 8 * 64)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    result = dict(date=datetime.date.today().isoformat(), machine=platform.processor() or
                  platform.machine(), cpus=jax.local_device_count(), jax=jax.__version__,
                  shared_prefix_prefill=shared_prefix_prefill(),
                  decode_vs_dense=decode_vs_dense(args.rounds),
                  grpo_workload=grpo_workload(args.rounds))
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
