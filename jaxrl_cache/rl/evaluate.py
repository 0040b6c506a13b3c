"""`evaluate`: score a policy version on held-out prompts (sampled and/or greedy, pass@k),
with any engine that has `rollout` (and `rollout_episodes` for environments); nothing is
trained. rl imports no engine: the caller passes one (docs/DESIGN.md).

Metric names (a caller logs them as it likes; the demo prefixes "eval/"):
  exact_match         the fraction of right completions among k per prompt (sampled with
                      the caller's SamplingParams; k = 1: one sample per prompt)
  pass@K              (K = k > 1) the fraction of prompts with at least one right completion
                      of their k (the unbiased pass@k estimate with n = k samples)
  greedy_exact_match  (greedy=True) the fraction of prompts whose one temperature-0
                      completion is right
  samples, seconds    completions scored, wall time of the evaluation
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from jaxrl_cache.checks import as_count
from jaxrl_cache.rollout.sampling import SamplingParams


def evaluate(engine, params, version: int, prompts: Sequence, correct: Callable,
             sampling: SamplingParams, *, rng, k: int = 1, greedy: bool = False,
             decode: Callable | None = None, episodes: dict | None = None) -> dict:
    """The metrics of the module doc for `prompts` under the params of `version`.

    correct(i, sample, text) -> bool: whether a completion of prompts[i] is right (sample:
    a Sample, or an Episode with `episodes`; text: the sample's text, `decode(output_ids)`
    when it has none, or the episode's turns joined). episodes: keyword arguments of
    `engine.rollout_episodes` (env_factory, max_turns, ...): the prompts are then tasks.

    Invariants: one rollout call for the sampled completions (`sampling` with n = k) and one
    for the greedy ones, both at `version` (the engine's version rules apply); completions
    are matched to prompts by their group, so correct(i, ...) only sees completions of
    prompts[i]; the same engine inputs and rng give the same numbers; no params change."""
    k = as_count(k, "k", minimum=1)
    if not len(prompts):
        raise ValueError("evaluate needs at least one prompt")
    start = time.perf_counter()
    call = dict(engine=engine, params=params, version=version, prompts=prompts,
                correct=correct, rng=rng, decode=decode, episodes=episodes)
    right = _rights(sampling=dataclasses.replace(sampling, n=k), **call)
    out = {"exact_match": float(right.mean())}
    if k > 1:
        out[f"pass@{k}"] = float(right.any(axis=1).mean())
    samples = right.size
    if greedy:
        plain = dataclasses.replace(sampling, n=1, temperature=0.0, top_p=1.0, top_k=0)
        greedy_right = _rights(sampling=plain, **call)
        out["greedy_exact_match"] = float(greedy_right.mean())
        samples += greedy_right.size
    out.update(samples=samples, seconds=time.perf_counter() - start)
    return out


def _rights(*, engine, params, version, prompts, correct, sampling, rng, decode,
            episodes) -> np.ndarray:
    """bool [prompts, sampling.n]: correct() of each completion of one rollout call."""
    args = (params, int(version), list(prompts))
    if episodes is None:
        items = engine.rollout(*args, sampling, rng=rng).samples
    else:
        items = engine.rollout_episodes(*args, sampling=sampling, rng=rng,
                                        **episodes).episodes
    right = np.zeros((len(prompts), sampling.n), bool)
    filled = np.zeros(len(prompts), int)
    for item in items:
        if episodes is not None:
            text = "".join(item.turn_texts)
        elif item.text is not None:
            text = item.text
        elif decode is not None:
            text = decode(item.output_ids)
        else:
            raise ValueError("evaluate: the engine has no tokenizer; pass decode=")
        right[item.group, filled[item.group]] = bool(correct(item.group, item, text))
        filled[item.group] += 1
    return right
