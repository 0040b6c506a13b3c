"""Policy versions through training: TrainState, the optimizer and the jitted train step.

The version is the number of optimizer updates applied. `train_step` applies
`mini_batches x epochs` updates to one batch and returns the version advanced by that many;
update k is evaluated with the learning rate schedule(version before it) (optax's
convention), so lr(update k) = schedule(k) for k = 0, 1, 2, ... The optimizer `tx` is the
learning-rate-free direction (e.g. `make_optimizer()`: clip, Adam, weight decay); the step
scales its output by -schedule(version). Every `count` inside the optimizer state equals the
version at all times; checkpoints verify it.

Each update accumulates gradients over the batch's packed micro-batches (rl/batch.py) in one
jitted scan (no host round trip), skipping a micro-batch of padding alone (the room the shape
reserves for longer samples); a micro-batch's log-probs come from one forward
(rl/logprobs.py), which feeds both the loss (rl/loss.py) and the in-step audit
(rl/audit.py). Memory: rl/memory.py.

Numbers: versions stay in the int32 range (`versioning.MAX_VERSION`); a step that would pass
it is refused. Non-finite rewards, behavior logprobs, clip parameters or negative /
non-finite learning rates are refused before any work, and a step whose loss or gradient norm
is not finite raises (`NonFiniteUpdate`, carrying the unchanged state) instead of returning
NaN params.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
from optax import tree_utils as otu

from jaxrl_cache.checks import as_real
from jaxrl_cache.distribution import excludes_tokens
from jaxrl_cache.errors import StalenessError, VersionError
from jaxrl_cache.models.config import ModelConfig
from jaxrl_cache.models.lora import (LoraConfig, attach as attach_adapters, check_adapters,
                                     frozen_part as lora_frozen_part, init_adapters)
from jaxrl_cache.parallel.mesh import DATA, FSDP
from jaxrl_cache.rl.audit import AUDIT_MAXED, step_audit_sums
from jaxrl_cache.rl.batch import TrainBatch, pack_batch
from jaxrl_cache.rl.logprobs import knobs_of, token_log_probs
from jaxrl_cache.rl.loss import MAXED, policy_loss
from jaxrl_cache.rl.memory import (TrainMemoryError, available_bytes, check_memory,
                                   resolve_remat)
from jaxrl_cache.rl.packing import PackedBatch
from jaxrl_cache.rl.train_config import TrainConfig
from jaxrl_cache.versioning import MAX_VERSION, as_version
from kernels_pallas import kernel_keyed_jit


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


def _check_adapters_fit(config: ModelConfig, lora: LoraConfig) -> None:
    """TrainMemoryError (one line) when fresh adapters and their optimizer state (params,
    Adam's two moments, a gradient: 4x) exceed the available memory, before allocating."""
    shapes = jax.eval_shape(lambda: init_adapters(config, lora, jax.random.key(0)))  # no memory
    need = 4 * sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    have = available_bytes()
    if have is not None and need > have:
        raise TrainMemoryError(f"LoRA rank {lora.rank}: the adapters and their optimizer "
                               f"state need ~{need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB "
                               f"available; a smaller rank or fewer targets")


@flax.struct.dataclass
class TrainState:
    """params: what the optimizer trains (the whole model, or with `lora` only the
    adapters, `models.lora`); frozen: with `lora`, the base weights plus the LoRA scale,
    never updated, copied or donated (the engine may hold the very same arrays).
    `model_params` is what the model runs."""
    params: dict
    opt_state: optax.OptState
    version: jax.Array  # int32 [] = optimizer updates applied
    tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
    lr_schedule: Callable = flax.struct.field(pytree_node=False)
    config: ModelConfig = flax.struct.field(pytree_node=False)
    frozen: dict | None = None
    lora: LoraConfig | None = flax.struct.field(pytree_node=False, default=None)

    @classmethod
    def create(cls, params, tx: optax.GradientTransformation | None = None, *,
               config: ModelConfig, lr_schedule: Callable | float = 1e-3,
               version=0, lora: LoraConfig | None = None, adapters: dict | None = None,
               rng: jax.Array | None = None) -> "TrainState":
        """A fresh optimizer state at `version` (its counts set to that version).

        lora: train adapters over `params` as the frozen base: `adapters` (e.g. restored),
        or fresh ones from `rng` (default key 0; B = 0, so version 0 is the base exactly).
        """
        version = as_version(version)
        tx = tx or make_optimizer()
        schedule = lr_schedule if callable(lr_schedule) else optax.constant_schedule(
            as_real(lr_schedule, "lr_schedule", minimum=0.0))
        frozen = None
        if lora is not None:
            if not isinstance(lora, LoraConfig):
                raise TypeError(f"lora must be a LoraConfig, got {type(lora).__name__}")
            frozen = lora_frozen_part(params, lora)
            if adapters is None:
                _check_adapters_fit(config, lora)
                adapters = init_adapters(config, lora, jax.random.key(0) if rng is None else rng)
            check_adapters(config, adapters)
            params = adapters
        elif adapters is not None:
            raise ValueError("adapters given without lora (a LoraConfig)")
        opt_state = tx.init(params)
        if otu.tree_get_all_with_path(opt_state, "count"):
            opt_state = otu.tree_set(opt_state, count=jnp.asarray(version, jnp.int32))
        return cls(params=params, opt_state=opt_state, version=jnp.asarray(version, jnp.int32),
                   tx=tx, lr_schedule=schedule, config=config, frozen=frozen, lora=lora)

    @property
    def model_params(self) -> dict:
        """The params the model runs: base + adapters (no copy) under LoRA, else params."""
        return _model(self.params, self.frozen)


def _model(params, frozen):
    return params if frozen is None else attach_adapters(frozen, params)


class NonFiniteUpdate(ValueError):
    """An update produced a non-finite loss or gradient norm; `.state` is the input state,
    unchanged (usable even when the step donated its buffers)."""

    def __init__(self, message: str, state):
        super().__init__(message)
        self.state = state


class AttributionFailure(ValueError):
    """The step's own audit found a token off its recorded log-prob under the params that
    claim to have sampled it; `.state` is the input state, unchanged (no update applied)."""

    def __init__(self, message: str, state):
        super().__init__(message)
        self.state = state


def _compute_params(params, cfg: TrainConfig):
    """params in cfg.compute_dtype; the stacked layers stay as they are (the layer scan
    casts each layer: `models.llama._decoder`)."""
    if cfg.compute_dtype == "float32":
        return params
    cast = jax.tree.map(lambda x: x.astype(cfg.compute_dtype)
                        if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        {k: v for k, v in params.items() if k != "layers"})
    return {**cast, "layers": params["layers"]}  # cast per layer inside the scan


def _micro_log_probs(params, frozen, config, mb: PackedBatch, knobs, kind, cfg: TrainConfig,
                     entropy: bool = False):
    """Log-probs [B, R] of each scored position's target, 0 elsewhere (clamped at -1e4: a
    token outside a new top-k/top-p set gets ratio ~0, not NaN); entropy: (log-probs,
    entropies [B, R] of the warped distribution, differentiated when cfg.entropy_coef > 0)."""
    out = token_log_probs(_compute_params(_model(params, frozen), cfg), config, mb.tokens,
                          mb.targets, knobs, kind=kind, positions=mb.positions,
                          segments=mb.segments, parents=mb.parents,
                          kv_blocks=mb.kv_blocks, items=mb.items, columns=mb.columns,
                          sources=mb.sources,
                          remat=cfg.remat,
                          chunk=cfg.logprob_chunk, scored=mb.scored,
                          entropy=("grad" if cfg.entropy_coef > 0 else "metric") if entropy
                          else None)
    return (jnp.maximum(out[0], -1e4), out[1]) if entropy else jnp.maximum(out, -1e4)


@kernel_keyed_jit(static_argnames=("config", "kind", "cfg"))
def _score(params, frozen, packed: PackedBatch, knobs, *, config, kind, cfg: TrainConfig):
    """Log-probs [U, M, B, R] of every target under `params`, no gradient (the proximal
    policy, the reference policy)."""
    def one(_, mb):
        logp = jax.lax.cond(  # a micro-batch of padding alone scores nothing: skipped
            jnp.any(mb.weights > 0),
            lambda: _micro_log_probs(params, frozen, config, mb, knobs, kind, cfg),
            lambda: jnp.zeros(mb.tokens.shape, jnp.float32))
        return None, jax.lax.stop_gradient(logp)
    flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), packed)
    _, logp = jax.lax.scan(one, None, flat)
    return logp.reshape(packed.tokens.shape)


@kernel_keyed_jit(static_argnames=("config", "kind", "cfg"))
def _version_audit(params, packed: PackedBatch, knobs, version, *, config, kind,
                   cfg: TrainConfig):
    """The audit sums (`step_audit_sums`, maxed / summed over micro-batches) of the tokens
    of `version` (int32 []) under `params`, that version's model params: forward only, one
    pass over the packed batch [U, M, B, R], a micro-batch holding none of them skipped."""
    flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), packed)

    def sums_of(mb):
        logp = _micro_log_probs(params, None, config, mb, knobs, kind, cfg)
        return step_audit_sums(logp, mb.behavior, mb.audited > 0, mb.versions, version)

    zero = jax.eval_shape(sums_of, jax.tree.map(lambda x: x[0], flat))
    zero = {k: jnp.zeros(v.shape, v.dtype) for k, v in zero.items()}

    def one(total, mb):
        s = jax.lax.cond(jnp.any((mb.audited > 0) & (mb.versions == version)),
                         sums_of, lambda _: zero, mb)
        return {k: jnp.maximum(total[k], v) if k in AUDIT_MAXED else total[k] + v
                for k, v in s.items()}, None

    return jax.lax.scan(one, zero, flat)[0]


def _micro_loss(params, frozen, config, mb: PackedBatch, proximal, ref, knobs, kind, version,
                nums, cfg: TrainConfig):
    """(the micro-batch's loss, its metric sums): the policy loss (rl/loss.py) and the audit
    of the tokens these very params sampled (rl/audit.py), on one forward's log-probs, and
    the entropy sum over the trained tokens (a health metric; with cfg.entropy_coef > 0 also
    the loss's entropy bonus).

    Entropy is taken here, not in the sampler: this forward already has each chunk's warped
    logits, so it costs one fused reduction and no host traffic, and it leaves the decode
    program (whose recorded log-prob bits the audit compares) untouched. It is the entropy of
    the trainer's distribution at each sampled token; in the first update of a synchronous
    step those are the very params that sampled them."""
    logp, entropy = _micro_log_probs(params, frozen, config, mb, knobs, kind, cfg, entropy=True)
    loss, sums = policy_loss(
        logp, mb.behavior, mb.weights, mb.advantages, mb.versions, version, proximal=proximal,
        ref=ref, nums=nums, correction=cfg.correction,
        segments=mb.segments if cfg.importance_sampling_level == "sequence" else None,
        entropy=entropy if cfg.entropy_coef > 0 else None)
    audit = step_audit_sums(jax.lax.stop_gradient(logp), mb.behavior, mb.audited > 0,
                            mb.versions, version)
    return loss, {**sums, **audit, "entropy": jnp.where(mb.weights > 0, entropy, 0.0).sum()}


_MAXED = MAXED + AUDIT_MAXED


def _gradients(params, frozen, config, part: PackedBatch, proximal, ref, knobs, kind, version,
               nums, cfg: TrainConfig):
    """(gradients, loss, metric sums) of a part's micro-batches [M, ...], accumulated in a
    scan; a part of one micro-batch takes its gradient directly (no zeroed accumulator)."""
    grad_fn = jax.value_and_grad(_micro_loss, has_aux=True)
    take = lambda t: None if t is None else jax.tree.map(lambda x: x[0], t)  # noqa: E731
    if part.tokens.shape[0] == 1:
        (loss, sums), grads = grad_fn(params, frozen, config, take(part), take(proximal),
                                      take(ref), knobs, kind, version, nums, cfg)
        return grads, loss, sums

    zeros = jax.tree.map(jnp.zeros_like, params)
    first = jax.eval_shape(lambda: _micro_loss(params, frozen, config, take(part),
                                               take(proximal), take(ref), knobs, kind, version,
                                               nums, cfg)[1])
    sums0 = {k: jnp.zeros(v.shape, v.dtype) for k, v in first.items()}

    def micro(carry, xs):
        grads, loss, sums = carry
        mb, prox, rf = xs

        def run(_):
            (l, s), g = grad_fn(params, frozen, config, mb, prox, rf, knobs, kind, version,
                                nums, cfg)
            return g, l, s

        # a micro-batch of padding alone (the plan reserves room the sampled lengths did
        # not take: rl/packing.py) adds exact zeros: skipped
        g, l, s = jax.lax.cond(jnp.any((mb.weights > 0) | (mb.audited > 0)), run,
                               lambda _: (zeros, jnp.float32(0), sums0), None)
        sums = {k: jnp.maximum(sums[k], v) if k in _MAXED else sums[k] + v
                for k, v in s.items()}
        return (jax.tree.map(jnp.add, grads, g), loss + l, sums), None

    (grads, loss, sums), _ = jax.lax.scan(micro, (zeros, jnp.float32(0), sums0),
                                          (part, proximal, ref))
    return grads, loss, sums


def _update(params, opt_state, frozen, version, part: PackedBatch, proximal, ref, knobs, lr,
            nums, tolerance, *, tx, config, kind, cfg: TrainConfig):
    """One optimizer update on a part's micro-batches [M, ...]. It is applied only when its
    loss and gradient norm are finite and no audited token is more than `tolerance` off its
    record; otherwise params and optimizer state pass through unchanged. The choice is a
    `lax.cond`, so the update runs in place in donated buffers (a select between old and new
    state would keep both live)."""
    if cfg.entropy_coef > 0:  # the entropy bonus is a token mean over the mini-batch
        nums = dict(nums, entropy_norm=1.0 / jnp.maximum(jnp.sum(part.weights > 0), 1))
    grads, loss, sums = _gradients(params, frozen, config, part, proximal, ref, knobs, kind,
                                   version, nums, cfg)
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
                   entropy=sums["entropy"] / tokens,
                   staleness_mean=sums["staleness"] / tokens,
                   staleness_max=sums["staleness_max"], newest_token_version=sums["newest"],
                   audit_diff_max=sums["audit_diff_max"], audit_diff_sum=sums["audit_diff_sum"],
                   audit_kl_sum=sums["audit_kl_sum"], audit_checked_tokens=sums["audit_tokens"])
    return params, opt_state, metrics


def _train_core(params, opt_state, frozen, version, packed: PackedBatch, proximal, ref, knobs,
                lrs, nums, tolerance, *, tx, config, kind, cfg: TrainConfig):
    """cfg.updates updates of params (frozen: the LoRA base and scale, or None); lrs f32 [updates]; tolerance f32 [] (inf: no audit gate).
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
        p, s, m = _update(p, s, frozen, v, take(packed), take(proximal), take(ref), knobs,
                          lrs[i], nums, tolerance, tx=tx, config=config, kind=kind, cfg=cfg)
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


def step_numbers(cfg: TrainConfig) -> dict:
    """The config's traced numbers (rl/loss.py's nums): new values compile nothing."""
    return dict(clip_eps=jnp.float32(cfg.clip_eps), clip_high=jnp.float32(cfg.clip_high),
                is_cap=jnp.float32(cfg.is_cap), kl_beta=jnp.float32(cfg.kl_beta),
                entropy_coef=jnp.float32(cfg.entropy_coef),
                dual_clip=None if cfg.dual_clip is None else jnp.float32(cfg.dual_clip))


def _structure(cfg: TrainConfig) -> TrainConfig:
    """The part of a config that shapes the program (numbers are traced: new values compile
    nothing)."""
    return dataclasses.replace(cfg, clip_eps=0.2, is_cap=2.0, kl_beta=float(cfg.kl_beta > 0),
                               dual_clip=None if cfg.dual_clip is None else 2.0,
                               epsilon_high=None, entropy_coef=float(cfg.entropy_coef > 0),
                               mask_truncated_completions=False, max_policy_lag=None,
                               donate=False)


_STATIC = ("tx", "config", "kind", "cfg")
_train_jit = kernel_keyed_jit(_train_core, static_argnames=_STATIC)
_train_jit_donating = kernel_keyed_jit(_train_core, static_argnames=_STATIC,
                                       donate_argnums=(0, 1))
_train_jit_donating_optimizer = kernel_keyed_jit(_train_core, static_argnames=_STATIC,
                                                 donate_argnums=(1,))
TRAIN_JITS = {False: _train_jit, True: _train_jit_donating,  # by TrainConfig.donate
              "optimizer": _train_jit_donating_optimizer}


def _summary(metrics: dict, version: int, updates: int, scored: dict | None = None) -> dict:
    """Scalars over the updates: means, maxima of the *_max keys, the last lr; per-update
    arrays under "per_update"; the audit counts include `scored` (`_audit_versions`). All
    stay on device."""
    out = {k: (v.max() if k.endswith("_max") or k == "newest_token_version" else
               v.sum() if k.startswith("audit_") else v.mean())
           for k, v in metrics.items()}
    if scored is not None:
        out.update(audit_diff_max=jnp.maximum(out["audit_diff_max"], scored["audit_diff_max"]),
                   audit_diff_sum=out["audit_diff_sum"] + scored["audit_diff_sum"],
                   audit_kl_sum=out["audit_kl_sum"] + scored["audit_kl_sum"],
                   audit_checked_tokens=out["audit_checked_tokens"] + scored["audit_tokens"])
    checked = jnp.maximum(out["audit_checked_tokens"], 1)
    out.update(logprob_mismatch_max=out["audit_diff_max"],  # the sampler/trainer mismatch
               logprob_mismatch_mean=out.pop("audit_diff_sum") / checked,
               logprob_mismatch_kl=out.pop("audit_kl_sum") / checked)
    out.update(lr=metrics["lr"][-1], version=jnp.int32(version + updates), updates=updates,
               per_update=metrics)
    return out


def train_step(state: TrainState, batch: TrainBatch, config: TrainConfig | None = None, *,
               ref_params=None, mesh=None, audit_tolerance: float | None = None,
               audit_params: dict | None = None, **options):
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
    state) is raised. audit_params: {version: that version's model params} for tokens the
    first update does not check itself (older versions' tokens in asynchronous RL; this
    version's past the first mini-batch): before any update the step scores them, forward
    only, on the same packed micro-batches (no separate layout, no padding to a grid), and
    counts them in the same metrics, gated at audit_tolerance the same way. The dict is
    emptied once they are scored, so those params are not kept alive through the update by
    it. Under compute_dtype="bfloat16" the recorded log-probs are reproduced
    exactly when the sampler ran the bf16 cast of the params (an engine whose
    ModelConfig.dtype is "bfloat16"); from fp32 sampling they differ by bf16 rounding.

    Metrics (device arrays, read by the caller when it wants them): loss, grad_norm,
    ratio/clip/importance-weight statistics, staleness (trainer version - token version)
    mean/max, kl, entropy (mean over sampled tokens of the warped distribution's entropy,
    nats), averaged over the updates (maxima for *_max), lr of the last update,
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
    cfg, version, lrs, audit_tolerance = _checked_arguments(state, batch, config, options,
                                                            ref_params, audit_tolerance)
    _check_audit_params(audit_params, version)
    ways = 1 if mesh is None else math.prod(mesh.shape[a] for a in (DATA, FSDP)
                                             if a in mesh.shape)
    packed = pack_batch(batch, cfg, row_multiple=ways)
    length = packed.tokens.shape[-1]
    cfg = resolve_remat(state.config, cfg, row_length=length, lora=state.lora)
    check_memory(state.config, cfg, length, lora=state.lora)
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
            proximal = _score(state.params, state.frozen, packed, knobs, **statics)
        if cfg.kl_beta > 0:
            ref = _score(ref_params, None, packed, knobs, **statics)
        tolerance = jnp.float32(np.inf if audit_tolerance is None else audit_tolerance)
        scored = _audit_versions(state, audit_params, packed, knobs, tolerance, statics)
        nums = step_numbers(cfg)
        core = TRAIN_JITS[cfg.donate]
        params, opt_state, new_version, metrics, finite, attributed = core(
            state.params, state.opt_state, state.frozen, state.version, packed, proximal, ref,
            knobs, jnp.asarray(lrs, jnp.float32), nums, tolerance, tx=state.tx, **statics)
    new_state = state.replace(params=params, opt_state=opt_state, version=new_version)
    if layout is not None:
        new_state = jax.device_put(new_state, layout)
    _refuse_failed(new_state, metrics, finite, attributed, version, audit_tolerance)
    return new_state, _summary(metrics, version, cfg.updates, scored)


def _refuse_failed(new_state, metrics, finite, attributed, version: int, audit_tolerance):
    """NonFiniteUpdate / AttributionFailure (carrying `new_state`, the input state passed
    through unchanged) when the core refused its update."""
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


def _audit_versions(state, audit_params: dict | None, packed, knobs, tolerance, statics):
    """train_step's scoring of `audit_params` (see there): their audit sums, summed / maxed
    over the versions (None without any); AttributionFailure (the state unchanged, nothing
    applied) when a token is more than `tolerance` off. Empties audit_params once scored."""
    if not audit_params:
        return None
    sums = [_version_audit(params, packed, knobs, jnp.int32(v), **statics)
            for v, params in sorted(audit_params.items())]
    total = {k: (jnp.max if k in AUDIT_MAXED else jnp.sum)(jnp.stack([s[k] for s in sums]))
             for k in sums[0]}
    worst = float(total["audit_diff_max"])  # the gate: read before the update is dispatched
    if not worst <= float(tolerance):
        raise AttributionFailure(f"train step at version {int(state.version)}: a token of "
                                 f"version(s) {sorted(audit_params)} is {worst:.3g} off its "
                                 f"recorded log-prob (tolerance {float(tolerance):g}); no "
                                 f"update applied", state)
    audit_params.clear()
    return total


def _check_audit_params(audit_params, version: int) -> None:
    """TypeError / ValueError (one line) for audit_params that is not a dict of versions
    up to the state's."""
    if audit_params is None:
        return
    if not isinstance(audit_params, dict):
        raise TypeError(f"audit_params must be a dict version -> params (it is emptied once "
                        f"scored), got {type(audit_params).__name__}")
    for v in audit_params:
        if as_version(v, "audit_params version") > version:
            raise ValueError(f"audit_params has version {v}, newer than the state's "
                             f"({version}): no token of it can be in the batch")


def _checked_arguments(state, batch, config, options: dict, ref_params, audit_tolerance):
    """train_step's checks before any work (see its Raises): (the config with `options`
    applied, the state's version, the learning rate of each update, the tolerance)."""
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
    if cfg.kl_beta > 0 and excludes_tokens(knobs_of(batch.sampling,
                                                    state.config.vocab_size)[1]):
        raise ValueError("kl_beta > 0 with top-k / top-p sampling (or min-p): the reference "
                         "scores a token outside its own top-k / top-p / min-p set at -inf, "
                         "so the k3 KL is infinite; sample without top_k / top_p / min_p or "
                         "set kl_beta=0")
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
    return cfg, version, lrs, audit_tolerance
