"""Policy versions through training: TrainState, GRPO batches and the clipped PG train step.

The version is the number of optimizer updates applied. `train_step` applies
`mini_batches x epochs` updates to one batch and returns the version advanced by that many;
update k is evaluated with the learning rate schedule(version before it) (optax's
convention), so lr(update k) = schedule(k) for k = 0, 1, 2, ... The optimizer `tx` is the
learning-rate-free direction (e.g. `make_optimizer()`: clip, Adam, weight decay); the step
scales its output by -schedule(version). Every `count` inside the optimizer state equals the
version at all times; checkpoints verify it.

Memory is set by a micro-batch, not the batch: samples are packed into micro-batches of at
most `token_budget` tokens (rl/packing.py), each update accumulates gradients over them in
one jitted scan (no host round trip), log-probs come chunked (rl/logprobs.py: never
[N, L, V] logits) and the layer scan is rematerialised (`remat`). The loss of a mini-batch is
the sum over its sampled tokens of weight x token loss, the weights set on the host by
`loss_type` over the whole mini-batch, so the update does not depend on the budget.
Multi-turn episodes (EpisodeBatch) train the same way: their observation tokens
(Sample.loss_mask False) get weight 0, so they are context only, never in a loss, a
normaliser, a ratio statistic or a staleness.

Numbers: versions stay in the int32 range (`versioning.MAX_VERSION`); a step that would pass
it is refused. Non-finite rewards, behavior logprobs, clip parameters or negative /
non-finite learning rates are refused before any work, and a step whose loss or gradient norm
is not finite raises (`NonFiniteUpdate`, carrying the unchanged state) instead of returning
NaN params.

Off-policy correction (`correction="decoupled"`, decoupled PPO as in AReaL): three policies,
behavior (each token's recorded logprob, sampled by its own version), proximal (the
trainer's params before the first update of this batch, scored once, no gradient) and
current. The clipped ratio is current/proximal and each token's surrogate is weighted by
min(proximal/behavior, is_cap). `correction="none"` is plain PPO-clip with the ratio against
behavior. Both read the sampler's own distribution (`sampling.warped_logits`), so on fresh
samples proximal == behavior and, at the first update, the two objectives coincide.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
from optax import tree_utils as otu

from jaxrl_cache.checks import as_bool, as_count, as_real
from jaxrl_cache.errors import StalenessError, VersionError
from jaxrl_cache.models.llama import ModelConfig, init_params
from jaxrl_cache.parallel.mesh import DATA, FSDP
from jaxrl_cache.rl.logprobs import knobs_of, token_log_probs
from jaxrl_cache.rl.packing import MAX_ROW, PackedBatch, balanced_parts, pack
from jaxrl_cache.rollout.sampling import SamplingParams
from jaxrl_cache.rollout.types import EpisodeBatch, RolloutBatch
from jaxrl_cache.versioning import MAX_VERSION, as_version

CORRECTIONS = ("none", "decoupled")


def make_optimizer(*, weight_decay: float = 0.0, max_grad_norm: float = 1.0,
                   b1: float = 0.9, b2: float = 0.99) -> optax.GradientTransformation:
    """The learning-rate-free optimizer direction used by `train_step`.

    Memoised: equal hyperparameters (however spelled) give the very same transformation, so
    a re-created TrainState does not retrace the train step (jit keys static optax objects
    by identity).
    """
    return _optimizer(float(weight_decay), float(max_grad_norm), float(b1), float(b2))


@functools.lru_cache(maxsize=None)
def _optimizer(weight_decay: float, max_grad_norm: float, b1: float, b2: float):
    return optax.chain(clip_by_global_norm(max_grad_norm),
                       optax.scale_by_adam(b1=b1, b2=b2),
                       optax.add_decayed_weights(weight_decay))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm as one scalar factor, g * min(1, max_norm / |g|): XLA folds
    it into each consumer of the gradient, where optax's per-leaf select between g and its
    rescaled copy materialises a second gradient-sized buffer (measured: 513 MiB of temp
    and 2.3x the update time on SmolLM2-135M)."""
    def update(grads, state, params=None):
        del params
        scale = jnp.minimum(1.0, max_norm / optax.tree.norm(grads))
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def optimizer_counts(opt_state) -> list[int]:
    return [int(c) for _, c in otu.tree_get_all_with_path(opt_state, "count")]


@flax.struct.dataclass
class TrainState:
    params: dict
    opt_state: optax.OptState
    version: jax.Array  # int32 [] = optimizer updates applied
    tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
    lr_schedule: Callable = flax.struct.field(pytree_node=False)
    config: ModelConfig = flax.struct.field(pytree_node=False)

    @classmethod
    def create(cls, params, tx: optax.GradientTransformation | None = None, *,
               config: ModelConfig, lr_schedule: Callable | float = 1e-3,
               version=0) -> "TrainState":
        """A fresh optimizer state at `version` (its counts set to that version)."""
        version = as_version(version)
        tx = tx or make_optimizer()
        schedule = lr_schedule if callable(lr_schedule) else optax.constant_schedule(
            as_real(lr_schedule, "lr_schedule", minimum=0.0))
        opt_state = tx.init(params)
        if otu.tree_get_all_with_path(opt_state, "count"):
            opt_state = otu.tree_set(opt_state, count=jnp.asarray(version, jnp.int32))
        return cls(params=params, opt_state=opt_state, version=jnp.asarray(version, jnp.int32),
                   tx=tx, lr_schedule=schedule, config=config)


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


LOSS_TYPES = ("dapo", "grpo", "dr_grpo")  # TRL's names (see TrainConfig.loss_type)
COMPUTE_DTYPES = ("float32", "bfloat16")
REMATS = ("full", "dots", "none")
MAX_LENGTH = 2**20  # tokens per sample


class NonFiniteUpdate(ValueError):
    """An update produced a non-finite loss or gradient norm; `.state` is the input state,
    unchanged (usable even when the step donated its buffers)."""

    def __init__(self, message: str, state):
        super().__init__(message)
        self.state = state


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything `train_step` does with a batch; checked once, here.

    loss_type (TRL's names): "dapo" token mean over the mini-batch; "grpo" mean over
    sequences of each sequence's token mean; "dr_grpo" token sum / (sequences x
    max_new_tokens), Dr. GRPO's constant normaliser. kl_beta > 0 adds beta x k3 KL to the
    reference params (`train_step(ref_params=...)`) per sampled token.
    """
    clip_eps: float = 0.2
    dual_clip: float | None = None  # > 1: bounds the ratio's pull on negative advantages
    correction: str = "none"  # or "decoupled" (see module doc)
    is_cap: float = 2.0  # decoupled importance weights truncated at is_cap (>= 1)
    max_policy_lag: int | None = None  # oldest token version a sample may have, behind
    loss_type: str = "dapo"
    kl_beta: float = 0.0
    mini_batches: int = 1  # updates per pass: the batch split into this many parts
    epochs: int = 1  # passes over the batch
    token_budget: int = 4096  # tokens per micro-batch (packed rows x row length)
    remat: str = "full"  # layer-scan rematerialisation: "full", "dots" or "none"
    compute_dtype: str = "float32"  # "bfloat16": bf16 compute, fp32 params and optimizer
    logprob_chunk: int = 512  # positions per LM-head chunk
    donate: bool = False  # reuse the input state's buffers (the caller's state is consumed)

    def __post_init__(self):
        norm = dict(clip_eps=as_real(self.clip_eps, "clip_eps", minimum=0.0, open_min=True),
                    is_cap=as_real(self.is_cap, "is_cap", minimum=1.0),
                    kl_beta=as_real(self.kl_beta, "kl_beta", minimum=0.0),
                    mini_batches=as_count(self.mini_batches, "mini_batches", minimum=1,
                                          maximum=4096),
                    epochs=as_count(self.epochs, "epochs", minimum=1, maximum=4096),
                    token_budget=as_count(self.token_budget, "token_budget", minimum=2,
                                          maximum=MAX_LENGTH),
                    logprob_chunk=as_count(self.logprob_chunk, "logprob_chunk", minimum=1))
        if self.dual_clip is not None:
            norm["dual_clip"] = as_real(self.dual_clip, "dual_clip", minimum=1.0,
                                        open_min=True)
        if self.max_policy_lag is not None:
            norm["max_policy_lag"] = as_count(self.max_policy_lag, "max_policy_lag",
                                              maximum=MAX_VERSION)
        for name, allowed in (("correction", CORRECTIONS), ("loss_type", LOSS_TYPES),
                              ("remat", REMATS), ("compute_dtype", COMPUTE_DTYPES)):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__} "
                                f"{value!r:.80}")
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r:.80}")
        norm["donate"] = as_bool(self.donate, "donate")
        for name, value in norm.items():
            object.__setattr__(self, name, value)

    @property
    def updates(self) -> int:
        return self.mini_batches * self.epochs


@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """Samples ready to train on (host arrays; `train_step` packs them per its config).

    Per sample i: sequences[i] int32 [L_i] prompt + output; prompt_lengths[i];
    behavior_logprobs[i] f32 [O_i] and token_versions[i] int64 [O_i] of its output tokens;
    loss_masks[i] bool [O_i], True on the tokens the policy sampled (the only ones trained
    on; at least one per sample; behavior_logprobs is 0 elsewhere); mixed_masks[i] bool
    [O_i], True on tokens that attended KV of another version (Sample.mixed_tokens: their
    recorded log-prob is not checkable by a recompute); advantages[i];
    behavior_version[i] its oldest sampled token's version (staleness is measured from it).
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
        rewards = np.asarray(rewards, np.float32)
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
        sampling=sp)


def _loss_weights(batch: TrainBatch, part: np.ndarray, loss_type: str) -> list[np.ndarray]:
    """Each output token's share of its mini-batch's loss: per sample f32 [O_i], 0 exactly
    on unsampled tokens. dapo: 1 / sampled tokens of the mini-batch; grpo: 1 / (its sample's
    sampled tokens x samples); dr_grpo: 1 / (samples x max_new_tokens), a constant (for
    episodes max_new_tokens is per turn: still a constant, not an episode's length)."""
    masks = [batch.loss_masks[i] for i in part]
    sampled = [int(m.sum()) for m in masks]
    if loss_type == "dapo":
        shares = [1.0 / sum(sampled)] * len(part)
    elif loss_type == "grpo":
        shares = [1.0 / (n * len(part)) for n in sampled]
    else:  # dr_grpo
        shares = [1.0 / (len(part) * batch.sampling.max_new_tokens)] * len(part)
    return [np.where(m, np.float32(w), np.float32(0)) for m, w in zip(masks, shares)]


class AttributionFailure(ValueError):
    """The step's own audit found a token off its recorded log-prob under the params that
    claim to have sampled it; `.state` is the input state, unchanged (no update applied)."""

    def __init__(self, message: str, state):
        super().__init__(message)
        self.state = state


class TrainMemoryError(ValueError):
    """A train step that cannot fit the device memory (raised before any work)."""


def estimate_step_bytes(config: ModelConfig, cfg: TrainConfig,
                        row_length: int | None = None) -> dict:
    """Rough peak bytes of one train step: the state (params, gradients, Adam moments, the
    update's temporaries, and without donation a second params + Adam copy) plus the
    activations of one micro-batch of `token_budget` tokens (each layer's saved input,
    one layer's rematerialised backward, attention scores of rows of `row_length`, one
    LM-head chunk; row_length None: the longest rows packing makes). Independent of the
    batch size: that is the point of the budget."""
    param = 4 * _param_count(config)
    state = param * (5 if cfg.donate else 8)
    act = 2 if cfg.compute_dtype == "bfloat16" else 4
    t, d = cfg.token_budget, config.d_model
    width = min(MAX_ROW if row_length is None else max(row_length, 1), t)
    qkv = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
    saved = config.n_layers * t * d * act * (1 if cfg.remat != "none" else 12)
    layer = 3 * t * (3 * config.d_ff + 8 * d + qkv) * act + 12 * t * config.n_heads * width
    head = 4 * 4 * cfg.logprob_chunk * config.vocab_size
    return dict(state=state, activations=saved + layer + head, total=state + saved + layer + head)


@functools.lru_cache(maxsize=None)
def _param_count(config: ModelConfig) -> int:
    """Parameters of a model (abstract init, once per config: train_step checks every call)."""
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


def available_bytes() -> int | None:
    """Memory a step may use: the device's limit (accelerators), or on CPU this process's
    resident memory plus the machine's available memory. None if unknown."""
    stats = jax.local_devices()[0].memory_stats() or {}  # addressable in multi-process runs
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    try:
        meminfo = dict(line.split(":", 1) for line in open("/proc/meminfo"))
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return int(meminfo["MemAvailable"].split()[0]) * 1024 + rss
    except (OSError, KeyError, ValueError):
        return None


MEMORY_SLACK = 1.25  # the estimate is rough: refuse only what clearly cannot fit


def check_memory(config: ModelConfig, cfg: TrainConfig, row_length: int | None = None,
                 available: int | None = None) -> None:
    """Raises TrainMemoryError (one line, the numbers and the setting to change) if the
    step's estimate exceeds MEMORY_SLACK x the available memory (default
    `available_bytes()`; unknown: no check)."""
    have = available_bytes() if available is None else available
    need = estimate_step_bytes(config, cfg, row_length)
    if have is None or need["total"] <= MEMORY_SLACK * have:
        return
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    per_token = max(need["activations"] / cfg.token_budget, 1.0)
    fits = int((MEMORY_SLACK * have - need["state"]) / per_token) // 256 * 256
    hint = (f"lower token_budget (--token-budget) to about {fits}" if fits >= 256 else
            "the state alone does not fit: donate=True, a smaller model or more memory")
    raise TrainMemoryError(
        f"train step needs ~{gib(need['total'])} (state {gib(need['state'])} + "
        f"{gib(need['activations'])} for micro-batches of {cfg.token_budget} tokens), "
        f"{gib(have)} available; {hint}")


_PACKED_SHAPES: dict = {}  # (U, token_budget, row_multiple) -> {(R, M, B): {K}} packed so far


def pack_batch(batch: TrainBatch, cfg: TrainConfig, *, row_multiple: int = 1) -> PackedBatch:
    """The batch as [mini_batches, M, B, R] micro-batches (`packing.balanced_parts`),
    planned for every sample at prompt + max_new_tokens, or its length when longer (an
    episode), so the shape follows the prompts, not the sampled lengths; preferring a shape this process packed (so compiled)
    before (`packing.plan`)."""
    if batch.num_samples < cfg.mini_batches:
        raise ValueError(f"mini_batches={cfg.mini_batches} exceeds the batch's "
                         f"{batch.num_samples} samples")
    parts = balanced_parts(np.array([len(s) for s in batch.sequences]), cfg.mini_batches)
    weights = [None] * batch.num_samples
    for part in parts:
        for i, w in zip(part, _loss_weights(batch, part, cfg.loss_type)):
            weights[i] = w
    known = _PACKED_SHAPES.setdefault((len(parts), cfg.token_budget, row_multiple), {})
    audited = [m & ~x for m, x in zip(batch.loss_masks, batch.mixed_masks)]
    packed = pack(batch.sequences, batch.prompt_lengths, batch.behavior_logprobs,
                  batch.token_versions, batch.advantages, weights, audited, parts=parts,
                  token_budget=cfg.token_budget, row_multiple=row_multiple, known=known,
                  reserve=batch.prompt_lengths + batch.sampling.max_new_tokens)
    _, micro, rows, width = packed.tokens.shape
    known.setdefault((width, micro, rows), set()).add(packed.scored.shape[-1])
    return packed


def _compute_params(params, cfg: TrainConfig):
    if cfg.compute_dtype == "float32":
        return params
    return jax.tree.map(lambda x: x.astype(cfg.compute_dtype)
                        if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def _micro_log_probs(params, config, mb: PackedBatch, knobs, kind, cfg: TrainConfig):
    """Log-probs [B, R] of each scored position's target, 0 elsewhere (clamped at -1e4: a
    token outside a new top-k/top-p set gets ratio ~0, not NaN)."""
    logp = token_log_probs(_compute_params(params, cfg), config, mb.tokens, mb.targets, knobs,
                           kind=kind, positions=mb.positions, segments=mb.segments,
                           remat=cfg.remat, chunk=cfg.logprob_chunk, scored=mb.scored)
    return jnp.maximum(logp, -1e4)


@functools.partial(jax.jit, static_argnames=("config", "kind", "cfg"))
def _score(params, packed: PackedBatch, knobs, *, config, kind, cfg: TrainConfig):
    """Log-probs [U, M, B, R] of every target under `params`, no gradient (the proximal
    policy, the reference policy)."""
    def one(_, mb):
        return None, jax.lax.stop_gradient(_micro_log_probs(params, config, mb, knobs, kind,
                                                            cfg))
    flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), packed)
    _, logp = jax.lax.scan(one, None, flat)
    return logp.reshape(packed.tokens.shape)


def _micro_loss(params, config, mb: PackedBatch, proximal, ref, knobs, kind, version, nums,
                cfg: TrainConfig):
    """Sum over the micro-batch of weight x token loss, and the sums behind the metrics.
    proximal, ref: f32 [B, R] or None (proximal None: this update's params, no gradient);
    nums: clip_eps, is_cap, kl_beta f32 [], dual_clip f32 [] or None (traced)."""
    logp = _micro_log_probs(params, config, mb, knobs, kind, cfg)
    mask = mb.weights > 0
    on = lambda x: jnp.where(mask, x, 0.0)  # noqa: E731 (log-ratios at masked positions)
    prox = jax.lax.stop_gradient(logp) if proximal is None else proximal
    is_weight = jnp.exp(on(prox - mb.behavior))  # proximal / behavior
    adv = mb.advantages
    if cfg.correction == "decoupled":
        ratio = jnp.exp(on(logp - prox))
        scale = jnp.minimum(is_weight, nums["is_cap"])
        truncated = (is_weight > nums["is_cap"]) & mask
    else:
        ratio = jnp.exp(on(logp - mb.behavior))
        scale, truncated = 1.0, jnp.zeros_like(mask)
    clip_eps, dual_clip = nums["clip_eps"], nums["dual_clip"]
    surrogate = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps))
    if dual_clip is not None:
        surrogate = jnp.where(adv < 0, jnp.minimum(surrogate, -dual_clip * adv), surrogate)
    token_loss = scale * surrogate
    kl = jnp.zeros_like(logp)
    if ref is not None:  # k3: exp(ref - logp) - (ref - logp) - 1 >= 0
        delta = on(ref - logp)
        kl = jnp.exp(delta) - delta - 1.0
        token_loss = token_loss + nums["kl_beta"] * kl
    loss = (mb.weights * token_loss).sum()
    staleness = version - mb.versions
    check = (mb.audited > 0) & (mb.versions == version)  # tokens these very params sampled
    delta = jnp.where(check, jax.lax.stop_gradient(logp) - mb.behavior, 0.0)
    gap = jnp.where(jnp.isnan(delta), jnp.inf, jnp.abs(delta))
    drift = jnp.where(check, jnp.exp(delta) - delta - 1.0, 0.0)  # k3 of KL(sampler||trainer)
    sums = dict(tokens=mask.sum(), ratio=on(ratio).sum(),
                ratio_max=jnp.where(mask, ratio, 0).max(),
                clipped=((jnp.abs(ratio - 1) > clip_eps) & mask).sum(),
                is_weight=on(is_weight).sum(), is_weight_max=jnp.where(mask, is_weight, 0).max(),
                truncated=truncated.sum(), kl=on(kl).sum(), staleness=on(staleness).sum(),
                staleness_max=jnp.where(mask, staleness, 0).max(),
                newest=jnp.where(mask, mb.versions, 0).max(),
                audit_diff_max=gap.max(), audit_diff_sum=gap.sum(), audit_kl_sum=drift.sum(),
                audit_tokens=check.sum())
    return loss, sums


_MAXED = ("ratio_max", "is_weight_max", "staleness_max", "newest", "audit_diff_max")


def _gradients(params, config, part: PackedBatch, proximal, ref, knobs, kind, version, nums,
               cfg: TrainConfig):
    """(gradients, loss, metric sums) of a part's micro-batches [M, ...], accumulated in a
    scan; a part of one micro-batch takes its gradient directly (no zeroed accumulator)."""
    grad_fn = jax.value_and_grad(_micro_loss, has_aux=True)
    take = lambda t: None if t is None else jax.tree.map(lambda x: x[0], t)  # noqa: E731
    if part.tokens.shape[0] == 1:
        (loss, sums), grads = grad_fn(params, config, take(part), take(proximal), take(ref),
                                      knobs, kind, version, nums, cfg)
        return grads, loss, sums

    def micro(carry, xs):
        grads, loss, sums = carry
        mb, prox, rf = xs
        (l, s), g = grad_fn(params, config, mb, prox, rf, knobs, kind, version, nums, cfg)
        sums = {k: jnp.maximum(sums[k], v) if k in _MAXED else sums[k] + v
                for k, v in s.items()}
        return (jax.tree.map(jnp.add, grads, g), loss + l, sums), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    first = jax.eval_shape(lambda: _micro_loss(params, config, take(part), take(proximal),
                                               take(ref), knobs, kind, version, nums, cfg)[1])
    sums0 = {k: jnp.zeros(v.shape, v.dtype) for k, v in first.items()}
    (grads, loss, sums), _ = jax.lax.scan(micro, (zeros, jnp.float32(0), sums0),
                                          (part, proximal, ref))
    return grads, loss, sums


def _update(params, opt_state, version, part: PackedBatch, proximal, ref, knobs, lr, nums,
            tolerance, *, tx, config, kind, cfg: TrainConfig):
    """One optimizer update on a part's micro-batches [M, ...]. It is applied only when its
    loss and gradient norm are finite and no audited token is more than `tolerance` off its
    record; otherwise params and optimizer state pass through unchanged. The choice is a
    `lax.cond`, so the update runs in place in donated buffers (a select between old and new
    state would keep both live)."""
    grads, loss, sums = _gradients(params, config, part, proximal, ref, knobs, kind, version,
                                   nums, cfg)
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & (sums["audit_diff_max"] <= tolerance)

    def apply(params, opt_state, grads):
        direction, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, jax.tree.map(lambda u: -lr * u, direction)), opt_state

    params, opt_state = jax.lax.cond(ok, apply, lambda p, s, _: (p, s), params, opt_state, grads)
    tokens = jnp.maximum(sums["tokens"], 1)
    metrics = dict(loss=loss, lr=lr, grad_norm=grad_norm,
                   ratio_mean=sums["ratio"] / tokens, ratio_max=sums["ratio_max"],
                   clip_fraction=sums["clipped"] / tokens, tokens=sums["tokens"],
                   is_weight_mean=sums["is_weight"] / tokens,
                   is_weight_max=sums["is_weight_max"],
                   is_truncated_fraction=sums["truncated"] / tokens, kl=sums["kl"] / tokens,
                   staleness_mean=sums["staleness"] / tokens,
                   staleness_max=sums["staleness_max"], newest_token_version=sums["newest"],
                   audit_diff_max=sums["audit_diff_max"], audit_diff_sum=sums["audit_diff_sum"],
                   audit_kl_sum=sums["audit_kl_sum"], audit_checked_tokens=sums["audit_tokens"])
    return params, opt_state, metrics


def _train_core(params, opt_state, version, packed: PackedBatch, proximal, ref, knobs, lrs,
                nums, tolerance, *, tx, config, kind, cfg: TrainConfig):
    """cfg.updates updates; lrs f32 [updates]; tolerance f32 [] (inf: no audit gate).
    Returns (params', opt_state', version', metrics of each update [updates], finite,
    attributed). The first update scores the tokens of `version` with the very params that
    sampled them: attributed is False if one of them is off its recorded log-prob by more
    than tolerance. When a loss or gradient norm is not finite, or not attributed, the input
    params and optimizer state come back unchanged: one update skips itself (`_update`);
    several keep the input state beside the scan's (their failure may come after a good
    update)."""
    def one(carry, i):
        p, s, v = carry
        u = i % cfg.mini_batches
        take = lambda t: None if t is None else jax.tree.map(lambda x: x[u], t)  # noqa
        p, s, m = _update(p, s, v, take(packed), take(proximal), take(ref), knobs, lrs[i],
                          nums, tolerance, tx=tx, config=config, kind=kind, cfg=cfg)
        return (p, s, v + 1), m

    if cfg.updates == 1:
        (new_params, new_opt, new_version), m = one((params, opt_state, version), 0)
        metrics = jax.tree.map(lambda x: x[None], m)
    else:
        (new_params, new_opt, new_version), metrics = jax.lax.scan(
            one, (params, opt_state, version), jnp.arange(cfg.updates))
    finite = jnp.isfinite(metrics["loss"]).all() & jnp.isfinite(metrics["grad_norm"]).all()
    attributed = metrics["audit_diff_max"].max() <= tolerance
    ok = finite & attributed
    if cfg.updates > 1:
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa
        new_params, new_opt = keep(new_params, params), keep(new_opt, opt_state)
    return new_params, new_opt, jnp.where(ok, new_version, version), metrics, finite, attributed


def _structure(cfg: TrainConfig) -> TrainConfig:
    """The part of a config that shapes the program (numbers are traced: new values compile
    nothing)."""
    return dataclasses.replace(cfg, clip_eps=0.2, is_cap=2.0, kl_beta=float(cfg.kl_beta > 0),
                               dual_clip=None if cfg.dual_clip is None else 2.0,
                               max_policy_lag=None, donate=False)


_STATIC = ("tx", "config", "kind", "cfg")
_train_jit = jax.jit(_train_core, static_argnames=_STATIC)
_train_jit_donating = jax.jit(_train_core, static_argnames=_STATIC, donate_argnums=(0, 1))


def _summary(metrics: dict, version: int, updates: int) -> dict:
    """Scalars over the updates: means, maxima of the *_max keys, the last lr; per-update
    arrays under "per_update". All stay on device."""
    out = {k: (v.max() if k.endswith("_max") or k == "newest_token_version" else
               v.sum() if k.startswith("audit_") else v.mean())
           for k, v in metrics.items()}
    checked = jnp.maximum(out["audit_checked_tokens"], 1)
    out.update(logprob_mismatch_max=out["audit_diff_max"],  # the sampler/trainer mismatch
               logprob_mismatch_mean=out.pop("audit_diff_sum") / checked,
               logprob_mismatch_kl=out.pop("audit_kl_sum") / checked)
    out.update(lr=metrics["lr"][-1], version=jnp.int32(version + updates), updates=updates,
               per_update=metrics)
    return out


def train_step(state: TrainState, batch: TrainBatch, config: TrainConfig | None = None, *,
               ref_params=None, mesh=None, audit_tolerance: float | None = None, **options):
    """`config.updates` optimizer updates on `batch`. Returns (state with version +
    updates, metrics). options: TrainConfig fields overriding `config` (e.g.
    `train_step(state, batch, max_policy_lag=1)`).

    The audit for free: the first update scores every token of the state's version with
    the params that sampled it, so it checks invariant 2 on the tokens of the first
    mini-batch at `state.version` (sampled, not mixed): metrics audit_checked_tokens and
    audit_diff_max (max |recomputed - recorded|), and the sampler/trainer mismatch over
    them: logprob_mismatch_max / _mean (|trainer - sampler| log-prob) and _kl (k3 estimate
    of KL(sampler || trainer)), all exactly 0 under exact numerics. audit_tolerance: if one of
    them differs by more, no update is applied and AttributionFailure (carrying the unchanged
    state) is raised. Under compute_dtype="bfloat16" the recorded log-probs are reproduced
    exactly when the sampler ran the bf16 cast of the params (an engine whose
    ModelConfig.dtype is "bfloat16"); from fp32 sampling they differ by bf16 rounding.

    Metrics (device arrays, read by the caller when it wants them): loss, grad_norm,
    ratio/clip/importance-weight statistics, staleness (trainer version - token version)
    mean/max, kl, averaged over the updates (maxima for *_max), lr of the last update,
    version, and "per_update" arrays [updates]. ref_params: the reference policy of
    kl_beta. mesh: a Mesh with data/fsdp axes: rows split over them, the state placed like
    `state` (see parallel.train_state_shardings).

    Raises before any work: TypeError/ValueError for a malformed argument or a learning rate
    that is negative or not finite at one of the versions; VersionError if the version would
    pass the int32 range; StalenessError if a sample's oldest token lags the state's version
    by more than max_policy_lag, or a token is newer than the state; ValueError (one line,
    with the numbers) if a sample cannot fit the token budget, TrainMemoryError if the step's
    estimate (`estimate_step_bytes`) exceeds the available memory. Raises NonFiniteUpdate
    (carrying the unchanged state) if a loss or gradient norm came out non-finite.
    """
    if audit_tolerance is not None:
        audit_tolerance = as_real(audit_tolerance, "audit_tolerance", minimum=0.0)
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be a TrainState, got {type(state).__name__}")
    if not isinstance(batch, TrainBatch):
        raise TypeError(f"batch must be a TrainBatch (see make_batch), got "
                        f"{type(batch).__name__}")
    if config is not None and not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    cfg = dataclasses.replace(config or TrainConfig(), **options)
    if cfg.kl_beta > 0 and ref_params is None:
        raise ValueError("kl_beta > 0 needs ref_params (the reference policy)")
    version = as_version(state.version, "state.version")
    if version > MAX_VERSION - cfg.updates:
        raise VersionError(f"state.version {version} + {cfg.updates} updates would pass the "
                           f"largest int32 version {MAX_VERSION}")
    lrs = [float(state.lr_schedule(version + i)) for i in range(cfg.updates)]
    for i, lr in enumerate(lrs):
        if not (np.isfinite(lr) and lr >= 0):
            raise ValueError(f"lr_schedule({version + i}) = {lr} must be finite and >= 0")
    oldest, newest = int(batch.behavior_version.min()), max(
        int(v[m].max()) for v, m in zip(batch.token_versions, batch.loss_masks))
    if cfg.max_policy_lag is not None and version - oldest > cfg.max_policy_lag:
        raise StalenessError(
            f"batch sample {int(batch.behavior_version.argmin())} has a token of version "
            f"{oldest}, {version - oldest} updates behind the trainer (version {version}); "
            f"max_policy_lag={cfg.max_policy_lag}")
    if newest > version:
        raise StalenessError(f"batch has a token of version {newest}, newer than the "
                             f"trainer ({version})")
    ways = 1 if mesh is None else math.prod(mesh.shape[a] for a in (DATA, FSDP)
                                             if a in mesh.shape)
    packed = pack_batch(batch, cfg, row_multiple=ways)
    check_memory(state.config, cfg, packed.tokens.shape[-1])
    knobs, kind = knobs_of(batch.sampling, state.config.vocab_size)
    layout = None
    if mesh is not None:
        axes = tuple(a for a in (DATA, FSDP) if a in mesh.shape)
        packed = jax.device_put(packed, NamedSharding(mesh, P(None, None, axes or None)))
        layout = jax.tree.map(lambda x: x.sharding, state)
    statics = dict(config=state.config, kind=kind, cfg=_structure(cfg))
    with (jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()):
        proximal = ref = None
        if cfg.correction == "decoupled" and cfg.updates > 1:
            proximal = _score(state.params, packed, knobs, **statics)
        if cfg.kl_beta > 0:
            ref = _score(ref_params, packed, knobs, **statics)
        nums = dict(clip_eps=jnp.float32(cfg.clip_eps), is_cap=jnp.float32(cfg.is_cap),
                    kl_beta=jnp.float32(cfg.kl_beta),
                    dual_clip=None if cfg.dual_clip is None else jnp.float32(cfg.dual_clip))
        core = _train_jit_donating if cfg.donate else _train_jit
        tolerance = jnp.float32(np.inf if audit_tolerance is None else audit_tolerance)
        params, opt_state, new_version, metrics, finite, attributed = core(
            state.params, state.opt_state, state.version, packed, proximal, ref, knobs,
            jnp.asarray(lrs, jnp.float32), nums, tolerance, tx=state.tx, **statics)
    new_state = state.replace(params=params, opt_state=opt_state, version=new_version)
    if layout is not None:
        new_state = jax.device_put(new_state, layout)
    finite, attributed = jax.device_get((finite, attributed))  # the one host read
    if not finite:
        loss, norm = jax.device_get((metrics["loss"], metrics["grad_norm"]))
        raise NonFiniteUpdate(f"train step at version {version} produced loss {loss.tolist()}, "
                              f"gradient norm {norm.tolist()}; refusing to return non-finite "
                              f"params", new_state)
    if not attributed:
        worst = float(jax.device_get(metrics["audit_diff_max"]).max())
        raise AttributionFailure(f"train step at version {version}: a token of version "
                                 f"{version} is {worst:.3g} off its recorded log-prob "
                                 f"(tolerance {audit_tolerance:g}); no update applied",
                                 new_state)
    return new_state, _summary(metrics, version, cfg.updates)
