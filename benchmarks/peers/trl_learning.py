"""TRL's GRPOTrainer learning the add task on SmolLM2-135M-Instruct, for the side-by-side
with this library's CLI (benchmarks/real_model_vs_trl.py, issue 60). Run by that script in
the torch venv (torch 2.13.0 CPU, transformers, trl, datasets), one seed per process:

    /work/torchvenv/bin/python benchmarks/peers/trl_learning.py PLAN.json

PLAN.json (written by the parent from jaxrl_cache's own DatasetTask, so both systems see the
same rows): model, seed, steps, group, max_new_tokens, lr, warmup_steps, temperature,
adam_b2, eval_every, threads, "train" (per step, its prompts_per_step {"prompt", "answer"}
rows: the CLI's draws) and "eval" (the CLI's held-out eval prompts, in its order).

Training: chat prompts (one user message, the model's template), the CLI's reward (last
match of (-?\\d+) equal to the answer as a number), one AdamW update per step over the
prompts x group samples, beta 0, num_iterations 1, loss "dapo", constant lr after
warmup_steps linear steps from 0 (HF's constant_with_warmup: lr 0 at the first update when
1, as the CLI's `--warmup-steps 0` gives), max grad norm 1, weight decay 0, Adam b2 as the
CLI's, float32 throughout as the CLI (bf16=False: GRPOConfig's default is bf16 autocast,
which on this CPU put the loss's log-probs up to 0.22 nats away from generate's). Eval
(before training and every eval_every steps): one sample per eval prompt at the training
temperature (top-k/top-p off), max_new_tokens, exact match under the same reward; its RNG
is forked and seeded the same way each time, so training's sampling does not see it.

Sampler/trainer mismatch: TRL (transformers generate, num_iterations 1) takes the trainer's
own log-probs as the behavior ones (importance ratio 1 by construction) and records none
from the sampler. This script asks generate for its raw logits (output_logits), takes each
sampled token's log-softmax (temperature 1: the sampling distribution) and compares it with
the log-prob the loss used for the same token: |sampler - trainer|, max and mean over the
step's completion tokens. The loss never sees this gap.

Output: `STEP {json}` per optimizer step, `EVAL {json}` per eval, on stdout.
"""
from __future__ import annotations

import json
import re
import sys
import tempfile
import time

import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

INT = re.compile(r"(-?\d+)")


def reward(text: str, answer: str) -> float:
    """The CLI's `--answer-regex '(-?\\d+)'` numeric check, for integer answers."""
    found = INT.findall(text)
    return float(bool(found) and int(found[-1]) == int(str(answer).strip()))


def emit(kind: str, **row) -> None:
    print(f"{kind} " + json.dumps(row), flush=True)


class Mismatch:
    """Sampled tokens' log-probs from generate (keyed by prompt + completion tokens) and
    their gap to the loss's log-probs of the same tokens."""

    def __init__(self, eos_ids: list[int], temperature: float):
        self.eos, self.temperature = set(eos_ids), temperature
        self.on, self.sampled, self.gaps = False, {}, []

    @staticmethod
    def key(prompt: list[int], completion: list[int]) -> tuple:
        return tuple(prompt) + (-1,) + tuple(completion)

    def wrap_generate(self, model) -> None:
        original = model.generate

        def generate(*args, **kw):
            if not self.on:
                return original(*args, **kw)
            out = original(*args, **{**kw, "return_dict_in_generate": True,
                                     "output_logits": True})
            ids, mask = kw["input_ids"], kw["attention_mask"]
            completion = out.sequences[:, ids.shape[1]:]
            logps = torch.log_softmax(torch.stack(out.logits, 1).float() / self.temperature, -1)
            token_logps = logps.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
            for i in range(ids.shape[0]):
                tokens = completion[i].tolist()
                n = next((j + 1 for j, t in enumerate(tokens) if t in self.eos), len(tokens))
                key = self.key(ids[i][mask[i].bool()].tolist(), tokens[:n])
                self.sampled.setdefault(key, []).append(token_logps[i, :n].detach().clone())
            return out.sequences

        model.generate = generate

    def wrap_logps(self, trainer) -> None:
        original = trainer._get_per_token_logps_and_entropies

        def logps(model, input_ids, attention_mask, logits_to_keep, *args, **kw):
            out = original(model, input_ids, attention_mask, logits_to_keep, *args, **kw)
            if self.on and model.training:
                per_token = out[0].detach()
                for i in range(input_ids.shape[0]):
                    prompt = input_ids[i, :-logits_to_keep][
                        attention_mask[i, :-logits_to_keep].bool()].tolist()
                    n = int(attention_mask[i, -logits_to_keep:].sum())
                    key = self.key(prompt, input_ids[i, -logits_to_keep:][:n].tolist())
                    if self.sampled.get(key):
                        sampled = self.sampled[key].pop()
                        self.gaps.append((per_token[i, :n] - sampled).abs())
            return out

        trainer._get_per_token_logps_and_entropies = logps

    def take(self) -> dict:
        """The step's max and mean gap and how many tokens; resets."""
        gaps = torch.cat(self.gaps) if self.gaps else torch.zeros(0)
        out = dict(logprob_mismatch_max=float(gaps.max()) if gaps.numel() else None,
                   logprob_mismatch_mean=float(gaps.mean()) if gaps.numel() else None,
                   mismatch_tokens=int(gaps.numel()))
        self.sampled, self.gaps = {}, []
        return out


class Progress(TrainerCallback):
    """Per step: mean reward of its samples, its mismatch, TRL's own logged metrics; evals
    before training and every eval_every steps."""

    def __init__(self, plan: dict, tokenizer, mismatch: Mismatch):
        self.plan, self.tok, self.mismatch = plan, tokenizer, mismatch
        self.rewards, self.logs, self.t0 = [], {}, 0.0

    def evaluate(self, model, step: int) -> None:
        rows = self.plan["eval"]
        texts = [self.tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                              add_generation_prompt=True, tokenize=False)
                 for r in rows]
        batch = self.tok(texts, return_tensors="pt", padding=True, padding_side="left",
                         add_special_tokens=False)
        was_training, on = model.training, self.mismatch.on
        self.mismatch.on = False
        model.eval()
        t0 = time.perf_counter()
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(10_000 + self.plan["seed"])  # the same draws at every eval
            out = model.generate(**batch, do_sample=True, temperature=self.plan["temperature"],
                                 top_k=0, top_p=1.0, max_new_tokens=self.plan["max_new_tokens"],
                                 pad_token_id=self.tok.pad_token_id, use_cache=True,
                                 eos_token_id=self.plan["eos_token_ids"])
        completions = self.tok.batch_decode(out[:, batch["input_ids"].shape[1]:],
                                            skip_special_tokens=True)
        correct = [reward(c, r["answer"]) for c, r in zip(completions, rows)]
        model.train(was_training)
        self.mismatch.on = on
        emit("EVAL", step=step, exact_match=sum(correct) / len(correct),
             seconds=time.perf_counter() - t0, sample=completions[0])

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.evaluate(model, 0)
        self.mismatch.on = True

    def on_step_begin(self, args, state, control, **kw):
        self.rewards, self.logs, self.t0 = [], {}, time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.update(logs or {})

    def on_step_end(self, args, state, control, model=None, **kw):
        emit("STEP", step=state.global_step, reward=sum(self.rewards) / max(len(self.rewards), 1),
             samples=len(self.rewards), seconds=time.perf_counter() - self.t0,
             **self.mismatch.take())
        every = self.plan["eval_every"]
        if every and state.global_step % every == 0 or state.global_step == self.plan["steps"]:
            self.evaluate(model, state.global_step)

    def on_train_end(self, args, state, control, **kw):
        emit("TRL_LOGS", **{k: v for k, v in self.logs.items() if isinstance(v, (int, float))})


def main() -> None:
    plan = json.loads(open(sys.argv[1]).read())
    torch.set_num_threads(plan["threads"])
    group, steps = plan["group"], plan["steps"]
    train = [row for step in plan["train"][:steps] for row in step]  # step s: its rows
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                               "answer": str(r["answer"])} for r in train])
    tokenizer = AutoTokenizer.from_pretrained(plan["model"])
    plan["eos_token_ids"] = [tokenizer.eos_token_id]
    mismatch = Mismatch(plan["eos_token_ids"], plan["temperature"])
    progress = Progress(plan, tokenizer, mismatch)

    def reward_fn(prompts, completions, answer, **kw):  # chat prompts -> [assistant message]
        out = [reward(c[0]["content"], a) for c, a in zip(completions, answer)]
        progress.rewards.extend(out)
        return out

    batch = len(plan["train"][0]) * group
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_learning_"), max_steps=steps,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        generation_batch_size=batch, num_generations=group,
        max_completion_length=plan["max_new_tokens"], temperature=plan["temperature"],
        top_k=0, top_p=1.0, learning_rate=plan["lr"],
        lr_scheduler_type="constant_with_warmup" if plan["warmup_steps"] else "constant",
        warmup_steps=plan["warmup_steps"], adam_beta2=plan["adam_b2"], weight_decay=0.0,
        max_grad_norm=1.0, num_iterations=1, beta=0.0, loss_type="dapo", shuffle_dataset=False,
        gradient_checkpointing=False, use_cpu=True, bf16=False, logging_steps=1,
        eval_strategy="no", save_strategy="no", report_to="none", seed=plan["seed"],
        model_init_kwargs={"dtype": torch.float32})
    trainer = GRPOTrainer(model=plan["model"], reward_funcs=reward_fn, args=config,
                          train_dataset=data, processing_class=tokenizer, callbacks=[progress])
    mismatch.wrap_generate(trainer.model)
    mismatch.wrap_logps(trainer)
    import transformers
    import trl
    print(f"torch {torch.__version__} transformers {transformers.__version__} trl "
          f"{trl.__version__} threads {torch.get_num_threads()} seed {plan['seed']}",
          file=sys.stderr, flush=True)
    trainer.train()


if __name__ == "__main__":
    main()
