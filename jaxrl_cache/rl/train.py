"""Policy versions through training: TrainState, GRPO batches and the clipped PG train step.

The version is the number of optimizer updates applied. `train_step` returns it incremented
and evaluates the learning-rate schedule at the input version, the update count before this
update (optax's convention), so lr(update k) = schedule(k) for k = 0, 1, 2, ...
The optimizer `tx` is the learning-rate-free direction (e.g. `make_optimizer()`: clip, Adam,
weight decay); the step scales its output by -schedule(version). Every `count` inside the
optimizer state equals the version at all times; checkpoints verify it.

Numbers: versions stay in the int32 range (`versioning.MAX_VERSION`); a step that would pass
it is refused. Non-finite rewards, behavior logprobs, clip parameters or learning rates are
refused before any work, and a step whose loss or gradient norm is not finite raises instead
of returning NaN params: `train_step` is functional, so the caller's state stays as it was.

Off-policy correction (`correction="decoupled"`, decoupled PPO as in AReaL): three policies,
behavior (each token's recorded logprob, sampled by its own version), proximal (the trainer's
params before this update, no gradient) and current. The clipped ratio is current/proximal and
each token's surrogate is weighted by min(proximal/behavior, is_cap). `correction="none"` is
plain PPO-clip with the ratio against behavior. Both read logprobs from
`teacher_forced_log_probs` (the sampler's own `behavior_log_probs`), so on fresh samples
proximal == behavior and the two objectives coincide.
"""
from __future__ import annotations

from typing import Callable, Sequence

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import tree_utils as otu

from jaxrl_cache.checks import as_count, as_real
from jaxrl_cache.rollout.types import RolloutBatch
from jaxrl_cache.errors import StalenessError, VersionError
from jaxrl_cache.models.llama import ModelConfig, forward
from jaxrl_cache.rollout.sampling import behavior_log_probs
from jaxrl_cache.shapes import bucket
from jaxrl_cache.versioning import MAX_VERSION, as_version

CORRECTIONS = ("none", "decoupled")


@functools.lru_cache(maxsize=None)
def make_optimizer(*, weight_decay: float = 0.0, max_grad_norm: float = 1.0,
                   b1: float = 0.9, b2: float = 0.99) -> optax.GradientTransformation:
    """The learning-rate-free optimizer direction used by `train_step`.

    Memoised: equal hyperparameters give the very same transformation, so a re-created
    TrainState does not retrace the train step (jit keys static optax objects by identity).
    """
    return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                       optax.scale_by_adam(b1=b1, b2=b2),
                       optax.add_decayed_weights(weight_decay))


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
            as_real(lr_schedule, "lr_schedule"))
        opt_state = tx.init(params)
        if otu.tree_get_all_with_path(opt_state, "count"):
            opt_state = otu.tree_set(opt_state, count=jnp.asarray(version, jnp.int32))
        return cls(params=params, opt_state=opt_state, version=jnp.asarray(version, jnp.int32),
                   tx=tx, lr_schedule=schedule, config=config)


@flax.struct.dataclass
class TrainBatch:
    tokens: jax.Array  # int32 [N, L] prompt + output, right-padded; N bucketed (pad rows
    #                    have an all-zero loss_mask)
    loss_mask: jax.Array  # f32 [N, L-1] 1 where position t predicts an output token t+1
    behavior_logprobs: jax.Array  # f32 [N, L-1] aligned with targets tokens[:, 1:]
    advantages: jax.Array  # f32 [N]
    behavior_version: jax.Array  # int32 [N] each sample's oldest token version (staleness is
    #                            measured from it; = Sample.behavior_version when synchronous);
    #                            replicated on a mesh: train_step reads it on the host
    token_versions: jax.Array  # int32 [N, L-1] version that sampled the token position t
    #                            predicts (loss positions); elsewhere the row's oldest version
    temperature: jax.Array  # f32 []
    top_p: jax.Array  # f32 []
    top_k: jax.Array  # int32 []


def group_advantages(rewards: np.ndarray, groups: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GRPO: (r - group mean) / (group std + eps). rewards, groups [N] -> [N]."""
    rewards = np.asarray(rewards, np.float64)
    out = np.zeros_like(rewards)
    for g in np.unique(groups):
        idx = groups == g
        r = rewards[idx]
        out[idx] = (r - r.mean()) / (r.std() + eps)
    return out.astype(np.float32)


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


MAX_LENGTH = 2**20  # tokens per packed sequence (a dense [N, L] batch beyond it cannot fit)


def pack_samples(samples, length: int | None = None):
    """Right-padded prompt + output tokens of each sample, aligned for next-token scoring.

    Returns tokens int32 [R, L]; mask f32 [R, L-1] (1 where position t predicts an output
    token t+1); behavior f32 [R, L-1] (the recorded logprobs at those positions); versions
    int32 [R, L-1] (the version that sampled each output token; elsewhere the row's oldest
    version, and on padding rows the newest sample's oldest version). Rows past the N samples
    are padding (mask 0). R = bucket(N) and L (default: the longest sample) rounded up to
    buckets, so batches of nearby sizes share one compilation.
    """
    longest = max(len(s.prompt_ids) + len(s.output_ids) for s in samples)
    length = length or bucket(longest, 64)
    if length < longest:
        raise ValueError(f"length {length} is shorter than the longest sample ({longest})")
    n = bucket(len(samples), 64)
    tokens = np.zeros((n, length), np.int32)
    mask = np.zeros((n, length - 1), np.float32)
    behavior = np.zeros((n, length - 1), np.float32)
    token_versions = [sample_token_versions(s, i) for i, s in enumerate(samples)]
    oldest = [int(v.min()) if v.size else s.behavior_version
              for s, v in zip(samples, token_versions)]
    versions = np.full((n, length - 1), max(oldest), np.int32)
    for i, s in enumerate(samples):
        p, o = len(s.prompt_ids), len(s.output_ids)
        tokens[i, :p + o] = s.prompt_ids + s.output_ids
        mask[i, p - 1:p - 1 + o] = 1.0
        behavior[i, p - 1:p - 1 + o] = s.output_logprobs
        versions[i] = oldest[i]
        versions[i, p - 1:p - 1 + o] = token_versions[i]
    return tokens, mask, behavior, versions


def make_batch(rollouts: RolloutBatch | Sequence[RolloutBatch], rewards, *,
               length: int | None = None) -> TrainBatch:
    """Samples of one or more rollout batches + scalar rewards [N] -> a TrainBatch.

    Groups (for advantages) are the n samples of one prompt of one rollout call. All batches
    must share sampling parameters. length: padded sequence length (default: the longest
    sample rounded up to a bucket, so repeated steps reuse one compilation). Per-token
    versions come from Sample.token_versions; a sample's behavior_version in the batch is its
    oldest token version.
    """
    if isinstance(rollouts, RolloutBatch):
        batches = [rollouts]
    elif isinstance(rollouts, (list, tuple)) and all(isinstance(b, RolloutBatch)
                                                     for b in rollouts):
        batches = list(rollouts)
    else:
        raise TypeError(f"rollouts must be a RolloutBatch or a list of them, got "
                        f"{type(rollouts).__name__}")
    if not batches:
        raise ValueError("make_batch needs at least one rollout batch")
    empty = [k for k, b in enumerate(batches) if not b.samples]
    if empty:
        raise ValueError(f"rollouts: batch {empty[0]} has no samples")
    if length is not None:
        length = as_count(length, "length", minimum=2, maximum=MAX_LENGTH)
    sp = batches[0].sampling
    if any(b.sampling != sp for b in batches):
        raise ValueError("all rollout batches of a training batch must share SamplingParams")
    samples = [s for b in batches for s in b.samples]
    groups = np.array([(k << 32) + s.group for k, b in enumerate(batches) for s in b.samples])
    try:
        rewards = np.asarray(rewards, np.float32)
    except (TypeError, ValueError):
        raise TypeError(f"rewards must be numbers [N={len(samples)}], got "
                        f"{type(rewards).__name__} {rewards!r:.80}") from None
    if rewards.shape != (len(samples),):
        raise ValueError(f"rewards must be [N={len(samples)}], got shape {rewards.shape}")
    if not np.isfinite(rewards).all():
        bad = int(np.flatnonzero(~np.isfinite(rewards))[0])
        raise ValueError(f"rewards must be finite, got rewards[{bad}] = {rewards[bad]}")
    tokens, mask, behavior, token_versions = pack_samples(samples, length)
    if not np.isfinite(behavior).all():
        bad = int(np.flatnonzero(~np.isfinite(behavior).all(axis=1))[0])
        raise ValueError(f"sample {bad} has non-finite behavior logprobs")
    rows = tokens.shape[0]  # padding rows: no loss tokens, no advantage, newest version
    advantages = np.zeros(rows, np.float32)
    advantages[:len(samples)] = group_advantages(rewards, groups)
    return TrainBatch(
        tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(mask),
        behavior_logprobs=jnp.asarray(behavior), advantages=jnp.asarray(advantages),
        behavior_version=jnp.asarray(token_versions.min(axis=1)),
        token_versions=jnp.asarray(token_versions),
        temperature=jnp.float32(sp.temperature), top_p=jnp.float32(sp.top_p),
        top_k=jnp.int32(sp.top_k))


def teacher_forced_log_probs(params, config, tokens, temperature, top_p, top_k):
    """tokens int32 [N, L] -> log-probs f32 [N, L-1] of each next token under the sampling
    distribution (see sampling.behavior_log_probs). Used by the loss and by the audit."""
    logits = forward(params, config, tokens)[:, :-1]
    logp = behavior_log_probs(logits, temperature, top_p, top_k)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def policy_log_probs(params, config, batch: TrainBatch):
    """Log-probs [N, L-1] of each next token under the batch's sampling distribution."""
    logp = teacher_forced_log_probs(params, config, batch.tokens, batch.temperature,
                                    batch.top_p, batch.top_k)
    return jnp.maximum(logp, -1e4)  # a token outside a new top-k/top-p gets ratio ~0, not NaN


def pg_loss(params, config, batch: TrainBatch, clip_eps, dual_clip, is_cap, correction: str):
    """PPO-clip surrogate, token-mean. clip_eps, is_cap f32 []; dual_clip f32 [] or None.

    correction "none": ratio = current/behavior. "decoupled": ratio = current/proximal and
    each token weighted by min(proximal/behavior, is_cap). The proximal policy is the params
    this loss is evaluated at (train_step applies one update per batch, at the params it was
    given), so its logprobs are the forward's own values without gradient: the ratio is 1 in
    value with the gradient of the current policy, and the weight carries the staleness.
    """
    logp = policy_log_probs(params, config, batch)
    proximal = jax.lax.stop_gradient(logp)
    weight = jnp.exp(proximal - batch.behavior_logprobs)  # [N, L-1] proximal / behavior
    mask = batch.loss_mask
    if correction == "decoupled":
        ratio = jnp.exp(logp - proximal)
        scale = jnp.minimum(weight, is_cap)
        truncated = (weight > is_cap) * mask
    else:
        ratio = jnp.exp(logp - batch.behavior_logprobs)
        scale, truncated = 1.0, jnp.zeros_like(mask)
    adv = batch.advantages[:, None]
    surrogate = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps))
    if dual_clip is not None:  # bounds the importance weight on negative advantages
        surrogate = jnp.where(adv < 0, jnp.minimum(surrogate, -dual_clip * adv), surrogate)
    tokens = jnp.maximum(mask.sum(), 1.0)
    loss = (scale * surrogate * mask).sum() / tokens
    clipped = (jnp.abs(ratio - 1) > clip_eps) * mask
    aux = dict(ratio_mean=(ratio * mask).sum() / tokens,
               ratio_max=jnp.where(mask > 0, ratio, 0).max(),
               clip_fraction=clipped.sum() / tokens, tokens=mask.sum(),
               is_weight_mean=(weight * mask).sum() / tokens,
               is_weight_max=jnp.where(mask > 0, weight, 0).max(),
               is_truncated_fraction=truncated.sum() / tokens)
    return loss, aux


@functools.partial(jax.jit, static_argnames=("tx", "config", "correction"))
def _train_core(params, opt_state, version, batch: TrainBatch, lr, clip_eps, dual_clip, is_cap,
                *, tx: optax.GradientTransformation, config: ModelConfig, correction: str):
    """version int32 []; lr, clip_eps, is_cap f32 []; dual_clip f32 [] or None. Every number
    is traced (new values never recompile); tx, config and correction are static."""
    (loss, aux), grads = jax.value_and_grad(pg_loss, has_aux=True)(
        params, config, batch, clip_eps, dual_clip, is_cap, correction)
    direction, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, jax.tree.map(lambda u: -lr * u, direction))
    mask = batch.loss_mask
    staleness = version - batch.token_versions  # [N, L-1] per output token
    metrics = dict(loss=loss, lr=lr, version=version + 1, grad_norm=optax.tree.norm(grads),
                   staleness_max=jnp.where(mask > 0, staleness, 0).max(),
                   staleness_mean=(staleness * mask).sum() / jnp.maximum(mask.sum(), 1.0),
                   newest_token_version=jnp.where(mask > 0, batch.token_versions, 0).max(),
                   **aux)
    return params, opt_state, version + 1, metrics


def train_step(state: TrainState, batch: TrainBatch, *, max_policy_lag: int | None = None,
               clip_eps: float = 0.2, dual_clip: float | None = None,
               correction: str = "none", is_cap: float = 2.0):
    """One optimizer update. Returns (state with version + 1, metrics).

    correction: "none" (PPO-clip against behavior) or "decoupled" (see module doc); is_cap
    (>= 1) truncates the decoupled importance weights. Metrics per output token: staleness
    (trainer version - token version) mean/max, importance weight proximal/behavior
    mean/max, the fraction truncated.

    Raises before any work: TypeError/ValueError for a malformed argument, a non-finite clip
    parameter (clip_eps > 0; dual_clip > 1 or None; is_cap >= 1) or learning rate at this
    version; VersionError if the version would pass the int32 range; StalenessError if a
    sample's oldest token version lags the state's version by more than max_policy_lag
    (None = no limit), or is newer than the state. Raises (returning nothing) StalenessError
    if a token's version is newer than the state, ValueError if the loss or gradient norm came
    out non-finite; the metrics are read on the host for these checks.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be a TrainState, got {type(state).__name__}")
    if not isinstance(batch, TrainBatch):
        raise TypeError(f"batch must be a TrainBatch (see make_batch), got "
                        f"{type(batch).__name__}")
    if max_policy_lag is not None:
        max_policy_lag = as_count(max_policy_lag, "max_policy_lag")
    clip_eps = as_real(clip_eps, "clip_eps", minimum=0.0, open_min=True)
    if not isinstance(correction, str):
        raise TypeError(f"correction must be a str, got {type(correction).__name__} "
                        f"{correction!r:.80}")
    if correction not in CORRECTIONS:
        raise ValueError(f"correction must be one of {CORRECTIONS}, got {correction!r:.80}")
    is_cap = as_real(is_cap, "is_cap", minimum=1.0)
    if dual_clip is not None:
        dual_clip = as_real(dual_clip, "dual_clip", minimum=1.0, open_min=True)
    version = as_version(state.version, "state.version")
    if version == MAX_VERSION:
        raise VersionError(f"state.version {version} is the largest int32 version; another "
                           f"update would overflow")
    lr = float(state.lr_schedule(version))
    if not np.isfinite(lr):
        raise ValueError(f"lr_schedule({version}) = {lr} is not finite")
    behavior = np.asarray(batch.behavior_version)  # [N] oldest token version of each sample
    oldest, newest = int(behavior.min()), int(behavior.max())
    if max_policy_lag is not None and version - oldest > max_policy_lag:
        raise StalenessError(
            f"batch sample {int(behavior.argmin())} has a token of version {oldest}, "
            f"{version - oldest} updates behind the trainer (version {version}); "
            f"max_policy_lag={max_policy_lag}")
    if newest > version:
        raise StalenessError(f"batch has samples from version {newest}, newer than the "
                             f"trainer ({version})")
    params, opt_state, new_version, metrics = _train_core(
        state.params, state.opt_state, state.version, batch, jnp.float32(lr),
        jnp.float32(clip_eps), None if dual_clip is None else jnp.float32(dual_clip),
        jnp.float32(is_cap), tx=state.tx, config=state.config, correction=correction)
    new_state = state.replace(params=params, opt_state=opt_state, version=new_version)
    loss, grad_norm, newest_token = jax.device_get(
        (metrics["loss"], metrics["grad_norm"], metrics["newest_token_version"]))
    if int(newest_token) > version:
        raise StalenessError(f"batch has a token of version {int(newest_token)}, newer than "
                             f"the trainer ({version})")
    loss, grad_norm = float(loss), float(grad_norm)
    if not (np.isfinite(loss) and np.isfinite(grad_norm)):
        raise ValueError(f"train step at version {version} produced loss {loss}, gradient "
                         f"norm {grad_norm}; refusing to return non-finite params")
    return new_state, metrics
