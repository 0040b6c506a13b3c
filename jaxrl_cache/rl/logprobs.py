"""Teacher-forced log-probs without the [N, L, V] logits: one function for the loss, the
audit, the reference policy and SFT.

The decoder runs to its last hidden states; the LM head, the sampler's temperature /
top-k / top-p warp (`distribution.warped_logits`, the very function behind the
recorded behavior log-probs) and the log-softmax then run per chunk of positions in a
rematerialised `lax.scan`, so at most [B, chunk, V] logits exist at a time, in the forward
and in the backward pass. The filter is static (`filter_kind` of the batch's sampling
setting): a step sampled without top-p compiles no full-vocab sort.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_cache.models.config import ModelConfig
from jaxrl_cache.distribution import entropy_of, filter_kind, log_probs_at, warped_logits
from jaxrl_cache.models.families import family_of
from jaxrl_cache.rollout.sampling import SamplingParams
from kernels_pallas import kernel_keyed_jit

LOGPROB_CHUNK = 128  # positions (rows x columns) per LM-head chunk: [chunk, V] f32 logits
# (128: as fast as 512 on SmolLM2 at 16 x 80 and 64 x 256 tokens, 0.46 GiB less peak RSS at
# 16 x 80; benchmarks/results/logprob-chunk-cpu-2026-12-04.md)


def token_log_probs(params, config: ModelConfig, tokens, targets, knobs: dict, *, kind: str,
                    positions=None, segments=None, parents=None, kv_blocks=None,
                    items=None, columns=None, sources=None, remat: str = "none",
                    chunk: int = LOGPROB_CHUNK, scored=None, entropy: str | None = None):
    """log p(targets[b, t] | tokens[b, :t+1]) under the warped distribution -> f32 [B, T].

    tokens, targets int32 [B, T] (targets[b, t]: the token position t predicts; any valid id
    where unused); positions, segments, parents int32 [B, T], kv_blocks int32
    [B, T / TILE, KM], items int32 [B, W], columns int32 [B, N], sources int32 [B, T], or
    None (see `models.llama.hidden_states`; the config's family decoder runs them); knobs:
    temperature, top_p f32 [], top_k int32 [] (and min_p, repetition_penalty f32 [] when the
    kind reads them); kind: `filter_kind` of those knobs (static). With "+penalty" each
    position's context (its sequence up to itself, a shared prefix it sees through `parents`
    included; a row from position 0 without segments) is the repetition penalty's presence
    (`_context_presence`).
    A target outside the filtered set gets -inf. chunk: positions per LM-head chunk.
    scored int32 [B, K] (optional): the only columns whose log-prob is needed (T = padding);
    the LM head runs on those alone and every other position gets 0.
    entropy (static): also return the entropy of the warped distribution at each position,
    f32 [B, T] (0 where not scored): (log-probs, entropies); "metric": no gradient, "grad":
    differentiated (an entropy bonus). The log-probs are the very same bits either way
    (`log_probs_at` is unchanged; the entropy is a separate reduction over the same chunk's
    logits).
    """
    x = family_of(config).decoder.hidden_states(params, config, tokens, positions, segments,
                                                parents, kv_blocks, items, columns, sources,
                                                remat=remat)
    context = None
    if "+penalty" in kind:
        context = _context_presence(tokens, positions, segments, parents, config.vocab_size)
    if scored is not None:
        # per-row gathers and scatters (vmap: batch dims a row-sharded batch keeps local)
        cols = jnp.minimum(scored, tokens.shape[1] - 1)
        x = jax.vmap(lambda xr, c: xr[c])(x, cols)
        picked = _chunked_log_probs(params, config, x, jax.vmap(lambda t, c: t[c])(targets, cols),
                                    knobs, kind, chunk, entropy, context, cols)
        spread = lambda p: jax.vmap(lambda c, v: jnp.zeros(  # noqa: E731
            tokens.shape[1], jnp.float32).at[c].set(v, mode="drop"))(scored, p)
        return tuple(map(spread, picked)) if entropy else spread(picked)
    cols = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return _chunked_log_probs(params, config, x, targets, knobs, kind, chunk, entropy, context,
                              cols)


def _context_presence(tokens, positions, segments, parents, vocab: int):
    """tokens int32 [B, T]; positions, segments, parents int32 [B, T] or None (rows from
    position 0) -> presence_at(cols int32 [B, w]) -> bool [B, w, V]: the tokens of each
    column's context, its sequence's tokens up to and including it (the prompt and the output
    so far, as the sampler's presence when it drew the next token)."""
    rows, length = tokens.shape

    def presence_at(cols):
        if segments is None:
            seen = jnp.arange(length) <= cols[..., None]  # [B, w, T]
        else:
            pick = lambda a: jnp.take_along_axis(a, cols, axis=1)[..., None]  # noqa: E731
            own, parent, pos = pick(segments), pick(parents), pick(positions)
            seg = segments[:, None, :]
            seen = ((seg > 0) & ((seg == own) | ((seg == parent) & (parent > 0)))
                    & (positions[:, None, :] <= pos))
        width = cols.shape[1]
        return jnp.zeros((rows, width, vocab), bool).at[
            jnp.arange(rows)[:, None, None], jnp.arange(width)[None, :, None],
            tokens[:, None, :]].max(seen)

    return presence_at


def _chunked_log_probs(params, config, x, targets, knobs, kind, chunk, entropy, context,
                       cols):
    """x [B, T, d] final hidden states, targets int32 [B, T] -> log-probs f32 [B, T]: the LM
    head and warp per chunk of positions (rematerialised); entropy: (log-probs, entropies).
    context: `_context_presence`'s presence_at, or None (no repetition penalty); cols int32
    [B, T]: each position's column in the row (what presence_at reads)."""
    batch, length = targets.shape
    lm_logits = family_of(config).decoder.lm_logits
    width = max(1, min(length, chunk // batch))  # columns per chunk
    steps = -(-length // width)
    pad = steps * width - length
    x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
    xs = x.reshape(batch, steps, width, -1).swapaxes(0, 1)  # [steps, B, width, d]
    ts, cs = (jnp.pad(a, ((0, 0), (0, pad))).reshape(batch, steps, width).swapaxes(0, 1)
              for a in (targets, cols))  # [steps, B, width]

    @jax.checkpoint
    def chunk_log_probs(_, xtc):
        xc, tc, cc = xtc
        logits = warped_logits(
            lm_logits(params, config, xc), knobs["temperature"], knobs["top_p"],
            knobs["top_k"], kind, min_p=knobs.get("min_p"),
            repetition_penalty=knobs.get("repetition_penalty"),
            presence=None if context is None else context(cc))  # [B, width, V]
        if not entropy:
            return None, log_probs_at(logits, tc)
        held = logits if entropy == "grad" else jax.lax.stop_gradient(logits)
        return None, (log_probs_at(logits, tc), entropy_of(held))

    _, out = jax.lax.scan(chunk_log_probs, None, (xs, ts, cs))
    unchunk = lambda a: a.swapaxes(0, 1).reshape(batch, steps * width)[:, :length]  # noqa
    return tuple(map(unchunk, out)) if entropy else unchunk(out)


def knobs_of(sampling: SamplingParams, vocab: int) -> tuple[dict, str]:
    """(traced knobs, static filter kind) of a sampling setting."""
    return sampling.as_arrays(), filter_kind(sampling.temperature, sampling.top_p,
                                             sampling.top_k, vocab, sampling.min_p,
                                             sampling.repetition_penalty)


@kernel_keyed_jit(static_argnames=("config", "kind", "chunk"))
def _next_token_log_probs(params, tokens, knobs, *, config, kind, chunk):
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    return token_log_probs(params, config, tokens, targets, knobs, kind=kind,
                           chunk=chunk)[:, :-1]


def next_token_log_probs(params, config: ModelConfig, tokens, sampling: SamplingParams, *,
                         chunk: int = LOGPROB_CHUNK):
    """tokens int32 [N, L] (rows from position 0) -> f32 [N, L-1]: the log-prob of token t+1
    at position t under `sampling`'s distribution (jitted; used by the audit and tests)."""
    knobs, kind = knobs_of(sampling, config.vocab_size)
    return _next_token_log_probs(params, jnp.asarray(tokens, jnp.int32), knobs, config=config,
                                 kind=kind, chunk=chunk)
