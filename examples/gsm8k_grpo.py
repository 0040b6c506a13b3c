"""GRPO on GSM8K-style math word problems, on the public API: rows -> prompts, a numeric
answer reward plus a small format reward, every sample audited, health metrics to
TensorBoard and CSV, held-out evaluation every few steps, checkpoints, and an HF export.

    python examples/gsm8k_grpo.py --model ~/.cache/jaxrl_cache/SmolLM2-135M-Instruct \
        --data examples/data/gsm8k_format.jsonl --steps 20 --out runs/gsm8k

--data takes any JSONL (or JSON list) of GSM8K rows (`question`, and `answer` ending in
`#### N`). The full data set: `datasets.load_dataset("openai/gsm8k", "main")["train"]
.to_json("gsm8k_train.jsonl")`, then `--data gsm8k_train.jsonl` (or pass the Dataset itself
to `prompts_from_rows`). Without --model the demo's tiny built-in model runs (what the test
does: it only shows the plumbing, it learns nothing).
"""
from __future__ import annotations

import argparse
import pathlib
import re

import jax
import numpy as np
import optax

from jaxrl_cache import (CacheConfig, PolicyHistory, RewardFn, Rewards, RolloutEngine,
                         SamplingParams, SyncRollouts, TrainConfig, TrainState, answer_score,
                         evaluate, from_pretrained, grpo_step, load_tokenizer, make_sinks,
                         prompts_from_rows, read_rows, save_checkpoint, save_pretrained)

SYSTEM = "Solve the problem. Reason briefly, then end with '#### <number>'."


def load_model(model: str | None, out: pathlib.Path):
    """(config, params, tokenizer) of an HF directory, or of the demo's built-in model."""
    if model is None:
        from jaxrl_cache.app.demo import builtin_model_config
        from jaxrl_cache.app.tasks import char_tokenizer
        from jaxrl_cache.models import init_params
        tok = char_tokenizer()
        config = builtin_model_config(tok.vocab_size)
        model = save_pretrained(out / "base_model", config,
                                init_params(config, jax.random.key(0)), tokenizer=tok)
    config, params = from_pretrained(model, dtype="float32")
    return config, params, load_tokenizer(model)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF directory (default: the demo's built-in model)")
    p.add_argument("--data", default=str(pathlib.Path(__file__).parent
                                         / "data/gsm8k_format.jsonl"))
    p.add_argument("--out", default="runs/gsm8k")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-prompts", type=int, default=4, help="held out from the end")
    p.add_argument("--lr", type=float, default=1e-6)
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    config, params, tok = load_model(args.model, out)

    # Rows -> prompts: chat messages when the model has a chat template, else plain text.
    rows, _ = read_rows(args.data)
    chat = tok.chat_template is not None
    examples = prompts_from_rows(rows, prompt_key="question", answer_key="answer",
                                 system_prompt=SYSTEM if chat else None)
    train, held_out = examples[:-args.eval_prompts], examples[-args.eval_prompts:]

    def prompts(call: int):  # call c -> (prompts, what the rewards need)
        rng = np.random.default_rng(call)
        picked = [train[i] for i in rng.choice(len(train), args.prompts_per_step)]
        return [e.prompt for e in picked], picked

    def correct(picked, sample, text) -> float:  # the answer after '####', as a number
        return answer_score(text, picked[sample.group].answer, check="numeric")

    def formatted(picked, sample, text) -> float:  # ends with '#### <number>'
        return float(re.search(r"####\s*-?[\d,.]+\s*$", text) is not None)

    rewards = Rewards((RewardFn(correct, name="correct"),
                       RewardFn(formatted, weight=0.1, name="format")))

    state = TrainState.create(params, config=config, lr_schedule=optax.constant_schedule(args.lr))
    engine = RolloutEngine(config, CacheConfig(num_pages=2048, page_size=16), tokenizer=tok)
    sampling = SamplingParams(n=args.group_size, max_new_tokens=args.max_new_tokens,
                              temperature=1.0, stop_token_ids=tok.stop_token_ids)
    rollouts = SyncRollouts(engine, prompts, sampling, calls=1, key=jax.random.key(0))
    history = PolicyHistory(lag=0)  # the params each sample is audited against
    sinks = make_sinks("tensorboard,csv", out)
    record = {}
    try:
        for step in range(args.steps):
            result = grpo_step(step, state, rollouts, rewards, decode=tok.decode,
                               history=history, train=TrainConfig(donate=True))
            state, record = result.state, dict(result.record)
            if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
                scores = evaluate(engine, state.params, int(state.version),
                                  [e.prompt for e in held_out],
                                  lambda i, s, text: answer_score(
                                      text, held_out[i].answer, check="numeric") == 1.0,
                                  sampling, rng=jax.random.key(10_000 + step), k=4)
                record.update({f"eval/{k}": v for k, v in scores.items()})
            sinks.write(step, record)
            print(f"step {step:3d} v{int(state.version)} reward {record['reward']:.3f} "
                  f"(std {record['reward_std']:.3f}, flat groups {record['zero_std_groups']:.0%}) "
                  f"len {record['completion_length_mean']:.1f} "
                  f"audited {record['audited_samples']}"
                  + "".join(f" {k} {v:.3f}" for k, v in record.items()
                            if k.startswith("eval/") and k not in ("eval/seconds", "eval/samples")))
    finally:
        sinks.close()
    save_checkpoint(out / "checkpoints", state)  # orbax step = the policy version
    save_pretrained(out / "policy", config, state.params, tokenizer=tok)  # for HF / vLLM
    return record


if __name__ == "__main__":
    main()
