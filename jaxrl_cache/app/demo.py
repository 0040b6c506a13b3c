"""The main job: GRPO on the embedded digit task, end to end on CPU.

Each step: rollout at the current version (in several calls, so later calls reuse the
instruction prefix cached by the first) -> rewards -> audit -> train_step -> sync_weights.
Writes metrics.jsonl, a plot and a checkpoint into the output directory.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import signal
import time

import jax
import numpy as np
import optax
from tqdm import tqdm

from jaxrl_cache.rl.audit import audit_attribution
from jaxrl_cache.rl.checkpoint import restore_checkpoint, save_checkpoint
from jaxrl_cache.rollout import CacheConfig, RolloutEngine
from jaxrl_cache.models.llama import ModelConfig, init_params
from jaxrl_cache.rollout.sampling import SamplingParams
from jaxrl_cache.app.tasks import EOS, ReverseDigits
from jaxrl_cache.rl.train import TrainState, make_batch, make_optimizer, train_step


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    steps: int = 200
    group_size: int = 8
    prompts_per_step: int = 16
    rollout_calls: int = 4  # rollout calls per step (later ones hit the cached prefix)
    max_new_tokens: int = 5
    lr: float = 3e-3
    warmup_steps: int = 10
    seed: int = 0
    backend: str = "auto"
    out: str = "runs/demo"
    resume: bool = False

    def __post_init__(self):
        for name in ("steps", "group_size", "prompts_per_step", "rollout_calls",
                     "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError("--group-size must be >= 2: GRPO advantages compare samples of "
                             "a group")
        if self.prompts_per_step % self.rollout_calls:
            raise ValueError(f"--prompts-per-step ({self.prompts_per_step}) must be a multiple "
                             f"of --rollout-calls ({self.rollout_calls})")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")


def model_config(task: ReverseDigits) -> ModelConfig:
    return ModelConfig.tiny(vocab_size=task.vocab_size, max_seq_len=64)


def _lr_schedule(opts: DemoOptions):
    return optax.warmup_constant_schedule(0.0, opts.lr, opts.warmup_steps)


def _plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    for ax, key, label in zip(axes, ("reward", "cache_hit_rate", "version"),
                              ("mean reward", "prefix cache hit rate", "policy version")):
        ax.plot(steps, [r[key] for r in rows])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.suptitle("jaxrl_cache demo: GRPO on reverse-digits")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_demo(opts: DemoOptions) -> dict:
    """Runs the demo; returns the summary. Ctrl-C stops after the current step and saves."""
    task = ReverseDigits()
    config = model_config(task)
    out = pathlib.Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir, metrics_path = out / "checkpoint", out / "metrics.jsonl"
    state = TrainState.create(init_params(config, jax.random.key(opts.seed)), make_optimizer(),
                              config=config, lr_schedule=_lr_schedule(opts))
    rows = []
    if opts.resume:
        if not ckpt_dir.exists():
            raise FileNotFoundError(f"--resume: no checkpoint in {ckpt_dir}")
        state = restore_checkpoint(ckpt_dir, state)
        if metrics_path.exists():
            rows = [json.loads(line) for line in metrics_path.read_text().splitlines()
                    if json.loads(line)["step"] < int(state.version)]
    elif metrics_path.exists():
        metrics_path.unlink()
    metrics_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    start_version = int(state.version)
    engine = RolloutEngine(config, CacheConfig(num_pages=512, page_size=16),
                           backend=opts.backend, version=start_version)
    sampling = SamplingParams(n=opts.group_size, max_new_tokens=opts.max_new_tokens,
                              temperature=1.0, stop_token_ids=(EOS,))
    stop = {"requested": False}

    def on_sigint(signum, frame):
        if stop["requested"]:  # a second Ctrl-C aborts at once (the last state is still saved)
            raise KeyboardInterrupt
        stop["requested"] = True
        tqdm.write("Ctrl-C: finishing the current step, then saving (again to abort)")

    previous_handler = signal.signal(signal.SIGINT, on_sigint)
    totals = dict(generated=0, prompt=0, reused=0, cached=0, audited=0, audit_failed=0)
    t_start = time.perf_counter()
    bar = tqdm(range(start_version, opts.steps), initial=start_version, total=opts.steps,
               desc="GRPO", unit="step", dynamic_ncols=True)
    try:
        for step in bar:
            version = int(state.version)
            rng = np.random.default_rng([opts.seed, step])
            prompts = task.sample_prompts(rng, opts.prompts_per_step)
            per_call = opts.prompts_per_step // opts.rollout_calls
            t0 = time.perf_counter()
            batches = [engine.rollout(state.params, version, prompts[i:i + per_call], sampling,
                                      rng=jax.random.fold_in(jax.random.key(opts.seed),
                                                             step * 1000 + i))
                       for i in range(0, opts.prompts_per_step, per_call)]
            rollout_s = time.perf_counter() - t0
            samples = [s for b in batches for s in b.samples]
            rewards = [task.reward(s.prompt_ids, s.output_ids) for s in samples]
            audit_ok = True
            for b in batches:
                report = audit_attribution(b, {version: state.params}, config)
                totals["audited"] += report.num_samples
                totals["audit_failed"] += len(report.flagged)
                audit_ok &= report.ok
            t1 = time.perf_counter()
            state, m = train_step(state, make_batch(batches, rewards), max_policy_lag=0)
            ack = engine.sync_weights(state.params, state.version)
            train_s = time.perf_counter() - t1
            step_totals = dict(prompt=sum(b.prompt_tokens for b in batches),
                               generated=sum(b.generated_tokens for b in batches),
                               reused=sum(b.reused_tokens for b in batches),
                               cached=sum(b.cached_tokens for b in batches))
            prompt_tokens, generated = step_totals["prompt"], step_totals["generated"]
            row = dict(step=step, version=version, next_version=ack.version,
                       reward=float(np.mean(rewards)),
                       exact_match=float(np.mean([r == 1.0 for r in rewards])),
                       cache_hit_rate=step_totals["cached"] / prompt_tokens,
                       prefill_saved=step_totals["reused"] / prompt_tokens,
                       lr=float(m["lr"]), loss=float(m["loss"]),
                       clip_fraction=float(m["clip_fraction"]),
                       invalidated_pages=ack.invalidated_pages, audit_ok=audit_ok,
                       generated_tokens=generated, rollout_seconds=rollout_s,
                       train_seconds=train_s)
            rows.append(row)
            with metrics_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            for key, value in step_totals.items():
                totals[key] += value
            bar.set_postfix(v=version, reward=f"{row['reward']:.3f}",
                            hit=f"{row['cache_hit_rate']:.2f}",
                            tok_s=f"{generated / rollout_s:.0f}")
            if stop["requested"]:
                bar.write(f"interrupted: stopping after step {step} and saving")
                break
    finally:
        bar.close()
        signal.signal(signal.SIGINT, previous_handler)
        save_checkpoint(ckpt_dir, state)
        if rows:
            _plot(rows, out / "reward.png")
    window = max(1, min(10, len(rows) // 4))
    return dict(
        steps_run=int(state.version) - start_version, final_version=int(state.version),
        reward_first=float(np.mean([r["reward"] for r in rows[:window]])) if rows else 0.0,
        reward_last=float(np.mean([r["reward"] for r in rows[-window:]])) if rows else 0.0,
        generated_tokens=totals["generated"], prompt_tokens=totals["prompt"],
        prefill_tokens_saved=totals["reused"], radix_cached_tokens=totals["cached"],
        audited_samples=totals["audited"], audit_failures=totals["audit_failed"],
        seconds=time.perf_counter() - t_start, out=str(out), interrupted=stop["requested"])
