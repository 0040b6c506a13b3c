"""Multi-turn episodes (RolloutEngine.rollout_episodes) on CPU: prefix reuse across turns,
slow environments, and weight updates landing between and inside turns.

Workload: 8 tasks x 8 episodes, 4 turns of up to 32 sampled tokens, a 96-token system
prompt shared by every task, 16-token observations; a random-weight Llama-style model
(`--model small`: d_model 256, 4 layers, vocab 512; `tiny`: the demo's size).

- reuse: history tokens (a later turn's context that the previous turn had seen) served
  by the version's prefix cache, and prefill tokens computed vs recomputing every turn's
  whole context (no cache);
- slow environment: 50 ms per step vs instant, same batch and rng, interleaved rounds:
  episodes/s ratio (the engine decodes other rows while environments think);
- async: kv_policy "recompute" with a weight update forced every few step boundaries
  (between and inside turns): the attribution audit over every sampled token, and tokens
  re-prefilled per update.

    python -m benchmarks.episodes [--model small|tiny] [--rounds 3] [--json PATH --md PATH]
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import time

import jax
import numpy as np

from benchmarks.timing import write_report
from jaxrl_cache import (CacheConfig, ModelConfig, RolloutEngine, SamplingParams,
                         SchedulerConfig, audit_attribution, init_params)
from jaxrl_cache.rollout.env import EnvStep

SYSTEM = [int(t) for t in np.random.default_rng(0).integers(4, 500, 96)]
TURNS, OBS, NEW = 4, 16, 32


class ToolEnv:
    """Answers each turn with OBS tokens derived from it; ends after TURNS turns."""

    def __init__(self, task, delay: float = 0.0):
        self.task, self.delay, self.steps = task, delay, 0

    def reset(self):
        return SYSTEM + list(self.task)

    def step(self, action):
        if self.delay:
            time.sleep(self.delay)
        self.steps += 1
        seed = (sum(action) * 31 + self.steps) % 1000
        obs = [int(t) for t in np.random.default_rng(seed).integers(4, 500, OBS)]
        return EnvStep(obs, float(len(action)), self.steps >= TURNS)


def model(name: str) -> ModelConfig:
    if name == "tiny":
        return ModelConfig.tiny(vocab_size=512, max_seq_len=512)
    return ModelConfig.tiny(vocab_size=512, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
                            head_dim=32, d_ff=768, max_seq_len=512)


class ForcedUpdates(RolloutEngine):
    """A weight update (a new random policy) every `every` step boundaries."""

    def __init__(self, *args, every: int, params, **kwargs):
        super().__init__(*args, **kwargs)
        self.every, self.params, self.boundary = every, params, 0

    def _between_steps(self, run):
        self.boundary += 1
        if self.boundary % self.every == 0:
            v = self.version + 1
            self.params[v] = init_params(self.model_config, jax.random.key(v))
            self.sync_weights(self.params[v], v)


def run(args) -> dict:
    config = model(args.model)
    params = init_params(config, jax.random.key(0))
    tasks = [tuple(int(t) for t in np.random.default_rng(100 + g).integers(4, 500, 8))
             for g in range(8)]
    sampling = SamplingParams(n=8, max_new_tokens=NEW, temperature=1.0)
    cache = CacheConfig(num_pages=1024, page_size=args.page_size)
    sched = SchedulerConfig(max_num_seqs=64, chunk_steps=16)
    engine = RolloutEngine(config, cache, scheduler_config=sched, backend="xla")
    engine.sync_weights(params, 0)

    def call(delay):
        """One rng and an empty cache each time: the same episodes and work (no call
        compiles what another did not, no call reuses another's prefixes)."""
        engine.cache.clear()
        return engine.rollout_episodes(params, 0, tasks, lambda t: ToolEnv(t, delay), sampling,
                                       rng=jax.random.key(1), max_turns=TURNS)

    call(0.0)  # compile (the order slow environments admit turns in may add shapes)
    call(args.delay)
    best = {"instant": float("inf"), "slow": float("inf")}
    batches = {}
    for _ in range(args.rounds):
        for name, delay in (("instant", 0.0), ("slow", args.delay)):
            t0 = time.perf_counter()
            batches[name] = call(delay)
            best[name] = min(best[name], time.perf_counter() - t0)
    b = batches["instant"]
    contexts = sum(len(e.prompt_ids) + (e.turns[k][0] if k else 0)
                   for e in b.episodes for k in range(len(e.turns)))
    reuse = dict(history_tokens=b.history_tokens, history_cached=b.history_cached,
                 history_served=b.history_cached / max(b.history_tokens, 1),
                 prefill_tokens=b.prefill_tokens, no_cache_prefill_tokens=contexts,
                 prefill_saved=1 - b.prefill_tokens / contexts,
                 turns=sum(len(e.turns) for e in b.episodes))
    n = len(b.episodes)
    slow = dict(delay_s=args.delay, instant_s=best["instant"], slow_s=best["slow"],
                episodes_per_s_instant=n / best["instant"], episodes_per_s_slow=n / best["slow"],
                ratio=best["instant"] / best["slow"], env_steps=batches["slow"].env_steps,
                env_seconds_slow=batches["slow"].env_seconds)
    history = {0: params}
    forced = ForcedUpdates(config, cache, scheduler_config=SchedulerConfig(
        max_num_seqs=64, chunk_steps=4), backend="xla", kv_policy="recompute",
        every=args.update_every, params=history)
    forced.sync_weights(params, 0)
    a = forced.rollout_episodes(params, 0, tasks, ToolEnv, sampling, rng=jax.random.key(9),
                                max_turns=TURNS)
    report = audit_attribution(a, history, config)
    per_turn_versions = [len(set(e.token_versions[lo:hi].tolist()))
                         for e in a.episodes for lo, hi in e.turns]
    versions_per_episode = [len(set(e.token_versions[e.loss_mask].tolist()))
                            for e in a.episodes]
    asyncr = dict(weight_updates=a.weight_updates, audit_ok=report.ok,
                  checked_tokens=report.num_checked_tokens, sampled_tokens=a.generated_tokens,
                  audit_pass_fraction=(report.num_checked_tokens - len(report.flagged))
                  / max(a.generated_tokens, 1),
                  max_abs_diff=report.max_abs_diff, recomputed_tokens=a.recomputed_tokens,
                  recomputed_per_update=a.recomputed_tokens / max(a.weight_updates, 1),
                  turns_spanning_an_update=sum(v > 1 for v in per_turn_versions),
                  episodes_spanning_an_update=sum(v > 1 for v in versions_per_episode),
                  episodes=len(a.episodes))
    return dict(
        benchmark="episodes", date=datetime.date.today().isoformat(),
        machine=f"CPU, {os.cpu_count()} cores, shared; load {os.getloadavg()[0]:.1f}",
        python=platform.python_version(), jax=jax.__version__, model=args.model,
        params=sum(x.size for x in jax.tree.leaves(params)), page_size=args.page_size,
        workload=f"8 tasks x 8 episodes, {TURNS} turns of <= {NEW} tokens, {OBS}-token "
                 f"observations, {len(SYSTEM)}-token shared system prompt",
        reuse=reuse, slow_environment=slow, async_recompute=asyncr)


def markdown(r: dict) -> str:
    u, s, a = r["reuse"], r["slow_environment"], r["async_recompute"]
    return "\n".join([
        f"# Multi-turn episodes ({r['date']}, {r['machine']}, model {r['model']} "
        f"{r['params']:,} params, page {r['page_size']})", "", r["workload"], "",
        "| measure | value | target |", "|---|---|---|",
        f"| history tokens served by the cache | {u['history_cached']} / {u['history_tokens']}"
        f" = {u['history_served']:.1%} | >= 90% |",
        f"| prefill computed vs no cache | {u['prefill_tokens']} vs "
        f"{u['no_cache_prefill_tokens']} ({u['prefill_saved']:.1%} saved) | |",
        f"| episodes/s, {s['delay_s'] * 1000:.0f} ms env vs instant | "
        f"{s['episodes_per_s_slow']:.2f} vs {s['episodes_per_s_instant']:.2f} = "
        f"{s['ratio']:.2f}x | >= 0.8 |",
        f"| async recompute: audit | {a['checked_tokens']} / {a['sampled_tokens']} sampled "
        f"tokens checked, ok={a['audit_ok']} (max diff {a['max_abs_diff']:.1e}) | 100% |",
        f"| ... updates, re-prefilled tokens | {a['weight_updates']} updates, "
        f"{a['recomputed_tokens']} tokens ({a['recomputed_per_update']:.0f} per update); "
        f"{a['turns_spanning_an_update']} turns and {a['episodes_spanning_an_update']} of "
        f"{a['episodes']} episodes span an update | |", ""])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("small", "tiny"), default="small")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--delay", type=float, default=0.05)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--update-every", type=int, default=6)
    p.add_argument("--json", type=pathlib.Path)
    p.add_argument("--md", type=pathlib.Path)
    args = p.parse_args()
    write_report(run(args), args.json, args.md, markdown)


if __name__ == "__main__":
    main()
