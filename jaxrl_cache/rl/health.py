"""GRPO health metrics of one step, from its calls and rewards (pure host numpy), and a
watch that warns once when reward groups stop having any spread.

Groups are those of `make_batch`: the samples of one prompt of one call (for episodes: the
episodes of one task). A group whose rewards are all equal has zero advantage everywhere:
nothing in it is learnt from. A completion's length counts the tokens the policy sampled
(an episode's observation tokens excluded); truncated means stopped by the generation budget
(a Sample's finish_reason "length", an Episode's "token_budget"), not by a stop token.
"""
from __future__ import annotations

import warnings

import numpy as np

from jaxrl_cache.rollout.types import EpisodeBatch

TRUNCATED = ("length", "token_budget")  # Sample / Episode finish reasons of a cut completion


class NoSpreadWarning(UserWarning):
    """Several consecutive steps in which no group's rewards differed (no learning signal)."""


def _items(batches: list) -> list[tuple]:
    """(group key, sampled tokens, truncated) of every sample or episode, in batch order."""
    out = []
    for c, b in enumerate(batches):
        if isinstance(b, EpisodeBatch):
            out += [((c, e.group), e.sampled_tokens, e.finish_reason in TRUNCATED)
                    for e in b.episodes]
        else:
            out += [((c, s.group), len(s.output_ids), s.finish_reason in TRUNCATED)
                    for s in b.samples]
    return out


def step_health(batches: list, rewards) -> dict:
    """Record fields of a step (see docs/api.md): reward_std (over all samples),
    zero_std_groups (fraction of groups whose rewards are all equal), groups, completion
    length mean/min/max (sampled tokens) and truncated_fraction. rewards: one per sample or
    episode, in batch order."""
    items, rewards = _items(batches), np.asarray(rewards, np.float64)
    if len(items) != len(rewards):
        raise ValueError(f"step_health: {len(rewards)} rewards for {len(items)} samples")
    by_group: dict = {}
    for (key, _, _), r in zip(items, rewards):
        by_group.setdefault(key, []).append(r)
    flat = sum(1 for rs in by_group.values() if max(rs) == min(rs))
    lengths = np.array([n for _, n, _ in items] or [0])
    return dict(reward_std=float(rewards.std()) if len(rewards) else 0.0,
                zero_std_groups=flat / max(len(by_group), 1), groups=len(by_group),
                completion_length_mean=float(lengths.mean()),
                completion_length_min=int(lengths.min()),
                completion_length_max=int(lengths.max()),
                truncated_fraction=float(np.mean([t for _, _, t in items])) if items else 0.0)


class SpreadWatch:
    """Fires once per run after `k` consecutive steps whose records have zero_std_groups ==
    1 (no group with any reward spread): update(record) -> the message when it fires now,
    else None; with warn, the message is also a NoSpreadWarning (`warnings.warn`)."""

    def __init__(self, k: int = 5, *, warn: bool = True):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"SpreadWatch k must be an integer >= 1, got {k!r}")
        self.k, self.warn, self.run, self.warned = k, warn, 0, False

    def update(self, record: dict) -> str | None:
        self.run = self.run + 1 if record.get("zero_std_groups") == 1.0 else 0
        if self.run < self.k or self.warned:
            return None
        self.warned = True
        text = (f"step {record.get('step')}: no group's rewards have differed for {self.k} "
                f"consecutive steps (all advantages 0: nothing is learnt); check the reward, "
                f"the temperature or the group size")
        if self.warn:
            warnings.warn(text, NoSpreadWarning, stacklevel=2)
        return text
