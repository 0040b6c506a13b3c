"""Rollout throughput on the real model against transformers `generate`, timed interleaved.

SmolLM2-135M-Instruct (scripts/fetch_smollm2.py), fp32, CPU. 8 chat prompts x n=8 samples,
64 new tokens each (no stop: every sample has exactly 64, so both sides do the same work),
temperature 1, no top-k / top-p. Two workloads: the chat prompts as the template writes them
("chat", its default short system prompt), and the same prompts behind one shared long
system prompt ("system"). Sides, one call of each per round in turn:
  transformers `generate` (num_return_sequences=8, left padding) at torch 1 and 2 threads;
  this engine with prefix reuse (the 8 samples of a prompt, and prompts among themselves,
  share prefix pages) and without (CacheConfig(prefix_cache=False): every sample prefills
  its own prompt). XLA's CPU client uses every core of the process (2 here) unless
  XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" (recorded).
Each engine call runs at a new version, so it starts from an empty prefix cache: only reuse
inside one call counts, as in GRPO where every step has new weights. The first call of each
engine is a warm-up (compile) and is not timed. Reported: fastest seconds per side, tokens
per second (generated tokens / s) and the ratios engine / transformers.

    /work/torchvenv/bin/python -m benchmarks.rollout_vs_transformers [--model DIR]
        [--rounds 2] [--workloads chat,system] [--json PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform

import jax
import numpy as np

from benchmarks.timing import best_interleaved

PROMPTS, GROUP, NEW = 8, 8, 64
QUESTIONS = (
    "What is 12 * 7?", "Name three primary colours.", "Write a haiku about autumn.",
    "Explain what a prime number is.", "How many legs does a spider have?",
    "Give me a synonym for 'happy'.", "What is the capital of France?",
    "Summarise the water cycle in one sentence.")
SYSTEM = (  # a realistic agent-style system prompt, shared by every prompt of the workload
    "You are a careful assistant that solves problems step by step. Follow these rules. "
    "First, restate the question in your own words so that the reader can check that you "
    "understood it. Second, list the facts you know that are relevant, one per line, and "
    "mark any fact you are not sure about. Third, work through the problem in small steps, "
    "showing every intermediate result; when you do arithmetic, write each operation and "
    "its result explicitly, and check multiplication by estimating the order of magnitude. "
    "Fourth, if a tool is available, call it by writing the expression between the tags "
    "<calc> and </calc>, then wait for the result before you continue. Fifth, give the "
    "final answer on its own line, starting with 'Answer:'. Keep the answer short. If the "
    "question is ambiguous, say which reading you chose and why. If the question cannot be "
    "answered, say so plainly and explain what information is missing. Never invent "
    "citations, numbers or names. Use plain language, avoid jargon unless the user used it "
    "first, and prefer short sentences. When you list items, use at most five. When the "
    "user asks for code, write complete, runnable code with a one-line comment on what it "
    "does, and mention any assumption about the environment. When the user asks for an "
    "opinion, give a balanced view with the strongest argument on each side. Be polite, "
    "but do not apologise unless you made a mistake.")


def chat_prompts(tokenizer, system: bool) -> list[list[int]]:
    """Token ids of the 8 prompts through the model's chat template."""
    out = []
    for q in QUESTIONS[:PROMPTS]:
        messages = ([{"role": "system", "content": SYSTEM}] if system else []) + [
            {"role": "user", "content": q}]
        out.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)))
    return out


def main(argv=None) -> dict:
    import torch
    import transformers as tf

    from jaxrl_cache.models import from_pretrained, load_tokenizer
    from jaxrl_cache.rollout import CacheConfig, RolloutEngine, SchedulerConfig
    from jaxrl_cache.rollout.sampling import SamplingParams

    default = pathlib.Path(os.environ.get(
        "JAXRL_SMOLLM2_DIR", pathlib.Path.home() / ".cache/jaxrl_cache/SmolLM2-135M-Instruct"))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=pathlib.Path, default=default)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workloads", default="chat,system")
    p.add_argument("--json", type=pathlib.Path)
    args = p.parse_args(argv)
    if not (args.model / "config.json").exists():
        raise SystemExit(f"{args.model} has no config.json: run scripts/fetch_smollm2.py first")

    config, params = from_pretrained(args.model, dtype="float32")
    tokenizer = load_tokenizer(args.model)
    model = tf.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    sampling = SamplingParams(n=GROUP, max_new_tokens=NEW, temperature=1.0)
    version = iter(range(1, 1_000_000))

    def engine_run(prompts, prefix_cache: bool):
        longest = max(map(len, prompts)) + NEW
        pages = PROMPTS * GROUP * (-(-longest // 16)) + 64
        engine = RolloutEngine(config, CacheConfig(num_pages=pages, page_size=16,
                                                   prefix_cache=prefix_cache),
                               scheduler_config=SchedulerConfig(max_num_seqs=PROMPTS * GROUP),
                               backend="xla")
        stats = {}

        def run():
            v = next(version)
            batch = engine.rollout(params, v, prompts, sampling, rng=jax.random.key(v))
            assert all(len(s.output_ids) == NEW for s in batch.samples)
            stats.update(prompt_tokens=batch.prompt_tokens, reused_tokens=batch.reused_tokens)
        run()  # compile
        return run, stats

    def hf_run(prompts, threads: int):
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(q)) + q for q in prompts])
        mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in prompts])

        def run():
            torch.set_num_threads(threads)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, do_sample=True,
                                     temperature=1.0, top_k=0, top_p=1.0,
                                     num_return_sequences=GROUP, max_new_tokens=NEW,
                                     min_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
            assert out.shape == (PROMPTS * GROUP, width + NEW)
        return run

    results = {}
    for workload in args.workloads.split(","):
        prompts = chat_prompts(tokenizer, system=workload == "system")
        reuse, reuse_stats = engine_run(prompts, True)
        no_reuse, _ = engine_run(prompts, False)
        runs = {"transformers_1_thread": hf_run(prompts, 1),
                "transformers_2_threads": hf_run(prompts, 2),
                "engine_prefix_reuse": reuse, "engine_no_reuse": no_reuse}
        best = best_interleaved(runs, args.rounds)
        tokens = PROMPTS * GROUP * NEW
        fastest_hf = min(best["transformers_1_thread"], best["transformers_2_threads"])
        results[workload] = dict(
            prompt_lengths=[len(q) for q in prompts], generated_tokens=tokens,
            seconds={k: round(v, 2) for k, v in best.items()},
            tokens_per_second={k: round(tokens / v, 1) for k, v in best.items()},
            speedup_no_reuse=round(fastest_hf / best["engine_no_reuse"], 2),
            speedup_prefix_reuse=round(fastest_hf / best["engine_prefix_reuse"], 2),
            engine_reused_prompt_fraction=round(
                reuse_stats["reused_tokens"] / max(reuse_stats["prompt_tokens"], 1), 3),
            load_after=[round(x, 2) for x in os.getloadavg()])
        print(workload, json.dumps(results[workload]), flush=True)
    out = dict(benchmark="rollout_vs_transformers", date=str(datetime.date.today()),
               machine=f"CPU, {len(os.sched_getaffinity(0))} cores, shared",
               python=platform.python_version(), jax=jax.__version__,
               torch=torch.__version__, transformers=tf.__version__,
               xla_flags=os.environ.get("XLA_FLAGS", ""),
               model=args.model.name, prompts=PROMPTS, group=GROUP, new_tokens=NEW,
               rounds=args.rounds, note="fastest of the rounds; ratios use the faster "
               "transformers thread setting", results=results)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
