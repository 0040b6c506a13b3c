"""GRPO with this library through the path users run: `jaxrl-cache grpo --model ... --dataset
...` (the CLI, chat template on, default settings), in this process so each step's compiles
are counted. One `STEP {json}` line per GRPO step (the demo's own metrics row), and `PHASE
{json}` lines on stderr around its phases (load, each eval, step and checkpoint, export).

    .venv/bin/python benchmarks/peers/jaxrl_grpo.py --steps 8 --shape 2x8x24
    .venv/bin/python benchmarks/peers/jaxrl_grpo.py --steps 8 --shape 2x8x24 \
        --lora-rank 16 --lora-alpha 32 --lora-targets all-linear   # other demo flags: passed on
(thread setting: the caller's XLA_FLAGS). The demo's one-off work (model load, the eval
before and after, the final checkpoint and export) is outside the steps."""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

import jax  # noqa: E402

from jaxrl_cache.app import cli, demo  # noqa: E402


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
    p.add_argument("--shape", default=common.SHAPES[0], help="prompts x group x new tokens")
    args, demo_flags = p.parse_known_args()  # the rest go to `jaxrl-cache demo` as given
    common.set_shape(args.shape)
    compiles = CompileCounter()
    jax.config.update("jax_log_compiles", True)
    logging.getLogger("jax").addHandler(compiles)
    logging.getLogger("jax").propagate = False
    grpo_step = demo.grpo_step
    steps_run = []

    def timed_step(step, *a, **kw):  # the demo's own step, its record re-emitted
        steps_run.append(step)
        before, cpu = len(compiles.names), common.cpu_seconds()
        result = grpo_step(step, *a, **kw)
        r = result.record
        common.emit(step=step, seconds=r["step_seconds"], generation_seconds=r["rollout_seconds"],
                    cpu_seconds=common.cpu_seconds() - cpu,  # every thread of the process
                    update_seconds=r["train_seconds"], audit_seconds=r["audit_seconds"],
                    sync_seconds=r["publish_seconds"], weight_sync_seconds=r["sync_seconds"],
                    sync_bytes=r["sync_bytes"], reward=r["reward"],
                    generated_tokens=r["generated_tokens"], audited=r["audited_samples"],
                    logprob_mismatch_max=r["logprob_mismatch_max"],
                    compiles=len(compiles.names) - before, compiled=compiles.names[before:],
                    peak_rss_mib=common.peak_rss_mib())
        return result

    demo.grpo_step = common.phased(lambda step, *a, **kw: f"step {step}", timed_step)
    demo._load_policy = common.phased("load", demo._load_policy)
    demo._evaluate = common.phased(lambda *a, **kw: "eval after" if steps_run
                                   else "eval before", demo._evaluate)
    demo.save_checkpoint = common.phased(lambda d, state, **kw: f"checkpoint "
                                         f"{int(state.version)}", demo.save_checkpoint)
    demo._export = common.phased("export", demo._export)
    out = tempfile.mkdtemp(prefix="jaxrl_grpo_")
    argv = ["grpo", "--model", common.MODEL, "--dataset", str(common.TASK),
            "--answer-regex", r"(-?\d+)", "--steps", str(args.steps),
            "--prompts-per-step", str(common.PROMPTS_PER_STEP),
            "--group-size", str(common.GROUP), "--max-new-tokens", str(common.MAX_NEW_TOKENS),
            "--temperature", str(common.TEMPERATURE), "--lr", str(common.LR),
            "--warmup-steps", "0", "--seed", str(common.SEED), "--eval-prompts", "2",
            "--checkpoint-every", str(args.steps + 1), "--out", out, *demo_flags]
    print("jaxrl-cache " + " ".join(argv), file=sys.stderr, flush=True)
    try:
        code = cli.main(argv)
    finally:  # the run directory (checkpoints, export: ~2.3 GB on SmolLM2) is not kept
        shutil.rmtree(out, ignore_errors=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
