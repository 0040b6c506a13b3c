"""Samples -> a TrainBatch -> packed micro-batches: GRPO advantages, the per-sample field
checks (shared with the audit), the loss weights of each token, and the packing the train
step runs on (rl/packing.py).

A batch's loss is the sum over its sampled tokens of weight x token loss; the weights are
set here, on the host, by `loss_type` over each whole mini-batch, so an update does not
depend on the token budget. Multi-turn episodes (EpisodeBatch) contribute one sample each:
their observation tokens (Sample.loss_mask False) get weight 0, so they are context only,
never in a loss, a normaliser, a ratio statistic or a staleness.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import numpy as np

from jaxrl_cache.rl.packing import PackedBatch, balanced_parts, pack
from jaxrl_cache.rl.train_config import MAX_LENGTH, TrainConfig
from jaxrl_cache.rollout.sampling import SamplingParams
from jaxrl_cache.rollout.types import EpisodeBatch, RolloutBatch
from jaxrl_cache.versioning import MAX_VERSION


def group_advantages(rewards: np.ndarray, groups: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GRPO: (r - group mean) / (group std + eps). rewards, groups [N] -> [N]."""
    rewards = np.asarray(rewards, np.float64)
    out = np.zeros_like(rewards)
    for g in np.unique(groups):
        idx = groups == g
        r = rewards[idx]
        out[idx] = (r - r.mean()) / (r.std() + eps)
    return out.astype(np.float32)


def group_advantages_no_std(rewards: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Dr. GRPO: r - group mean (no division by the group std). rewards, groups [N] -> [N]."""
    rewards = np.asarray(rewards, np.float64)
    out = np.zeros_like(rewards)
    for g in np.unique(groups):
        idx = groups == g
        out[idx] = rewards[idx] - rewards[idx].mean()
    return out.astype(np.float32)


SCALE_REWARDS = ("group", "batch", "none")  # TRL's scale_rewards
TRUNCATED = ("length", "token_budget")  # finish reasons of a sample cut by its token limit


def scaled_advantages(rewards: np.ndarray, groups: np.ndarray,
                      scale_rewards: str = "group") -> np.ndarray:
    """TRL's GRPO advantages: r - group mean, divided by (std + 1e-4) where std is the
    unbiased (Bessel) std of the group's rewards ("group"), of the whole batch's ("batch"),
    or not divided ("none"). A group (a batch) of one sample has std 0. rewards, groups [N]
    -> f32 [N]."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got "
                         f"{scale_rewards!r:.80}")
    rewards = np.asarray(rewards, np.float64)
    out = np.zeros_like(rewards)
    std = lambda r: r.std(ddof=1) if r.size > 1 else 0.0  # noqa: E731
    for g in np.unique(groups):
        idx = groups == g
        out[idx] = rewards[idx] - rewards[idx].mean()
        if scale_rewards == "group":
            out[idx] /= std(rewards[idx]) + 1e-4
    if scale_rewards == "batch":
        out /= std(rewards) + 1e-4
    return out.astype(np.float32)


def advantages_for(scale_rewards: str | None) -> Callable:
    """make_batch's `advantages` for a scale_rewards setting: None keeps this library's
    default (`group_advantages`); "group" / "batch" / "none" are TRL's (`scaled_advantages`)."""
    if scale_rewards is None:
        return group_advantages
    scaled_advantages(np.zeros(1), np.zeros(1), scale_rewards)  # checks the name
    return functools.partial(scaled_advantages, scale_rewards=scale_rewards)


def token_flags(sample, index: int, name: str, default: bool) -> np.ndarray:
    """The per-token bool field `name` of a Sample (loss_mask, mixed_tokens) as bool
    [len(output_ids)], `default` everywhere when None; checked (ValueError naming the
    sample)."""
    n = len(sample.output_ids)
    value = getattr(sample, name)
    if value is None:
        return np.full(n, default)
    flags = np.asarray(value)
    if flags.shape != (n,) or flags.dtype != np.bool_:
        raise ValueError(f"sample {index}: {name} must be None or bool [{n}], got "
                         f"{flags.dtype}{list(flags.shape)}")
    return flags


def sample_loss_mask(sample, index: int) -> np.ndarray:
    """Sample.loss_mask (None = every output token sampled), checked."""
    return token_flags(sample, index, "loss_mask", True)


def sample_token_versions(sample, index: int) -> np.ndarray:
    """Sample.token_versions as int64 [len(output_ids)], checked (ValueError naming it)."""
    versions = np.asarray(sample.token_versions)
    if versions.shape != (len(sample.output_ids),) or (
            versions.size and not np.issubdtype(versions.dtype, np.integer)):
        raise ValueError(f"sample {index}: token_versions must be integers "
                         f"[{len(sample.output_ids)}], got {versions.dtype}{list(versions.shape)}")
    if versions.size and (versions.min() < 0 or versions.max() > MAX_VERSION):
        raise ValueError(f"sample {index}: token_versions must lie in [0, {MAX_VERSION}], got "
                         f"[{versions.min()}, {versions.max()}]")
    return versions.astype(np.int64)


@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """Samples ready to train on (host arrays; `train_step` packs them per its config).

    Per sample i: sequences[i] int32 [L_i] prompt + output; prompt_lengths[i];
    behavior_logprobs[i] f32 [O_i] and token_versions[i] int64 [O_i] of its output tokens;
    loss_masks[i] bool [O_i], True on the tokens the policy sampled (the only ones trained
    on; at least one per sample; behavior_logprobs is 0 elsewhere); mixed_masks[i] bool
    [O_i], True on tokens that attended KV of another version (Sample.mixed_tokens: their
    recorded log-prob is not checkable by a recompute); advantages[i];
    behavior_version[i] its oldest sampled token's version (staleness is measured from it);
    truncated[i]: its finish_reason is in TRUNCATED (cut by its token limit).
    All samples share one sampling setting (the distribution the loss scores).
    """
    sequences: tuple
    prompt_lengths: np.ndarray  # int64 [N]
    behavior_logprobs: tuple
    token_versions: tuple
    loss_masks: tuple
    mixed_masks: tuple
    advantages: np.ndarray  # f32 [N]
    behavior_version: np.ndarray  # int64 [N]
    sampling: SamplingParams
    truncated: np.ndarray  # bool [N]

    @property
    def num_samples(self) -> int:
        return len(self.sequences)

    @property
    def real_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


def make_batch(rollouts: RolloutBatch | EpisodeBatch | Sequence[RolloutBatch | EpisodeBatch],
               rewards, *,
               advantages: Callable = group_advantages) -> TrainBatch:
    """Samples of one or more rollout / episode batches + scalar rewards [N] -> a TrainBatch.

    An EpisodeBatch contributes one sample per episode (EpisodeBatch.samples: the first
    observation as prompt, every later token as output, its loss_mask marking the sampled
    ones); batches of both kinds may be mixed. Groups (for advantages) are the n samples of
    one prompt of one call (for episodes: the episodes of one task); advantages (rewards
    f64 [N], groups int [N]) -> f32 [N] is GRPO's group normalisation by default
    (`group_advantages_no_std`: Dr. GRPO's). All batches must share sampling parameters.
    Per-token versions come from Sample.token_versions; behavior_version is the oldest
    sampled token's. A sample whose loss_mask is misshapen or has no True entry is a
    ValueError naming it; behavior logprobs are checked (finite) on sampled tokens only.
    """
    kinds = (RolloutBatch, EpisodeBatch)
    if isinstance(rollouts, kinds):
        batches = [rollouts]
    elif isinstance(rollouts, (list, tuple)) and all(isinstance(b, kinds) for b in rollouts):
        batches = list(rollouts)
    else:
        raise TypeError(f"rollouts must be a RolloutBatch or an EpisodeBatch, or a list of "
                        f"them, got {type(rollouts).__name__}")
    if not batches:
        raise ValueError("make_batch needs at least one rollout batch")
    per_batch = [b.samples for b in batches]  # EpisodeBatch.samples builds them: once
    empty = [k for k, s in enumerate(per_batch) if not s]
    if empty:
        raise ValueError(f"rollouts: batch {empty[0]} has no samples")
    sp = batches[0].sampling
    if any(b.sampling != sp for b in batches):
        raise ValueError("all rollout batches of a training batch must share SamplingParams")
    samples = [s for b in per_batch for s in b]
    groups = np.array([(k << 32) + s.group for k, b in enumerate(per_batch) for s in b])
    try:
        rewards = np.asarray(rewards, np.float64)  # checked before the float32 cast
    except (TypeError, ValueError):
        raise TypeError(f"rewards must be numbers [N={len(samples)}], got "
                        f"{type(rewards).__name__} {rewards!r:.80}") from None
    except OverflowError:  # an int past the float range (10**400)
        raise ValueError("rewards must be finite, got an integer past the float range") \
            from None
    if rewards.shape != (len(samples),):
        raise ValueError(f"rewards must be [N={len(samples)}], got shape {rewards.shape}")
    if not np.isfinite(rewards).all():
        bad = int(np.flatnonzero(~np.isfinite(rewards))[0])
        raise ValueError(f"rewards must be finite, got rewards[{bad}] = {rewards[bad]}")
    too_big = np.abs(rewards) > np.finfo(np.float32).max
    if too_big.any():
        bad = int(np.flatnonzero(too_big)[0])
        raise ValueError(f"rewards must fit float32 (|r| <= 3.4e38), got rewards[{bad}] = "
                         f"{rewards[bad]:g}")
    rewards = rewards.astype(np.float32)
    versions = [sample_token_versions(s, i) for i, s in enumerate(samples)]
    masks = [sample_loss_mask(s, i) for i, s in enumerate(samples)]
    behavior = []
    for i, (s, mask) in enumerate(zip(samples, masks)):
        logp = np.asarray(s.output_logprobs, np.float32)
        if logp.shape != (len(s.output_ids),) or not np.isfinite(logp[mask]).all():
            raise ValueError(f"sample {i} has non-finite or misshapen behavior logprobs")
        if len(s.prompt_ids) + len(s.output_ids) > MAX_LENGTH or not s.output_ids:
            raise ValueError(f"sample {i} must have 1 to {MAX_LENGTH} tokens with at least "
                             f"one output token")
        if not mask.any():
            raise ValueError(f"sample {i} has no sampled token (its loss_mask is all False)")
        behavior.append(np.where(mask, logp, np.float32(0)))
    adv = np.asarray(advantages(rewards.astype(np.float64), groups), np.float32)
    if adv.shape != (len(samples),) or not np.isfinite(adv).all():
        raise ValueError(f"advantages(...) must return finite f32 [{len(samples)}]")
    return TrainBatch(
        sequences=tuple(np.asarray(s.prompt_ids + s.output_ids, np.int32) for s in samples),
        prompt_lengths=np.array([len(s.prompt_ids) for s in samples]),
        behavior_logprobs=tuple(behavior), token_versions=tuple(versions),
        loss_masks=tuple(masks), advantages=adv,
        mixed_masks=tuple(token_flags(s, i, "mixed_tokens", False) & m
                          for i, (s, m) in enumerate(zip(samples, masks))),
        behavior_version=np.array([int(v[m].min()) for v, m in zip(versions, masks)]),
        sampling=sp, truncated=np.array([s.finish_reason in TRUNCATED for s in samples]))


def _loss_weights(batch: TrainBatch, part: np.ndarray, loss_type: str,
                  mask_truncated: bool = False) -> list[np.ndarray]:
    """Each output token's share of its mini-batch's loss: per sample f32 [O_i], 0 exactly
    on untrained tokens. dapo: 1 / trained tokens of the mini-batch; grpo: 1 / (its sample's
    sampled tokens x samples); dr_grpo: 1 / (samples x max_new_tokens), a constant (for
    episodes max_new_tokens is per turn: still a constant, not an episode's length).
    mask_truncated: a truncated sample's tokens are untrained (weight 0; TRL's
    mask_truncated_completions: they leave dapo's token count, not grpo's and dr_grpo's
    sample count)."""
    masks = [np.zeros_like(batch.loss_masks[i]) if mask_truncated and batch.truncated[i]
             else batch.loss_masks[i] for i in part]
    sampled = [int(m.sum()) for m in masks]
    if loss_type == "dapo":
        shares = [1.0 / max(sum(sampled), 1)] * len(part)
    elif loss_type == "grpo":
        shares = [1.0 / (max(n, 1) * len(part)) for n in sampled]
    else:  # dr_grpo
        shares = [1.0 / (len(part) * batch.sampling.max_new_tokens)] * len(part)
    return [np.where(m, np.float32(w), np.float32(0)) for m, w in zip(masks, shares)]


_PACKED_SHAPES: dict = {}  # (U, token_budget, row_multiple) -> {(R, M, B): {(K, KM, N, W)}} so far


def pack_batch(batch: TrainBatch, cfg: TrainConfig, *, row_multiple: int = 1) -> PackedBatch:
    """The batch as [mini_batches, M, B, R] micro-batches (`packing.balanced_parts`),
    its shape planned for every sample at prompt + max_new_tokens, or its length when
    longer (an episode), so the shape follows the prompts, not the sampled lengths; the
    samples laid out densely in it as sampled (micro-batches they do not reach are padding,
    skipped by the step); preferring a shape this process packed (so compiled) before
    (`packing.plan`)."""
    if batch.num_samples < cfg.mini_batches:
        raise ValueError(f"mini_batches={cfg.mini_batches} exceeds the batch's "
                         f"{batch.num_samples} samples")
    parts = balanced_parts(np.array([len(s) for s in batch.sequences]), cfg.mini_batches)
    weights = [None] * batch.num_samples
    for part in parts:
        for i, w in zip(part, _loss_weights(batch, part, cfg.loss_type,
                                            cfg.mask_truncated_completions)):
            weights[i] = w
    known = _PACKED_SHAPES.setdefault((len(parts), cfg.token_budget, row_multiple), {})
    audited = [m & ~x for m, x in zip(batch.loss_masks, batch.mixed_masks)]
    packed = pack(batch.sequences, batch.prompt_lengths, batch.behavior_logprobs,
                  batch.token_versions, batch.advantages, weights, audited, parts=parts,
                  token_budget=cfg.token_budget, row_multiple=row_multiple, known=known,
                  reserve=batch.prompt_lengths + batch.sampling.max_new_tokens)
    _, micro, rows, width = packed.tokens.shape
    known.setdefault((width, micro, rows), set()).add((packed.scored.shape[-1],
                                                       packed.kv_blocks.shape[-1],
                                                       packed.columns.shape[-1],
                                                       packed.items.shape[-1]))
    return packed
