"""Jitted numeric core of the rollout engine: paged prefill and the on-device decode loop.

Both take params as arguments (a weight update never recompiles) and donate the KV pool.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_cache.models import ModelConfig, copy_pages, decode_forward, prefill_forward
from jaxrl_cache.rollout.sampling import sample_tokens


@functools.partial(jax.jit, static_argnames=("config", "backend"), donate_argnames=("kv_cache",))
def prefill_step(params, kv_cache, tokens, token_seq, token_pos, page_table, cu_q_lens, kv_lens,
                 logit_index, *, config: ModelConfig, backend: str):
    """Shapes as `model.prefill_forward`; returns (last-token logits [S, V], kv_cache')."""
    return prefill_forward(params, config, kv_cache, tokens, token_seq, token_pos, page_table,
                           cu_q_lens, kv_lens, logit_index, backend=backend)


@functools.partial(jax.jit, static_argnames=("config", "backend", "max_new_tokens"),
                   donate_argnames=("kv_cache",))
def decode_loop(params, kv_cache, group_logits, row_group, row_pos, page_table, copy_src,
                copy_dst, stop_ids, temperature, top_p, top_k, key, *, config: ModelConfig,
                backend: str, max_new_tokens: int):
    """Samples up to max_new_tokens per row entirely on device.

    group_logits f32 [S, V] last prompt-token logits per group; row_group int32 [B] (-1 =
    padding row); row_pos int32 [B] position of the first generated token (= prompt length);
    page_table int32 [B, W]; copy_src, copy_dst int32 [C] pages to duplicate first (a group's
    partial last prompt page into each sample's own page); stop_ids int32 [K] (-1 = none).
    Returns (tokens int32 [B, M], logprobs f32 [B, M], lengths int32 [B], stopped bool [B],
    steps int32 [], kv_cache').
    """
    kv_cache = copy_pages(kv_cache, copy_src, copy_dst)
    batch, m = row_group.shape[0], max_new_tokens
    active = row_group >= 0
    key, sub = jax.random.split(key)
    tok, logp = sample_tokens(group_logits[jnp.maximum(row_group, 0)], sub, temperature, top_p,
                              top_k)
    out_tok = jnp.zeros((batch, m), jnp.int32).at[:, 0].set(jnp.where(active, tok, 0))
    out_logp = jnp.zeros((batch, m), jnp.float32).at[:, 0].set(jnp.where(active, logp, 0.0))
    lengths = active.astype(jnp.int32)
    stopped = active & jnp.isin(tok, stop_ids)
    done = ~active | stopped | (lengths >= m)

    def cond(state):
        step, done = state[0], state[6]
        return (step < m) & ~jnp.all(done)

    def body(state):
        step, kv, tok, pos, out_tok, out_logp, done, stopped, lengths, key = state
        live = ~done
        logits, kv = decode_forward(params, config, kv, tok, jnp.where(live, pos, -1),
                                    page_table, backend=backend)
        key, sub = jax.random.split(key)
        new_tok, new_logp = sample_tokens(logits, sub, temperature, top_p, top_k)
        out_tok = out_tok.at[:, step].set(jnp.where(live, new_tok, 0))
        out_logp = out_logp.at[:, step].set(jnp.where(live, new_logp, 0.0))
        lengths = lengths + live
        stop_now = live & jnp.isin(new_tok, stop_ids)
        stopped = stopped | stop_now
        done = done | stop_now | (lengths >= m)
        return (step + 1, kv, jnp.where(live, new_tok, tok), pos + live, out_tok, out_logp,
                done, stopped, lengths, key)

    state = (jnp.int32(1), kv_cache, tok, row_pos, out_tok, out_logp, done, stopped, lengths,
             key)
    step, kv_cache, _, _, out_tok, out_logp, _, stopped, lengths, _ = jax.lax.while_loop(
        cond, body, state)
    return out_tok, out_logp, lengths, stopped, step, kv_cache
