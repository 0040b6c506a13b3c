"""GRPO with this library (the README's API loop: SyncRollouts + grpo_step, every sample
audited), on the shared workload of common.py. One `STEP {json}` line per step.

    .venv/bin/python benchmarks/peers/jaxrl_grpo.py --steps 8
(thread setting: the caller's XLA_FLAGS)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

from jaxrl_cache import (CacheConfig, RolloutEngine, SamplingParams, TrainConfig,  # noqa: E402
                         TrainState, from_pretrained, load_tokenizer)
from jaxrl_cache.rl.loop import PolicyHistory, SyncRollouts, grpo_step  # noqa: E402
from jaxrl_cache.rl.train import make_optimizer  # noqa: E402


class CompileCounter(logging.Handler):
    """Counts XLA compilations (jax_log_compiles records), so a step that recompiles shows."""

    def __init__(self):
        super().__init__()
        self.names = []  # the compiled functions' names, in order

    def emit(self, record):
        if record.getMessage().startswith("Compiling"):
            self.names.append(str(record.args[0]) if record.args else "?")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    compiles = CompileCounter()
    jax.config.update("jax_log_compiles", True)
    logging.getLogger("jax").addHandler(compiles)
    logging.getLogger("jax").propagate = False
    t_load = time.perf_counter()
    config, params = from_pretrained(common.MODEL, dtype="float32")
    tok = load_tokenizer(common.MODEL)
    # HF Trainer's AdamW defaults (b2 0.999, no weight decay, grad-norm clip 1.0), constant lr
    state = TrainState.create(params, make_optimizer(b2=0.999, weight_decay=0.0,
                                                     max_grad_norm=1.0),
                              config=config, lr_schedule=optax.constant_schedule(common.LR))
    engine = RolloutEngine(config, CacheConfig(num_pages=256, page_size=16), tokenizer=tok)
    sampling = SamplingParams(n=common.GROUP, max_new_tokens=common.MAX_NEW_TOKENS,
                              temperature=common.TEMPERATURE, stop_token_ids=tok.stop_token_ids)

    def prompts(call):  # raw prompt text, no chat template (as for every peer)
        rows = common.step_examples(call)
        return [tok.encode(r["prompt"]) for r in rows], [r["answer"] for r in rows]

    def reward(answers, sample, text):
        return common.reward(text, answers[sample.group])

    rollouts = SyncRollouts(engine, prompts, sampling, calls=1,
                            key=jax.random.key(common.SEED))
    history = PolicyHistory(lag=0)
    history.add(0, state.params)
    train = TrainConfig(mini_batches=1, token_budget=4096, loss_type="dapo", donate=True)
    print(f"loaded in {time.perf_counter() - t_load:.1f} s; devices {jax.devices()}; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", file=sys.stderr)
    for step in range(args.steps):
        before = len(compiles.names)
        result = grpo_step(step, state, rollouts, reward, decode=tok.decode, history=history,
                           train=train, audit_samples=None)
        state = result.state
        r = result.record
        common.emit(step=step, seconds=r["step_seconds"], generation_seconds=r["rollout_seconds"],
                    update_seconds=r["train_seconds"], audit_seconds=r["audit_seconds"],
                    sync_seconds=r["publish_seconds"], reward=r["reward"],
                    generated_tokens=r["generated_tokens"], audited=r["audited_samples"],
                    compiles=len(compiles.names) - before, compiled=compiles.names[before:],
                    peak_rss_mib=common.peak_rss_mib())


if __name__ == "__main__":
    main()
