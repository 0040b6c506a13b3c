"""Does a short SFT warm start teach the built-in model the calculator's tool format?

The demo's own policy (ModelConfig.tiny, max_seq_len 128, char tokenizer) is trained with
`rl.sft.sft_step` (adam) on `calculator.tool_sft_pairs` (both turns of each question,
`batch` rows = batch/2 questions per step); at each checkpoint, on `eval` held-out
questions, greedy (temperature 0) through `RolloutEngine.rollout`:
- call: turn 1 is exactly `c:<left>*<right>` of the question (then <eos>);
- answer: turn 2 on the true history (question, call, <eos>, observation) is the product;
- episode: the two turns chained by hand through CalculatorEnv (turn 2 on the model's own
  turn 1 and the environment's observation): the exact match a 2-turn episode would score;
- direct: the product written as turn 1 (no tool): what the model gets without the tool.

  python -m benchmarks.calculator_sft --steps 600 --every 100 --json PATH
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_cache.app.calculator import (CalculatorEnv, CalculatorTask, parse_call,
                                        parse_question, tool_sft_pairs)
from jaxrl_cache.app.tasks import char_tokenizer
from jaxrl_cache.models import ModelConfig, init_params
from jaxrl_cache.rl.sft import pack_completions, sft_step
from jaxrl_cache.rollout import CacheConfig, RolloutEngine, SamplingParams


def greedy(engine, params, version, prompts, tokenizer, max_new_tokens):
    """Greedy turns of token-id prompts -> (output ids, decoded text) per prompt."""
    sampling = SamplingParams(n=1, max_new_tokens=max_new_tokens, temperature=0.0,
                              stop_token_ids=tokenizer.stop_token_ids)
    batch = engine.rollout(params, version, prompts, sampling, rng=jax.random.key(0))
    return [(list(s.output_ids), tokenizer.decode(s.output_ids)) for s in batch.samples]


def evaluate(engine, params, version, tokenizer, examples) -> dict:
    """The four rates of the module doc on `examples` (held-out questions); `version`
    (the SFT step) is newer than the engine's last."""
    questions = [tokenizer.encode(e.prompt) for e in examples]
    turn1 = greedy(engine, params, version, questions, tokenizer, 16)
    calls = [parse_call(text) == parse_question(e.prompt) for (_, text), e in
             zip(turn1, examples)]
    direct = [text.strip() == e.answer for (_, text), e in zip(turn1, examples)]
    true_prompts, _ = tool_sft_pairs(examples, tokenizer)
    answers = greedy(engine, params, version, true_prompts[1::2], tokenizer, 10)
    answer = [text.strip() == e.answer for (_, text), e in zip(answers, examples)]
    envs = [CalculatorEnv(e) for e in examples]
    history, waiting = {}, []
    for i, (env, (ids, text)) in enumerate(zip(envs, turn1)):
        env.reset()
        step = env.step(text)
        if not step.done:
            history[i] = questions[i] + ids + tokenizer.encode(step.observation,
                                                               add_special_tokens=False)
            waiting.append(i)
    if waiting:
        for i, (_, text) in zip(waiting, greedy(engine, params, version,
                                                [history[i] for i in waiting], tokenizer, 10)):
            envs[i].step(text)
    return dict(call=float(np.mean(calls)), answer=float(np.mean(answer)),
                episode=float(np.mean([env.reward for env in envs])),
                direct=float(np.mean(direct)))


def run(steps: int, every: int, batch: int = 32, lr: float = 5e-3, eval_count: int = 64,
        seed: int = 0) -> dict:
    tokenizer = char_tokenizer()
    config = ModelConfig.tiny(vocab_size=tokenizer.vocab_size, max_seq_len=128)
    params = init_params(config, jax.random.key(seed))
    task = CalculatorTask()
    engine = RolloutEngine(config, CacheConfig(num_pages=256, page_size=8))
    held = task.eval_examples(np.random.default_rng([seed, 2]), eval_count)
    tx = optax.adam(lr)
    opt_state = tx.init(params)
    rng = np.random.default_rng([seed, 1])
    points = [dict(step=0, loss=None, seconds=0.0,
                   **evaluate(engine, params, 0, tokenizer, held))]
    train_seconds, losses = 0.0, []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        tokens, mask = pack_completions(*tool_sft_pairs(task.sample(rng, batch // 2),
                                                        tokenizer))
        params, opt_state, loss = sft_step(params, opt_state, jnp.asarray(tokens),
                                           jnp.asarray(mask), config=config, tx=tx)
        losses.append(float(loss))
        train_seconds += time.perf_counter() - t0
        if step % every == 0 or step == steps:
            points.append(dict(step=step, loss=float(np.mean(losses[-20:])),
                               seconds=round(train_seconds, 2),
                               **evaluate(engine, params, step, tokenizer, held)))
            print(json.dumps(points[-1]), flush=True)
    return dict(batch_rows=batch, lr=lr, eval_questions=eval_count, seed=seed,
                points=points)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--eval", type=int, default=64)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    load = os.getloadavg()
    runs = [run(args.steps, args.every, args.batch, args.lr, args.eval, seed)
            for seed in args.seeds]
    report = dict(date="2026-12-01", machine="CPU, 2 cores, shared",
                  threads="XLA defaults", load_average_start=load,
                  load_average_end=os.getloadavg(), runs=runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
