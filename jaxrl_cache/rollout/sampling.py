"""Sampling parameters and the draw.

`output_logprobs` record log-probabilities under the distribution actually sampled from
(jaxrl_cache/distribution.py, the formula the trainer and the audit recompute them with):
the logits with the repetition penalty on the context's tokens, / temperature, restricted to
the top_k tokens, the top_p nucleus and the min_p set, renormalised.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_cache.checks import as_bool, as_count, as_real
from jaxrl_cache.distribution import log_probs_at, warped_at_run_time


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # samples per prompt (a GRPO group)
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # keep tokens with p >= min_p x the likeliest's (after top-k/top-p)
    repetition_penalty: float = 1.0  # > 0; the context's tokens' logits / (or x, if < 0) it
    stop_token_ids: tuple[int, ...] = ()
    # Stop strings (rollout/text.py; the engine needs a tokenizer): a sample ends at the
    # output token whose decoded text first contains one. Its tokens keep that token (what
    # was sampled); its text ends before the stop string unless include_stop_str_in_output.
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        """Checks and normalises every knob (numpy scalars become Python numbers): integers
        must be real integers (not bools, not 2.5), reals finite; top_k fits an int32 (any
        top_k >= the vocabulary keeps every token); min_p in [0, 1]; repetition_penalty > 0.
        Stop ids must be a sequence of non-negative integers; the engine checks them against
        its vocabulary. Stop strings must be a sequence (not a bare str) of non-empty
        strings."""
        norm = dict(n=as_count(self.n, "n", minimum=1),
                    max_new_tokens=as_count(self.max_new_tokens, "max_new_tokens", minimum=1),
                    temperature=as_real(self.temperature, "temperature", minimum=0.0),
                    top_p=as_real(self.top_p, "top_p", minimum=0.0, maximum=1.0,
                                  open_min=True),
                    top_k=as_count(self.top_k, "top_k", maximum=2**31 - 1),
                    min_p=as_real(self.min_p, "min_p", minimum=0.0, maximum=1.0),
                    repetition_penalty=as_real(self.repetition_penalty, "repetition_penalty",
                                               minimum=0.0, open_min=True))
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not isinstance(stops, (Sequence, np.ndarray)):
            raise TypeError(f"stop_token_ids must be a sequence of token ids, got "
                            f"{type(stops).__name__} {stops!r:.80}")
        norm["stop_token_ids"] = tuple(as_count(t, f"stop_token_ids[{i}]")
                                       for i, t in enumerate(stops))
        texts = self.stop
        if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
            raise TypeError(f"stop must be a sequence of strings (stop=('\\n\\n',)), got "
                            f"{type(texts).__name__} {texts!r:.80}")
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"stop[{i}] must be a str, got {type(t).__name__} {t!r:.80}")
            if not t:
                raise ValueError(f"stop[{i}] is an empty string (it would match before any "
                                 f"token)")
        norm["stop"] = tuple(texts)
        norm["include_stop_str_in_output"] = as_bool(self.include_stop_str_in_output,
                                                     "include_stop_str_in_output")
        for name, value in norm.items():
            object.__setattr__(self, name, value)

    def as_arrays(self) -> dict:
        """Traced knobs: changing them never recompiles (a repetition penalty of 1 or not
        is static: only a penalised setting tracks the context's tokens)."""
        return dict(temperature=jnp.float32(self.temperature), top_p=jnp.float32(self.top_p),
                    top_k=jnp.int32(self.top_k), min_p=jnp.float32(self.min_p),
                    repetition_penalty=jnp.float32(self.repetition_penalty))


DRAW_BLOCK = 128  # vocabulary block of the two-level inverse CDF


def _last_positive(mass):
    """mass f32 [B, N] >= 0 -> index int32 [B] of each row's last positive entry."""
    n = mass.shape[-1]
    return (n - 1 - jnp.argmax(mass[:, ::-1] > 0, axis=-1)).astype(jnp.int32)


def _draw(warped, keys):
    """warped f32 [B, V] (-inf = excluded, one finite entry per row at least), keys [B] ->
    tokens int32 [B].

    Exact inverse-CDF sampling from softmax(warped) with one uniform per row: the row's
    mass is cut into blocks of DRAW_BLOCK tokens; a cumulative sum over the block masses
    picks the block, one over that block picks the token. One pass over [B, V] (exp and
    block sums), unlike Gumbel-max's V random draws per row. Rounding can never pick an
    excluded token: the search only stops on a positive mass, clamped to the last one.
    """
    rows, vocab = warped.shape
    pad = -vocab % DRAW_BLOCK
    top = jnp.max(warped, axis=-1, keepdims=True)
    mass = jnp.exp(jnp.pad(warped, ((0, 0), (0, pad)), constant_values=-jnp.inf) - top)
    mass = mass.reshape(rows, -1, DRAW_BLOCK)  # [B, NB, blk]
    block_mass = jnp.sum(mass, axis=-1)  # [B, NB]
    cdf = jnp.cumsum(block_mass, axis=-1)
    u = jax.vmap(jax.random.uniform)(keys)  # [B] in [0, 1)
    target = u * cdf[:, -1]
    block = jnp.minimum(jnp.sum(cdf <= target[:, None], axis=-1), _last_positive(block_mass))
    inner = jnp.take_along_axis(mass, block[:, None, None], axis=1)[:, 0]  # [B, blk]
    before = jnp.take_along_axis(cdf - block_mass, block[:, None], axis=1)[:, 0]
    rest = jnp.maximum(target - before, 0.0)
    within = jnp.minimum(jnp.sum(jnp.cumsum(inner, axis=-1) <= rest[:, None], axis=-1),
                         _last_positive(inner))
    return (block * DRAW_BLOCK + within).astype(jnp.int32)


def sample_tokens(logits, keys, temperature, top_p, top_k, min_p=0.0, repetition_penalty=1.0,
                  presence=None):
    """logits f32 [B, V], keys [B] (one PRNG key per row) -> (tokens int32 [B],
    behavior logprobs f32 [B]). Per-row keys make a row's draw independent of its batch;
    a draw depends only on its key (one uniform, `_draw`). presence bool [B, V]: each row's
    context tokens (the repetition penalty's), or None (no penalty). Greedy takes the argmax
    of the penalised logits (the warp at temperature 0 is exactly them)."""
    warped = warped_at_run_time(logits, temperature, top_p, top_k, min_p, repetition_penalty,
                                presence)
    drawn = _draw(warped, keys)
    tokens = jnp.where(temperature <= 0, jnp.argmax(warped, axis=-1), drawn).astype(jnp.int32)
    return tokens, log_probs_at(warped, tokens)
