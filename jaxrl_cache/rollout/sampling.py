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

from jaxrl_cache.checks import as_bool, as_count, as_real
from jaxrl_cache.spmd import per_batch_shard
from kernels_pallas import invariant_kernels
from kernels_pallas.blocked import tree_sum
from kernels_pallas.normaliser import log_sum_exp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # samples per prompt (a GRPO group)
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()
    # Stop strings (rollout/text.py; the engine needs a tokenizer): a sample ends at the
    # output token whose decoded text first contains one. Its tokens keep that token (what
    # was sampled); its text ends before the stop string unless include_stop_str_in_output.
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        """Checks and normalises every knob (numpy scalars become Python numbers): integers
        must be real integers (not bools, not 2.5), reals finite; top_k fits an int32 (any
        top_k >= the vocabulary keeps every token). Stop ids must be a sequence
        of non-negative integers; the engine checks them against its vocabulary. Stop strings
        must be a sequence (not a bare str) of non-empty strings."""
        norm = dict(n=as_count(self.n, "n", minimum=1),
                    max_new_tokens=as_count(self.max_new_tokens, "max_new_tokens", minimum=1),
                    temperature=as_real(self.temperature, "temperature", minimum=0.0),
                    top_p=as_real(self.top_p, "top_p", minimum=0.0, maximum=1.0,
                                  open_min=True),
                    top_k=as_count(self.top_k, "top_k", maximum=2**31 - 1))
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
        """Traced knobs: changing them never recompiles."""
        return dict(temperature=jnp.float32(self.temperature), top_p=jnp.float32(self.top_p),
                    top_k=jnp.int32(self.top_k))


TOP_K_CAP = 256  # top_k up to this uses lax.top_k; larger k falls back to a full sort


def log_normaliser(warped):
    """warped f32 [..., V] (-inf = excluded) -> log sum exp over V [...], in one fixed order
    whatever the leading shape: the sampler's recorded log-probs and the trainer's
    teacher-forced ones share these bits. Under JAXRL_CACHE_KERNELS:
    `kernels_pallas.log_sum_exp`, one fixed kernel program (XLA:GPU may fuse the jnp form
    differently per program; a row with nothing left gets gradient 0 there, NaN here);
    otherwise the max, then a halving tree of exp(x - max) (`tree_sum`)."""
    kernels = invariant_kernels()
    if kernels is not None:  # per batch shard under a training mesh (a custom call)
        lse = lambda a: log_sum_exp(a, backend=kernels)  # noqa: E731
        return per_batch_shard(lse, warped) if warped.ndim > 1 else lse(warped)
    top = jax.lax.stop_gradient(jnp.max(warped, axis=-1, keepdims=True))
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    return top[..., 0] + jnp.log(tree_sum(jnp.exp(warped - top), -1))


def log_probs_at(warped, tokens):
    """warped f32 [..., V], tokens int32 [...] -> log-prob of each token under
    softmax(warped) [...]: the one formula behind every recorded and recomputed log-prob."""
    picked = jnp.take_along_axis(warped, tokens[..., None], axis=-1)[..., 0]
    return picked - log_normaliser(warped)


def _nucleus_threshold(sorted_desc, top_p):
    """sorted_desc f32 [..., K] (descending, -inf = excluded) -> the smallest kept value [..., 1]
    of the top-p nucleus over the renormalised set: tokens whose preceding mass is < top_p."""
    probs = jnp.exp(sorted_desc - log_normaliser(sorted_desc)[..., None])
    before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.maximum(jnp.sum(before < top_p, axis=-1, keepdims=True), 1)
    return jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)


def _filtered(scaled, top_p, top_k, sorted_desc):
    """Top-k first, then top-p over the renormalised top-k set (the transformers / vLLM
    convention). sorted_desc [..., K]: the K largest of `scaled`, descending, K >= top_k."""
    k = sorted_desc.shape[-1]
    k_eff = jnp.where(top_k > 0, jnp.minimum(top_k, k), k)
    kth = jnp.take_along_axis(sorted_desc, jnp.broadcast_to(k_eff - 1, scaled.shape[:-1])[..., None],
                              axis=-1)
    in_top_k = jnp.arange(k) < k_eff
    threshold = _nucleus_threshold(jnp.where(in_top_k, sorted_desc, -jnp.inf), top_p)
    keep = (scaled >= kth) & (scaled >= threshold)
    return jnp.where(keep, scaled, -jnp.inf)


FILTERS = ("none", "top_k", "sort")  # the distribution's filter, cheapest first


def filter_kind(temperature: float, top_p: float, top_k: int, vocab: int) -> str:
    """The filter a sampling setting needs (host-side, static; the branch
    `behavior_log_probs` selects at run time): "none" (greedy, or neither top-k nor top-p:
    a plain log-softmax), "top_k" (0 < top_k <= TOP_K_CAP: `lax.top_k`, top-p applied
    within it), or "sort" (top-p without top-k, or a larger top_k: a full-vocab sort)."""
    if temperature <= 0 or (top_k <= 0 and top_p >= 1.0):
        return "none"
    if 0 < top_k <= min(TOP_K_CAP, vocab):
        return "top_k"
    return "sort"


def _filter(kind: str, scaled, top_p, top_k):
    """scaled f32 [..., V] -> the same with tokens outside the top-k / top-p set at -inf."""
    if kind == "none":
        return scaled
    if kind == "top_k":
        cap = min(TOP_K_CAP, scaled.shape[-1])
        return _filtered(scaled, top_p, top_k,
                         per_batch_shard(lambda r: jax.lax.top_k(r, cap)[0], scaled))
    return _filtered(scaled, top_p, top_k, -jnp.sort(-scaled, axis=-1))


def warped_logits(logits, temperature, top_p, top_k, kind: str):
    """logits f32 [..., V] -> logits of the sampling distribution (-inf outside it) for a
    static filter `kind` (see filter_kind; "none" ignores top_p/top_k). temperature, top_p
    f32 []; top_k int32 [] (0 = off)."""
    greedy = temperature <= 0
    # logits / t as an IEEE division in every program. Written plainly, XLA rewrites a
    # division by a broadcast scalar into logits * (1 / t), and XLA:CPU then contracts that
    # product with the log-softmax's `- max` into one FMA in some fusions (the trainer's)
    # and not in others (the sampler's): at t = 0.7 their log-probs differed in the last
    # bit. The divisor is built per element (min(|x|, 0) + t == t), so it is no broadcast
    # and the division stays one; a division is never contracted.
    divisor = jnp.minimum(jnp.abs(logits), 0.0) + jnp.where(greedy, 1.0, temperature)
    scaled = logits / divisor
    if kind == "none":
        return scaled
    use_k = (top_k > 0) & ~greedy
    return jnp.where(greedy, scaled, _filter(kind, scaled, top_p, jnp.where(use_k, top_k, 0)))


def _warped_at_run_time(logits, temperature, top_p, top_k):
    """`warped_logits` with the filter picked from the traced knobs by `lax.switch` (only the
    branch the knobs select runs)."""
    greedy = temperature <= 0
    cap = min(TOP_K_CAP, logits.shape[-1])
    use_k = (top_k > 0) & ~greedy
    use_p = (top_p < 1.0) & ~greedy
    branch = jnp.where(~use_k & ~use_p, 0, jnp.where(use_k & (top_k <= cap), 1, 2))
    return jax.lax.switch(
        branch, [lambda l, kind=kind: warped_logits(l, temperature, top_p, top_k, kind)
                 for kind in FILTERS], logits)


def behavior_log_probs(logits, temperature, top_p, top_k):
    """logits f32 [..., V] -> log-probs [..., V] of the sampling distribution (see module doc).

    temperature, top_p f32 scalars; top_k int32 scalar (0 = off), traced: the sampler picks
    the filter at run time with `lax.switch`, so only the branch the knobs select runs.
    Scorers that know the setting statically use `warped_logits(..., filter_kind(...))`,
    which computes the same values without compiling the other branches.
    """
    warped = _warped_at_run_time(logits, temperature, top_p, top_k)
    return warped - log_normaliser(warped)[..., None]


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


def sample_tokens(logits, keys, temperature, top_p, top_k):
    """logits f32 [B, V], keys [B] (one PRNG key per row) -> (tokens int32 [B],
    behavior logprobs f32 [B]). Per-row keys make a row's draw independent of its batch;
    a draw depends only on its key (one uniform, `_draw`)."""
    warped = _warped_at_run_time(logits, temperature, top_p, top_k)
    drawn = _draw(warped, keys)
    tokens = jnp.where(temperature <= 0, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    return tokens, log_probs_at(warped, tokens)
