"""Sampling parameters and the behavior distribution they define.

`output_logprobs` record log-probabilities under the distribution actually sampled from:
logits / temperature, restricted to the top_k tokens and the top_p nucleus, renormalised.
Greedy decoding (temperature 0) records the untempered model log-softmax. The trainer and
the audit use `behavior_log_probs` with the same parameters, so the two always agree.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_cache.checks import as_count, as_real


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # samples per prompt (a GRPO group)
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        """Checks and normalises every knob (numpy scalars become Python numbers): integers
        must be real integers (not bools, not 2.5), reals finite. Stop ids must be a sequence
        of non-negative integers; the engine checks them against its vocabulary."""
        norm = dict(n=as_count(self.n, "n", minimum=1),
                    max_new_tokens=as_count(self.max_new_tokens, "max_new_tokens", minimum=1),
                    temperature=as_real(self.temperature, "temperature", minimum=0.0),
                    top_p=as_real(self.top_p, "top_p", minimum=0.0, maximum=1.0,
                                  open_min=True),
                    top_k=as_count(self.top_k, "top_k"))
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not isinstance(stops, (Sequence, np.ndarray)):
            raise TypeError(f"stop_token_ids must be a sequence of token ids, got "
                            f"{type(stops).__name__} {stops!r:.80}")
        norm["stop_token_ids"] = tuple(as_count(t, f"stop_token_ids[{i}]")
                                       for i, t in enumerate(stops))
        for name, value in norm.items():
            object.__setattr__(self, name, value)

    def as_arrays(self) -> dict:
        """Traced knobs: changing them never recompiles."""
        return dict(temperature=jnp.float32(self.temperature), top_p=jnp.float32(self.top_p),
                    top_k=jnp.int32(self.top_k))


def behavior_log_probs(logits, temperature, top_p, top_k):
    """logits f32 [..., V] -> log-probs [..., V] of the sampling distribution (see module doc).

    temperature, top_p f32 scalars; top_k int32 scalar (0 = off).
    """
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where((top_k > 0) & ~greedy, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, jnp.broadcast_to(k - 1, scaled.shape[:-1])[..., None],
                              axis=-1)
    keep = scaled >= kth
    probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
    # nucleus: keep tokens whose preceding cumulative mass is < top_p
    before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    n_nucleus = jnp.sum(before < top_p, axis=-1, keepdims=True)
    n_nucleus = jnp.where(greedy | (top_p >= 1.0), vocab, n_nucleus)
    nucleus_min = jnp.take_along_axis(sorted_desc, n_nucleus - 1, axis=-1)
    keep = keep & (scaled >= nucleus_min)
    return jax.nn.log_softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)


def sample_tokens(logits, key, temperature, top_p, top_k):
    """logits f32 [B, V] -> (tokens int32 [B], behavior logprobs f32 [B])."""
    logp = behavior_log_probs(logits, temperature, top_p, top_k)
    drawn = jax.random.categorical(key, logp, axis=-1)
    tokens = jnp.where(temperature <= 0, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
