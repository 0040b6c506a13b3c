"""The sampling distribution, one formula for the sampler and the trainer: the logits with
the repetition penalty on the tokens of the context (`penalised`), / temperature, restricted
to the top_k tokens, then the top_p nucleus, then the min_p set (`warped_logits`; the
transformers order), and its log-normaliser in one fixed order (`log_normaliser`).

The engine records each token's log-prob with `log_probs_at(warped_at_run_time(...))`
(rollout/sampling.py draws from the same warped logits); the trainer, the audit and the
reference policy recompute it with `log_probs_at(warped_logits(..., filter_kind(...)))`
(rl/logprobs.py). Both import this module and nothing else computes the distribution, so
under exact numerics the two agree bit for bit. Greedy decoding (temperature 0) is the
untempered log-softmax of the penalised logits (top-k, top-p and min-p are sampling warps:
greedy ignores them; the repetition penalty is not, as in transformers and vLLM).

The repetition penalty reads the context: `presence` bool [..., V], the tokens of the
prompt and of the output so far at each position. The sampler carries it per row through a
decode chunk; the trainer builds each position's from the packed sequence
(rl/logprobs.py). Both then call `penalised`, the same elementwise ops, so the bits agree.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_cache.spmd import per_batch_shard
from kernels_pallas import invariant_kernels
from kernels_pallas.blocked import tree_sum
from kernels_pallas.normaliser import log_sum_exp

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


def entropy_of(warped):
    """warped f32 [..., V] (-inf = excluded) -> entropy of softmax(warped) [...] in nats
    (excluded tokens contribute 0, with gradient 0). Plain sums, no fixed order needed: no
    recorded log-prob depends on it."""
    logq = warped - log_normaliser(warped)[..., None]
    q = jnp.exp(logq)
    return -jnp.sum(q * jnp.where(q > 0, logq, 0.0), axis=-1)


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
EXTRAS = ("min_p", "penalty")  # steps a kind may add: "top_k+min_p", "none+penalty", ...


def filter_kind(temperature: float, top_p: float, top_k: int, vocab: int,
                min_p: float = 0.0, repetition_penalty: float = 1.0) -> str:
    """The warp a sampling setting needs (host-side, static; `warped_at_run_time` selects
    it from the traced knobs): the filter, "none" (greedy, or neither top-k nor top-p: a
    plain log-softmax), "top_k" (0 < top_k <= TOP_K_CAP: `lax.top_k`, top-p applied within
    it), or "sort" (top-p without top-k, or a larger top_k: a full-vocab sort); then
    "+min_p" (min_p > 0, not greedy) and "+penalty" (repetition_penalty != 1)."""
    if temperature <= 0 or (top_k <= 0 and top_p >= 1.0):
        kind = "none"
    elif 0 < top_k <= min(TOP_K_CAP, vocab):
        kind = "top_k"
    else:
        kind = "sort"
    return (kind + ("+min_p" if min_p > 0 and temperature > 0 else "")
            + ("+penalty" if repetition_penalty != 1 else ""))


def excludes_tokens(kind: str) -> bool:
    """Whether a `filter_kind` can put a token at -inf (top-k, top-p or min-p)."""
    return kind.split("+")[0] != "none" or "+min_p" in kind


def penalised(logits, presence, penalty):
    """logits f32 [..., V], presence bool [..., V] (the context's tokens), penalty f32 [] > 0
    -> the logits with each present token's divided by penalty where >= 0, multiplied by it
    where < 0 (transformers' RepetitionPenaltyLogitsProcessor, vLLM's repetition_penalty;
    1 leaves every bit). The divisor is built per element, an IEEE division in every program
    (see `warped_logits`)."""
    divisor = jnp.minimum(jnp.abs(logits), 0.0) + penalty
    return jnp.where(presence, jnp.where(logits < 0, logits * penalty, logits / divisor),
                     logits)


def _min_p(warped, min_p):
    """warped f32 [..., V] (-inf = excluded) -> the same with each token whose probability is
    below min_p x the likeliest one's at -inf (exp(x - max) >= min_p is p >= min_p x p_max:
    transformers' MinPLogitsWarper; min_p 0 keeps every bit)."""
    top = jnp.max(warped, axis=-1, keepdims=True)
    return jnp.where(jnp.exp(warped - top) >= min_p, warped, -jnp.inf)


def _filter(kind: str, scaled, top_p, top_k):
    """scaled f32 [..., V] -> the same with tokens outside the top-k / top-p set at -inf."""
    if kind == "none":
        return scaled
    if kind == "top_k":
        cap = min(TOP_K_CAP, scaled.shape[-1])
        return _filtered(scaled, top_p, top_k,
                         per_batch_shard(lambda r: jax.lax.top_k(r, cap)[0], scaled))
    return _filtered(scaled, top_p, top_k, -jnp.sort(-scaled, axis=-1))


def warped_logits(logits, temperature, top_p, top_k, kind: str, *, min_p=None,
                  repetition_penalty=None, presence=None):
    """logits f32 [..., V] -> logits of the sampling distribution (-inf outside it) for a
    static `kind` (see filter_kind; "none" ignores top_p/top_k; min_p, repetition_penalty
    f32 [] and presence bool [..., V] are read only when the kind has "+min_p" /
    "+penalty"). temperature, top_p f32 []; top_k int32 [] (0 = off)."""
    kind, *extras = kind.split("+")
    if "penalty" in extras:
        logits = penalised(logits, presence, repetition_penalty)
    greedy = temperature <= 0
    # logits / t as an IEEE division in every program. Written plainly, XLA rewrites a
    # division by a broadcast scalar into logits * (1 / t), and XLA:CPU then contracts that
    # product with the log-softmax's `- max` into one FMA in some fusions (the trainer's)
    # and not in others (the sampler's): at t = 0.7 their log-probs differed in the last
    # bit. The divisor is built per element (min(|x|, 0) + t == t), so it is no broadcast
    # and the division stays one; a division is never contracted.
    divisor = jnp.minimum(jnp.abs(logits), 0.0) + jnp.where(greedy, 1.0, temperature)
    scaled = logits / divisor
    if kind != "none":
        use_k = (top_k > 0) & ~greedy
        scaled = jnp.where(greedy, scaled,
                           _filter(kind, scaled, top_p, jnp.where(use_k, top_k, 0)))
    if "min_p" in extras:
        scaled = jnp.where(greedy, scaled, _min_p(scaled, min_p))
    return scaled


def warped_at_run_time(logits, temperature, top_p, top_k, min_p=0.0, repetition_penalty=1.0,
                       presence=None):
    """`warped_logits` with the warp picked from the traced knobs: the filter by
    `lax.switch`, min-p by `lax.cond` (only what the knobs select runs). presence bool
    [..., V] or None: None applies no repetition penalty (static)."""
    if presence is not None:
        logits = penalised(logits, presence, repetition_penalty)
    greedy = temperature <= 0
    cap = min(TOP_K_CAP, logits.shape[-1])
    use_k = (top_k > 0) & ~greedy
    use_p = (top_p < 1.0) & ~greedy
    branch = jnp.where(~use_k & ~use_p, 0, jnp.where(use_k & (top_k <= cap), 1, 2))
    warped = jax.lax.switch(
        branch, [lambda l, kind=kind: warped_logits(l, temperature, top_p, top_k, kind)
                 for kind in FILTERS], logits)
    return jax.lax.cond((min_p > 0) & ~greedy, _min_p, lambda w, _: w, warped, min_p)


def behavior_log_probs(logits, temperature, top_p, top_k, min_p=0.0, repetition_penalty=1.0,
                       presence=None):
    """logits f32 [..., V] -> log-probs [..., V] of the sampling distribution (see module doc).

    temperature, top_p, min_p, repetition_penalty f32 scalars; top_k int32 scalar (0 = off),
    traced: the sampler picks the warp at run time (`warped_at_run_time`), so only what the
    knobs select runs; presence bool [..., V] (the context's tokens) or None (no repetition
    penalty). Scorers that know the setting statically use `warped_logits(...,
    filter_kind(...))`, which computes the same values without compiling the other branches.
    """
    warped = warped_at_run_time(logits, temperature, top_p, top_k, min_p, repetition_penalty,
                                presence)
    return warped - log_normaliser(warped)[..., None]
