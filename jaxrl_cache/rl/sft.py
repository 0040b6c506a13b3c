"""Supervised warm start: teacher-forced cross-entropy on reference completions.

Real pipelines start RL from a supervised model (SFT -> RL). `sft_step` is one optimizer
update of the token-mean next-token cross-entropy over the completion tokens only; it is a
pure jitted function of (params, opt_state, batch), so a new batch never recompiles.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_cache.models import ModelConfig
from jaxrl_cache.rl.logprobs import token_log_probs
from jaxrl_cache.shapes import bucket
from kernels_pallas import kernel_keyed_jit


def pack_completions(prompts, completions, length: int | None = None):
    """Token-id prompts and completions -> (tokens int32 [N, L], loss_mask f32 [N, L-1]).

    tokens are prompt + completion, right-padded with 0; loss_mask[i, t] is 1 where position t
    predicts a completion token t+1. length defaults to the longest row rounded up to a bucket.
    """
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(f"need as many completions as prompts (>= 1), got {len(prompts)} "
                         f"prompts and {len(completions)} completions")
    longest = max(len(p) + len(c) for p, c in zip(prompts, completions))
    length = length or bucket(longest, 64)
    if length < longest:
        raise ValueError(f"length {length} is shorter than the longest row ({longest})")
    tokens = np.zeros((len(prompts), length), np.int32)
    mask = np.zeros((len(prompts), length - 1), np.float32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        if not p or not c:
            raise ValueError(f"row {i}: prompt and completion must both be non-empty")
        tokens[i, :len(p) + len(c)] = list(p) + list(c)
        mask[i, len(p) - 1:len(p) - 1 + len(c)] = 1.0
    return tokens, mask


_PLAIN = dict(temperature=jnp.float32(1.0), top_p=jnp.float32(1.0), top_k=jnp.int32(0))


def sft_loss(params, config: ModelConfig, tokens, loss_mask):
    """Token-mean cross-entropy. tokens int32 [N, L]; loss_mask f32 [N, L-1] -> f32 [].
    Chunked log-probs (rl.logprobs) over a rematerialised layer scan."""
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    logp = token_log_probs(params, config, tokens, targets, _PLAIN, kind="none",
                           remat="full")[:, :-1]
    return -(logp * loss_mask).sum() / jnp.maximum(loss_mask.sum(), 1.0)


@kernel_keyed_jit(static_argnames=("config", "tx"))
def sft_step(params, opt_state, tokens, loss_mask, *, config: ModelConfig,
             tx: optax.GradientTransformation):
    """One update of `tx` (with its learning rate) on sft_loss -> (params', opt_state', loss).

    tokens int32 [N, L]; loss_mask f32 [N, L-1]. `tx` is static and hashed by identity: build
    it once per run.
    """
    loss, grads = jax.value_and_grad(sft_loss)(params, config, tokens, loss_mask)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
