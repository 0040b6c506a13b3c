"""Rollouts with the engine's decode transposes (`models.llama.sampler_layout`) against the
same engine without them (the stacked [in, out] weights alone, padded to `invariant_rows`),
in one process, alternated call by call, so the VM's drift hits both alike. Each call is a
new version (a sync, its transposes included, then the rollout). Prints wall and CPU
seconds per call and whether both produced the same tokens and log-prob bits.

    .venv/bin/python benchmarks/rollout_layout_ab.py --prompts 2 --new 24 --calls 6
    .venv/bin/python benchmarks/rollout_layout_ab.py --prompts 8 --new 128 --calls 3
(SmolLM2-135M-Instruct fp32 from ~/.cache/jaxrl_cache, chat prompts, n = 8, temperature 1.)
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

from jaxrl_cache.models import from_pretrained, load_tokenizer
from jaxrl_cache.rollout import CacheConfig, RolloutEngine
from jaxrl_cache.rollout import engine as engine_module
from jaxrl_cache.rollout.sampling import SamplingParams

MODEL = os.path.expanduser("~/.cache/jaxrl_cache/SmolLM2-135M-Instruct")
SUMS = [(12, 7), (3, 44), (120, 5), (8, 8), (31, 9), (2, 77), (15, 15), (60, 1)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--new", type=int, default=24)
    p.add_argument("--calls", type=int, default=6)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    config, params = from_pretrained(MODEL, dtype="float32")
    tokenizer = load_tokenizer(MODEL)
    prompts = [list(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"What is {a} + {b}?"}], add_generation_prompt=True))
        for a, b in SUMS[:args.prompts]]
    sampling = SamplingParams(n=8, max_new_tokens=args.new, temperature=1.0)
    layouts = {"transposes": engine_module.sampler_layout, "stacked": lambda tree: tree}
    engines = {name: RolloutEngine(config, CacheConfig(num_pages=64 * 14 + 64, page_size=16),
                                   backend="xla") for name in layouts}
    versions = dict.fromkeys(layouts, 0)
    last = {}

    def call(name):
        engine_module.sampler_layout = layouts[name]
        versions[name] += 1
        wall, cpu = time.perf_counter(), time.process_time()
        last[name] = engines[name].rollout(params, versions[name], prompts, sampling,
                                           rng=jax.random.key(versions[name]))
        return time.perf_counter() - wall, time.process_time() - cpu

    try:
        for name in layouts:
            print(f"{name}: first call (compiles) {call(name)[0]:.1f} s", flush=True)
        times = {name: [] for name in layouts}
        for i in range(args.calls):
            for name in (list(layouts) if i % 2 == 0 else list(layouts)[::-1]):
                times[name].append(call(name))
    finally:
        engine_module.sampler_layout = layouts["transposes"]
    same = all(a.output_ids == b.output_ids and np.array_equal(a.output_logprobs,
                                                               b.output_logprobs)
               for a, b in zip(last["transposes"].samples, last["stacked"].samples))
    out = {"prompts": args.prompts, "new_tokens": args.new, "same_bits": same}
    for name, ts in times.items():
        ts = np.array(ts)
        out[name] = dict(wall=ts[:, 0].round(3).tolist(), cpu=ts[:, 1].round(3).tolist(),
                         wall_median=float(np.median(ts[:, 0])),
                         cpu_median=float(np.median(ts[:, 1])))
        print(f"{name}: wall median {np.median(ts[:, 0]):.2f} s, cpu median "
              f"{np.median(ts[:, 1]):.2f} s ({' '.join(f'{t:.2f}' for t in ts[:, 0])})")
    print(f"same tokens and log-prob bits: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
