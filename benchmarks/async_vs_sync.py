"""Asynchronous vs synchronous RL on the demo task, side by side in one process.

Both runs start from the same warm-started policy (the first run's `sft_model`) with the same
seed, prompts, steps and sampling, and differ only in the rollout mode: sync (rollout, then
train, then sync) or async (a RolloutWorker generating while the trainer trains, updates
landing between decode chunks; `--kv-policy`). Reports GRPO wall time per step and the
ratio, tokens recomputed per update, mixed tokens, the staleness histogram and both reward
curves.

    python -m benchmarks.async_vs_sync [--steps 40] [--kv-policy recompute] [--json PATH]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import tempfile

import numpy as np


def _rows(out: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def in_flight_update_cost(policy_dir: pathlib.Path, every: int = 2, calls: int = 6) -> dict:
    """Rollout calls of the demo's shape (8 prompts x 8 samples) with a weight update forced
    at every `every`-th step boundary (chunk_steps=1): seconds per call and tokens
    re-prefilled per update for each kv_policy, vs no update in flight."""
    import time

    import jax

    from jaxrl_cache.app.demo import DemoOptions, _make_task, _encode_prompts
    from jaxrl_cache.models import from_pretrained, load_tokenizer
    from jaxrl_cache.rollout import CacheConfig, RolloutEngine, SamplingParams, SchedulerConfig

    config, params = from_pretrained(policy_dir)
    tok = load_tokenizer(policy_dir)
    task = _make_task(DemoOptions())
    sampling = SamplingParams(n=8, max_new_tokens=task.num_digits + 1,
                              stop_token_ids=tok.stop_token_ids)
    scaled = [jax.tree.map(lambda x, f=1 + 1e-3 * v: x * f, params) for v in range(60)]

    class Forced(RolloutEngine):
        def _between_steps(self, run):
            self.boundary = getattr(self, "boundary", 0) + 1
            if self.forcing and self.boundary % every == 0:
                v = self.version + 1
                self.sync_weights(scaled[v], v)

    out = {}
    for policy, forcing in (("recompute", False), ("recompute", True), ("keep", True)):
        engine = Forced(config, CacheConfig(num_pages=512, page_size=DemoOptions().page_size),
                        scheduler_config=SchedulerConfig(chunk_steps=1),
                        kv_policy=policy, max_policy_lag=1)
        engine.forcing = False
        engine.sync_weights(scaled[0], 0)
        prompts = [_encode_prompts(tok, [e.prompt for e in task.sample(
            np.random.default_rng([9, c]), 8)]) for c in range(calls)]
        engine.forcing = forcing
        for c in range(calls):  # warm-up: compiles every packed prefill shape the calls use
            engine.rollout(scaled[engine.version], engine.version, prompts[c], sampling,
                           rng=jax.random.key(c))
        seconds, recomputed, updates, mixed = [], 0, 0, 0
        for c in range(calls):
            t0 = time.perf_counter()
            b = engine.rollout(scaled[engine.version], engine.version, prompts[c], sampling,
                               rng=jax.random.key(c))
            seconds.append(time.perf_counter() - t0)
            recomputed += b.recomputed_tokens
            updates += b.weight_updates
            mixed += sum(0 if s.mixed_tokens is None else int(s.mixed_tokens.sum())
                         for s in b.samples)
        out[policy + ("" if forcing else " (no update)")] = dict(
            seconds_per_call=float(np.median(seconds)), updates=updates,
            recomputed_tokens_per_update=recomputed / max(updates, 1),
            mixed_tokens=mixed, generated_tokens_per_call=b.generated_tokens)
    return out


def main(argv=None) -> dict:
    from jaxrl_cache.app.demo import DemoOptions, run_demo
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kv-policy", choices=["recompute", "keep"], default="recompute")
    ap.add_argument("--max-policy-lag", type=int, default=1)
    ap.add_argument("--chunk-steps", type=int, default=2,
                    help="both runs; small enough that updates land inside rollout calls")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--plot", metavar="PNG", help="reward curves and staleness histogram")
    args = ap.parse_args(argv)
    root = pathlib.Path(tempfile.mkdtemp(prefix="async_vs_sync_"))
    base = DemoOptions(steps=args.steps, eval_prompts=32, checkpoint_every=10**6,
                       chunk_steps=args.chunk_steps)
    sync = run_demo(dataclasses.replace(base, steps=1, out=str(root / "sync")))  # warm start
    policy = root / "sync" / "sft_model"
    start = dataclasses.replace(base, model=str(policy), sft_steps=0)
    sync_again = run_demo(dataclasses.replace(start, out=str(root / "sync2")))
    asyn = run_demo(dataclasses.replace(start, out=str(root / "async"), async_rollouts=True,
                                        kv_policy=args.kv_policy,
                                        max_policy_lag=args.max_policy_lag))
    rows_sync, rows_async = _rows(root / "sync2"), _rows(root / "async")
    forced = in_flight_update_cost(policy)
    wall = lambda rows: float(sum(r["step_seconds"] for r in rows[1:]))  # step 0 compiles
    updates = max(len(rows_async) - 1, 1)
    result = dict(
        date=datetime.date.today().isoformat(),
        machine=f"{os.cpu_count()}-core {platform.machine()} (CPU), load {os.getloadavg()[0]:.1f}",
        command=f"python -m benchmarks.async_vs_sync --steps {args.steps} "
                f"--kv-policy {args.kv_policy} --max-policy-lag {args.max_policy_lag} "
                f"--chunk-steps {args.chunk_steps}",
        steps=args.steps, samples_per_run=args.steps * base.prompts_per_step * base.group_size,
        sync_grpo_seconds=wall(rows_sync), async_grpo_seconds=wall(rows_async),
        speedup_async_over_sync=wall(rows_sync) / max(wall(rows_async), 1e-9),
        recomputed_tokens=asyn["recomputed_tokens"],
        recomputed_tokens_per_update=asyn["recomputed_tokens"] / updates,
        mixed_tokens=asyn["mixed_tokens"], dropped_stale_calls=asyn["dropped_stale_calls"],
        staleness_histogram=asyn["staleness_histogram"],
        forced_updates_every_2_chunks=forced,
        audit=dict(sync=[sync_again["audited_samples"], sync_again["audit_failures"]],
                   async_=[asyn["audited_samples"], asyn["audit_failures"]]),
        reward_curve_sync=[round(r["reward"], 4) for r in rows_sync],
        reward_curve_async=[round(r["reward"], 4) for r in rows_async],
        exact_match_eval=dict(sft=sync["sft_exact_match"], sync=sync_again["rl_exact_match"],
                              async_=asyn["rl_exact_match"]),
        reward_last=dict(sync=sync_again["reward_last"], async_=asyn["reward_last"]))
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        pathlib.Path(args.json).write_text(text + "\n")
    if args.plot:
        _plot(result, args.plot)
    return result


def _plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, hist) = plt.subplots(1, 2, figsize=(10, 3.5),
                                   gridspec_kw=dict(width_ratios=[3, 1]))
    for key, label in (("reward_curve_sync", "sync"), ("reward_curve_async", "async")):
        ax.plot(result[key], label=label, alpha=0.8)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward")
    ax.legend()
    ax.grid(alpha=0.3)
    staleness = {int(k): v for k, v in result["staleness_histogram"].items()}
    hist.bar(list(staleness), list(staleness.values()))
    hist.set_xlabel("token staleness (versions)")
    hist.set_ylabel("trained tokens")
    hist.set_xticks(list(staleness))
    fig.suptitle(f"async ({result['command'].split('--kv-policy ')[1].split()[0]}) vs sync, "
                 f"same seed: async runs steps at {result['speedup_async_over_sync']:.2f}x "
                 f"the sync speed")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
