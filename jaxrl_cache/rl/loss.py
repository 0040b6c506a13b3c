"""The clipped policy-gradient loss as a pure function of log-probs, masks and advantages
(verl's `compute_policy_loss` boundary: the model never enters it).

Off-policy correction (`correction="decoupled"`, decoupled PPO as in AReaL): three policies,
behavior (each token's recorded logprob, sampled by its own version), proximal (the
trainer's params before the first update of this batch, scored once, no gradient) and
current. The clipped ratio is current/proximal and each token's surrogate is weighted by
min(proximal/behavior, is_cap). `correction="none"` is plain PPO-clip with the ratio against
behavior. Both read the sampler's own distribution (`distribution.warped_logits`), so on fresh
samples proximal == behavior and, at the first update, the two objectives coincide.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

MAXED = ("ratio_max", "is_weight_max", "staleness_max", "newest")  # metric sums taken as max


def sequence_means(x, mask, segments):
    """x f32 [B, R], mask bool [B, R], segments int32 [B, R] (a packed row's sequence ids, each
    < R) -> f32 [B, R]: at each position, the mean of x over the masked positions of its
    sequence (0 where it has none)."""
    width = x.shape[-1]

    def row(v, m, s):
        total = jax.ops.segment_sum(jnp.where(m, v, 0.0), s, num_segments=width)
        count = jax.ops.segment_sum(m.astype(jnp.float32), s, num_segments=width)
        return (total / jnp.maximum(count, 1.0))[s]

    return jax.vmap(row)(x, mask, segments)


def policy_loss(logp, behavior, weights, advantages, versions, version, *, proximal=None,
                ref=None, nums: dict, correction: str = "none", segments=None, entropy=None):
    """(sum over tokens of weight x token loss [- entropy bonus], metric sums).

    logp f32 [...]: the current policy's log-prob of each target (differentiated);
    behavior f32 [...]: the recorded ones; weights f32 [...]: each token's share of its
    mini-batch's loss, > 0 exactly on trained tokens; advantages f32 [...]; versions int32
    [...]: each token's sampling version; version int32 []: the trainer's; proximal, ref
    f32 [...] or None (proximal None: this update's params, no gradient); nums: clip_eps,
    clip_high, is_cap, kl_beta f32 [], dual_clip f32 [] or None, and with `entropy`
    entropy_coef and entropy_norm (1 / the mini-batch's trained tokens) f32 [].
    correction: "none" or "decoupled". The ratio is clipped to [1 - clip_eps, 1 + clip_high].
    segments int32 [B, R] (packed sequence ids) or None: given, importance sampling is at
    sequence level (TRL's GSPO): each token's log-ratio is its sequence's mean log-ratio over
    its trained tokens, differentiated through every one of them (as TRL). entropy f32 [...]
    or None: the sampling distribution's entropy at each token; given, the loss subtracts
    entropy_coef x entropy_norm x its sum over trained tokens (TRL's entropy bonus, a token
    mean over the mini-batch).
    The sums (tokens, ratio, clipped, importance weights, kl, staleness; the MAXED keys as
    maxima) are reduced by the caller over micro-batches.
    """
    mask = weights > 0
    on = lambda x: jnp.where(mask, x, 0.0)  # noqa: E731 (log-ratios at masked positions)
    prox = jax.lax.stop_gradient(logp) if proximal is None else proximal
    is_weight = jnp.exp(on(prox - behavior))  # proximal / behavior
    log_ratio = on(logp - (prox if correction == "decoupled" else behavior))
    if segments is not None:
        log_ratio = on(sequence_means(log_ratio, mask, segments))
    ratio = jnp.exp(log_ratio)
    if correction == "decoupled":
        scale = jnp.minimum(is_weight, nums["is_cap"])
        truncated = (is_weight > nums["is_cap"]) & mask
    else:
        scale, truncated = 1.0, jnp.zeros_like(mask)
    clip_eps, clip_high, dual_clip = nums["clip_eps"], nums["clip_high"], nums["dual_clip"]
    surrogate = jnp.maximum(-advantages * ratio,
                            -advantages * jnp.clip(ratio, 1 - clip_eps, 1 + clip_high))
    if dual_clip is not None:
        surrogate = jnp.where(advantages < 0, jnp.minimum(surrogate, -dual_clip * advantages),
                              surrogate)
    token_loss = scale * surrogate
    kl = jnp.zeros_like(logp)
    if ref is not None:  # k3: exp(ref - logp) - (ref - logp) - 1 >= 0
        delta = on(ref - logp)
        kl = jnp.exp(delta) - delta - 1.0
        token_loss = token_loss + nums["kl_beta"] * kl
    staleness = version - versions
    sums = dict(tokens=mask.sum(), ratio=on(ratio).sum(),
                ratio_max=jnp.where(mask, ratio, 0).max(),
                clipped=(((ratio - 1 > clip_high) | (1 - ratio > clip_eps)) & mask).sum(),
                is_weight=on(is_weight).sum(), is_weight_max=jnp.where(mask, is_weight, 0).max(),
                truncated=truncated.sum(), kl=on(kl).sum(), staleness=on(staleness).sum(),
                staleness_max=jnp.where(mask, staleness, 0).max(),
                newest=jnp.where(mask, versions, 0).max())
    loss = (weights * token_loss).sum()
    if entropy is not None:
        loss = loss - nums["entropy_coef"] * nums["entropy_norm"] * on(entropy).sum()
    return loss, sums
