"""Sampling parameters and the behavior distribution they define.

`output_logprobs` record log-probabilities under the distribution actually sampled from:
logits / temperature, restricted to the top_k tokens and the top_p nucleus, renormalised.
Greedy decoding (temperature 0) records the untempered model log-softmax. The trainer and
the audit use `behavior_log_probs` with the same parameters, so the two always agree.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # samples per prompt (a GRPO group)
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got "
                             f"{self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

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
