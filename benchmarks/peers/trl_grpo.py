"""GRPO with TRL's GRPOTrainer (transformers generate, torch on CPU) on the shared workload
of common.py. One `STEP {json}` line per optimizer step. Benchmark-only dependency:

    /work/torchvenv/bin/pip install trl datasets     # keep torch as it is (pip list | grep torch)
    /work/torchvenv/bin/python benchmarks/peers/trl_grpo.py --steps 8 --threads 1 \
        [--shape 2x8x24] [--bf16] [--no-gradient-checkpointing] [--save]

`PHASE {json}` lines on stderr around the model load, each step and (--save) the final
`trainer.save_model`, the analogue of this library's export.

Prompts are conversational (common.messages), so TRL applies the model's chat template, as
the CLI of this library does. --bf16: HF Trainer's bf16 (autocast on CPU: AMX matmuls).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402


class StepTimer(TrainerCallback):
    """Wall seconds of each optimizer step; generation seconds come from the wrapped
    `_generate_and_score_completions` (sampling + reward; no old/ref log-probs at
    num_iterations 1, beta 0)."""

    def __init__(self, trainer_box: list):
        self.box, self.t0, self.gen, self.rewards = trainer_box, 0.0, 0.0, []

    def on_step_begin(self, args, state, control, **kw):
        common.phase(f"step {state.global_step}", "start")
        self.t0, self.gen, self.rewards = time.perf_counter(), 0.0, []

    def on_step_end(self, args, state, control, **kw):
        seconds = time.perf_counter() - self.t0
        common.emit(step=state.global_step - 1, seconds=seconds, generation_seconds=self.gen,
                    update_seconds=seconds - self.gen,
                    reward=sum(self.rewards) / max(len(self.rewards), 1),
                    samples=len(self.rewards), peak_rss_mib=common.peak_rss_mib())
        common.phase(f"step {state.global_step - 1}", "end")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--shape", default=common.SHAPES[0], help="prompts x group x new tokens")
    p.add_argument("--save", action="store_true", help="trainer.save_model() after training")
    args = p.parse_args()
    common.set_shape(args.shape)
    torch.set_num_threads(args.threads)
    torch.manual_seed(common.SEED)
    rows = common.examples()
    data = Dataset.from_list([{"prompt": common.messages(r["prompt"]), "answer": r["answer"]}
                              for r in rows])
    timer = StepTimer([])

    def reward(prompts, completions, answer, **kw):  # chat prompts -> [assistant message]
        out = [common.reward(c[0]["content"], a) for c, a in zip(completions, answer)]
        timer.rewards.extend(out)
        return out

    batch = common.PROMPTS_PER_STEP * common.GROUP
    out = tempfile.mkdtemp(prefix="trl_grpo_")
    config = GRPOConfig(
        output_dir=out, max_steps=args.steps,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        generation_batch_size=batch, num_generations=common.GROUP,
        max_completion_length=common.MAX_NEW_TOKENS, temperature=common.TEMPERATURE,
        learning_rate=common.LR, lr_scheduler_type="constant", warmup_steps=0,
        num_iterations=1, beta=0.0, loss_type="dapo", shuffle_dataset=False,
        gradient_checkpointing=not args.no_gradient_checkpointing, use_cpu=True, bf16=args.bf16,
        logging_steps=1, eval_strategy="no", save_strategy="no", report_to="none",
        seed=common.SEED, model_init_kwargs={"dtype": torch.float32})
    common.phase("load", "start")
    trainer = GRPOTrainer(model=common.MODEL, reward_funcs=reward, args=config,
                          train_dataset=data, callbacks=[timer])
    common.phase("load", "end")
    generate = trainer._generate_and_score_completions

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        out = generate(*a, **kw)
        timer.gen += time.perf_counter() - t0
        return out

    trainer._generate_and_score_completions = timed_generate
    print(f"torch {torch.__version__} threads {torch.get_num_threads()}; gradient "
          f"checkpointing {config.gradient_checkpointing}; bf16 {config.bf16}; optim "
          f"{config.optim}; shape {args.shape}", file=sys.stderr)
    try:
        trainer.train()
        if args.save:
            common.phased("export", trainer.save_model)()
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
