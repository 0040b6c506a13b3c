"""Jitted numeric core of the rollout engine: packed paged prefill and decode chunks.

Params are arguments (a weight update never recompiles) and the KV pool is donated. Shapes
depend only on the engine's slot count, the chunk length and the buckets the host picks;
sampling knobs, max_new_tokens, versions and params are traced values.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_cache.models import ModelConfig
from jaxrl_cache.models.families import family_of
from jaxrl_cache.parallel import shard_forward
from jaxrl_cache.rollout.sampling import sample_tokens
from kernels_pallas import as_bits16, from_bits16, kernel_keyed_jit, resolve_backend


def _on_mesh(forward, mesh):
    """The model forward (the config's family decoder's), tensor-parallel when the engine
    has a mesh (parallel.shard_forward)."""
    if mesh is None:
        return forward
    return shard_forward(forward, mesh)


@kernel_keyed_jit(static_argnames=("config", "backend", "mesh"),
                   donate_argnames=("kv_cache",))
def prefill_step(params, kv_cache, tokens, token_seq, token_pos, page_table, cu_q_lens, kv_lens,
                 logit_slot, copy_src, copy_dst, *, config: ModelConfig, backend: str,
                 mesh=None):
    """Prefills packed prompt tails, then copies partial prompt pages to sibling rows.

    tokens, token_seq, token_pos int32 [T]; page_table int32 [S, W]; cu_q_lens int32 [S+1];
    kv_lens int32 [S]; logit_slot int32 [B] packed token whose logits each decode slot starts
    from; copy_src, copy_dst int32 [B]. mesh: as in decode_chunk.
    Returns (logits f32 [B, V], kv_cache').
    """
    decoder = family_of(config).decoder
    logits, kv_cache = _on_mesh(decoder.prefill_forward, mesh)(
        _bits_params(params, backend, mesh), config, _as_bits(kv_cache, backend, mesh),
        tokens, token_seq, token_pos,
        page_table, cu_q_lens, kv_lens, logit_slot, backend=backend)
    return logits, _as_values(decoder.copy_pages(kv_cache, copy_src, copy_dst), config)


def on_bits_path(backend: str, mesh) -> bool:
    """Whether calls carry 16-bit floats as their bits: the xla paths of one device, where
    XLA:CPU would otherwise convert them whole to fp32 around each scatter and slice."""
    return mesh is None and resolve_backend(backend) == "xla"


def _as_bits(tree, backend: str, mesh):
    """A pytree's 16-bit float arrays as their bits (`as_bits16`) `on_bits_path`; as it is
    elsewhere."""
    return jax.tree.map(as_bits16, tree) if on_bits_path(backend, mesh) else tree


def layers_as_bits(params):
    """params with the stacked layers' 16-bit floats as their bits: the layer scan slices
    bits and `models.llama._decoder` views each layer as floats again. An engine holds its
    own layers so (`rollout.engine`), since this cast of a call's parameter is a copy."""
    return {**params, "layers": jax.tree.map(as_bits16, params["layers"])}


def _bits_params(params, backend: str, mesh):
    return layers_as_bits(params) if on_bits_path(backend, mesh) else params


def _as_values(kv_cache, config: ModelConfig):
    return jax.tree.map(lambda pages: from_bits16(pages, jnp.dtype(config.dtype)), kv_cache)


def row_keys(key, sample_index, emitted):
    """One PRNG key per row and token: fold_in(fold_in(key, sample), token). A sample's draws
    depend only on the call's key and its own index, never on scheduling. [B] -> keys [B]."""
    return jax.vmap(lambda i, t: jax.random.fold_in(jax.random.fold_in(key, i), t))(
        sample_index, emitted)


@kernel_keyed_jit(static_argnames=("config", "backend", "steps", "mesh"),
                   donate_argnames=("kv_cache",))
def decode_chunk(params, kv_cache, fresh_logits, fresh, last_token, position, page_table,
                 shared_pages, budget, sample_index, emitted, stop_ids, refill_at, temperature,
                 top_p, top_k, min_p, repetition_penalty, key, presence=None, *,
                 config: ModelConfig, backend: str, steps: int, mesh=None):
    """Runs up to `steps` decode steps for every slot on device (one lax.while_loop).

    fresh_logits f32 [B, V] prefill logits of fresh slots; fresh bool [B]; last_token,
    position int32 [B] (see runner.DecodeArrays); page_table int32 [B, W - S] and
    shared_pages int32 [S] (pages common to every row, cut from the table); budget int32 [B]
    tokens a slot may still emit (0 = empty); sample_index, emitted int32 [B] (PRNG streams);
    stop_ids int32 [K] (-1 = none); mesh: run the forward tensor-parallel (params laid out by
    parallel.rollout_shardings, pool by parallel.engine_kv_cache); refill_at int32 []: stop
    early once this many slots have finished in this chunk (the host has samples waiting for
    slots); temperature ... repetition_penalty: the traced sampling knobs; presence bool
    [B, V]: each row's context tokens (prompt and output so far), updated with every token
    drawn, or None: no repetition penalty (static).
    Returns (tokens int32 [B, steps], logprobs f32 [B, steps], counts int32 [B],
    stopped bool [B], steps_run int32 [], kv_cache').
    """
    batch = fresh.shape[0]
    live0 = budget > 0
    params = _bits_params(params, backend, mesh)
    forward_fn = _on_mesh(family_of(config).decoder.decode_forward, mesh)

    def cond(state):
        step, done = state[0], state[7]  # state[9]: presence
        finished_now = jnp.sum(done & live0)
        return (step < steps) & ~jnp.all(done) & (finished_now < refill_at)

    def body(state):
        step, kv, last, pos, out_tok, out_logp, counts, done, stopped, seen = state
        live = ~done
        first = live & fresh & (step == 0)
        forward = live & ~first
        logits, kv = forward_fn(params, config, kv, last, jnp.where(forward, pos, -1),
                                page_table, shared_pages, backend=backend)
        logits = jnp.where(first[:, None], fresh_logits, logits)
        keys = row_keys(key, sample_index, emitted + counts)
        tok, logp = sample_tokens(logits, keys, temperature, top_p, top_k, min_p,
                                  repetition_penalty, seen)
        if seen is not None:
            seen = seen.at[jnp.arange(batch), tok].max(live)
        out_tok = out_tok.at[:, step].set(jnp.where(live, tok, 0))
        out_logp = out_logp.at[:, step].set(jnp.where(live, logp, 0.0))
        counts = counts + live
        stop_now = live & jnp.isin(tok, stop_ids)
        stopped = stopped | stop_now
        done = done | stop_now | (counts >= budget)
        return (step + 1, kv, jnp.where(live, tok, last), pos + forward, out_tok, out_logp,
                counts, done, stopped, seen)

    zeros = jnp.zeros((batch, steps), jnp.int32)
    state = (jnp.int32(0), _as_bits(kv_cache, backend, mesh), last_token, position, zeros,
             jnp.zeros((batch, steps), jnp.float32), jnp.zeros(batch, jnp.int32), ~live0,
             jnp.zeros(batch, bool), presence)
    step, kv_cache, _, _, out_tok, out_logp, counts, _, stopped, _ = jax.lax.while_loop(
        cond, body, state)
    return out_tok, out_logp, counts, stopped, step, _as_values(kv_cache, config)
