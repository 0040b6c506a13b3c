"""One reduction order for every attention: the batch-invariant softmax over key blocks.

The decode and prefill references (the `xla` backend), the kernels and the trainer's dense
causal forward all reduce in this order, so a query sees the same bits whichever way it is
batched, paged or packed:

- keys are cut into blocks of KEY_BLOCK consecutive positions, aligned at position 0 of
  the query's own sequence;
- a block's scores are one dot of K = head_dim (`block_scores`), scaled by one multiply;
- the row maximum is taken over every visible key (a max is exact in any order);
- a block's probabilities exp(s - max) are summed by a fixed halving tree (`tree_sum`), its
  p @ v is one dot of K = KEY_BLOCK;
- block results are added left to right, first block first (`chain_sum`). Invisible keys
  contribute exact zeros, and x + 0 == x, so blocks before a sequence's start (other
  segments of a packed row) or after its end (padding, free page slots) change nothing.

Packed training rows are laid out in TILEs: a sequence starts on a multiple of TILE (not
of KEY_BLOCK, which would pad every sequence by up to 63 columns), and the trainer gathers
each query tile's keys TILE by TILE in its sequence's order (`gathered_attention`), so a
run of KEY_BLOCK // TILE gathered tiles is exactly one of the sequence's key blocks; only
the (tile, key block) pairs that hold keys are computed, an absent block chained as zeros.

The dots rely on one property of the XLA:CPU dot, checked by tests/test_numerics.py: an
element of a batched [M, K] x [K, N] dot with these K and N does not depend on M (M > 1)
or on the batch it is in. KEY_BLOCK = 64 rather than 16: a quarter of the p @ v dots and
block results to chain (prefill of 5 x 400 tokens on 2 cores: 3.45 -> 2.9 s); at 128 the
prefill kernel's interpret-mode dots no longer give the trainer's bits.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas._common import next_power_of_2

KEY_BLOCK = 64  # keys per block of the reduction order, from each sequence's position 0
TILE = 16  # packed rows' granule: sequences start on multiples of it; the trainer's query
#            tiles and gathered key lists are in units of it (KEY_BLOCK is a multiple)
MIN_QUERY_ROWS = 4  # rows of a dot are padded up to this (a 1-row dot is a gemv)
SCORE_KEYS = 64  # keys of a score dot are padded to a multiple of this (see block_scores)


def tree_sum(x, axis: int = -1):
    """Sum over `axis` by a halving tree of elementwise adds over the length padded with zeros
    to a power of two: level by level, entry i + half is added to entry i.

    The order depends only on the padded length, and trailing zeros never change the
    result: a tree over 2n entries whose second half is 0 equals the tree over the first n.
    The padding is never written: an entry whose partner is padding passes up unchanged.
    """
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    width = next_power_of_2(max(n, 1))
    while width > 1:
        half = width // 2
        if n > half:  # entries [n - half, half) meet padding
            x = jnp.concatenate([x[..., :n - half] + x[..., half:n], x[..., n - half:half]], -1)
            n = half
        width = half
    return x[..., 0]


def chain_sum(x, axis: int):
    """Sum over `axis` left to right: ((x0 + x1) + x2) + ... Leading and trailing zeros are
    exact no-ops."""
    x = jnp.moveaxis(x, axis, 0)
    total = x[0]
    for i in range(1, x.shape[0]):
        total = total + x[i]
    return total


def pad_rows(x, axis: int, minimum: int):
    """x padded with zero rows along `axis` to at least `minimum` entries."""
    n = x.shape[axis]
    if n >= minimum:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, minimum - n)
    return jnp.pad(x, pad)


def key_blocks(x, axis: int):
    """x [..., L, ...] -> [..., L / KEY_BLOCK, KEY_BLOCK, ...] at `axis`, zero-padding L to a
    multiple of KEY_BLOCK."""
    axis = axis % x.ndim
    n = x.shape[axis]
    padded = -(-n // KEY_BLOCK) * KEY_BLOCK
    if padded != n:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, padded - n)
        x = jnp.pad(x, pad)
    return x.reshape(*x.shape[:axis], padded // KEY_BLOCK, KEY_BLOCK, *x.shape[axis + 1:])


def block_scores(q, k, scale: float):
    """q [..., M, D], k [..., NB, KEY_BLOCK, D] -> scaled scores f32 [..., NB, M, KEY_BLOCK].

    One dot [M, D] x [D, NB * KEY_BLOCK] per query group, queries as its rows: XLA:CPU
    gives an element the same bits for any M >= 2 and any column count that is a multiple
    of 64 (not for 16, 32 or 96), so rows are padded to MIN_QUERY_ROWS and keys to a
    multiple of SCORE_KEYS. (Written the other way round, keys x queries, XLA picks other
    kernels again.)"""
    m, nb = q.shape[-2], k.shape[-3]
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)  # exact; bf16 dots vary more
    q = pad_rows(q, -2, MIN_QUERY_ROWS)
    per = SCORE_KEYS // KEY_BLOCK
    k = pad_rows(k, -3, -(-nb // per) * per)
    keys = k.reshape(*k.shape[:-3], -1, k.shape[-1])  # [..., NB' * KB, D]
    s = _score_dot(q, keys)
    s = s[..., :m, :nb * KEY_BLOCK].reshape(*s.shape[:-2], m, nb, KEY_BLOCK)
    return jnp.moveaxis(s, -2, -3) * scale


def _score_dot(q, keys, transposed: bool | None = None):
    """q f32 [..., M, D], keys f32 [..., L, D] -> f32 [..., M, L]. Where `keys_transposed`
    holds, the keys are first laid out [..., D, L] in memory (the barrier keeps XLA from
    folding the transpose back into the dot): the same bits, and on XLA:CPU 2-3x faster at
    decode's 4 and training's 48 query rows (the [L, D] form runs a slow batched kernel)."""
    if transposed is None:
        transposed = keys_transposed(keys.shape[-1])
    if transposed:
        keys_t = jax.lax.optimization_barrier(jnp.swapaxes(keys, -1, -2))
        return jnp.einsum("...md,...dl->...ml", q, keys_t, preferred_element_type=jnp.float32)
    return jnp.einsum("...md,...ld->...ml", q, keys, preferred_element_type=jnp.float32)


@functools.lru_cache(maxsize=None)
def keys_transposed(head_dim: int) -> bool:
    """Whether the score dot reads keys laid out [D, L] (`_score_dot`): only where that form
    gives every element the bits of the [L, D] form (which the kernels' dots follow) at 1,
    4, 64 and 512 query rows and 64, 192 and 512 keys, measured once per process on the
    default backend. On XLA:CPU true up to head_dim 64; at 80, 96 and 128 the [D, L] form
    splits its reduction by row count, so those keep the [L, D] form."""
    rng = np.random.default_rng(0)
    with jax.ensure_compile_time_eval(), jax.transfer_guard("allow"):  # a one-off probe
        q = jnp.asarray(rng.standard_normal((2, 512, head_dim)), jnp.float32)
        keys = jnp.asarray(rng.standard_normal((2, 8 * KEY_BLOCK, head_dim)), jnp.float32)
        plain = jax.jit(functools.partial(_score_dot, transposed=False))
        laid = jax.jit(functools.partial(_score_dot, transposed=True))
        for n in (KEY_BLOCK, 3 * KEY_BLOCK, 8 * KEY_BLOCK):
            ref = np.asarray(plain(q, keys[:, :n]))
            for m in (1, 4, 64, 512):
                if not np.array_equal(np.asarray(laid(q[:, :m], keys[:, :n])), ref[:, :m]):
                    return False
    return True


def _values_dot(p, v):
    """p f32 [..., NB, M, KEY_BLOCK], v f32 [..., NB, KEY_BLOCK, W] -> f32 [..., NB, M', W]
    (rows padded to MIN_QUERY_ROWS)."""
    p = pad_rows(p, -2, MIN_QUERY_ROWS)
    return jnp.einsum("...nmk,...nkd->...nmd", p, v, preferred_element_type=jnp.float32)


def _values_keep_rows(width: int) -> bool:
    """Whether `_values_dot` at value width `width` gives every row the bits it has among
    512 rows, at 1, 4, 64 and 100 rows (measured eagerly on the default backend)."""
    rng = np.random.default_rng(0)
    with jax.ensure_compile_time_eval(), jax.transfer_guard("allow"):  # a one-off probe
        p = jnp.asarray(rng.random((2, 8, 512, KEY_BLOCK)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((2, 8, KEY_BLOCK, width)), jnp.float32)
        dot = jax.jit(_values_dot)
        ref = np.asarray(dot(p, v))
        return all(np.array_equal(np.asarray(dot(p[..., :m, :], v))[..., :m, :],
                                  ref[..., :m, :]) for m in (1, 4, 64, 100))


@functools.lru_cache(maxsize=None)
def value_width(head_dim: int) -> int:
    """The width p @ v is computed at for values of `head_dim`: head_dim itself when its
    dot keeps a row's bits whatever the row count, else the first zero-padded width that
    does among the next power of two and its doubles (up to 4x; head_dim when none does:
    `batch_invariant` then reports the size inexact). Measured once per process. On
    XLA:CPU 32 and 48 -> 64, 80 and 96 -> 128 (at their own width the [M, 16] x [16, D]
    dot gives a row other bits at 1 or 4 rows than among 512); 16, 64 and 128 keep
    theirs. Zero columns change no other column, and they are sliced off."""
    first = next_power_of_2(head_dim)
    for width in dict.fromkeys((head_dim, first, 2 * first, 4 * first)):
        if _values_keep_rows(width):
            return width
    return head_dim


def values_at_width(v):
    """v [..., D] -> v zero-padded to [..., value_width(D)] columns (v itself when equal)."""
    d = v.shape[-1]
    width = value_width(d)
    return v if width == d else jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, width - d)])


def block_values(p, v):
    """p f32 [..., NB, M, KEY_BLOCK], v [..., NB, KEY_BLOCK, D] (any float dtype, computed
    in f32) -> f32 [..., NB, M, D]; the dot runs at `value_width(D)` columns."""
    m, d = p.shape[-2], v.shape[-1]
    return _values_dot(p, values_at_width(v.astype(jnp.float32)))[..., :m, :d]


def softmax_blocks(s, visible):
    """s f32 [..., NB, M, KB] block scores, visible bool (broadcastable to s) ->
    (p f32 [..., NB, M, KB] unnormalised, 0 where invisible; l f32 [..., NB, M] block sums).
    The max is over every visible key of a row (rows without one get p = 0)."""
    s = jnp.where(visible, s, -jnp.inf)
    top = jax.lax.stop_gradient(jnp.max(s, axis=(-3, -1), keepdims=True))  # [..., 1, M, 1]
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    p = jnp.where(visible, jnp.exp(s - top), 0.0)
    return p, tree_sum(p, -1)


def combine_blocks(o_blocks, l_blocks):
    """o_blocks f32 [..., NB, M, D], l_blocks f32 [..., NB, M] -> f32 [..., M, D]: both
    chained over blocks, first block first; rows without a visible key are 0."""
    o = chain_sum(o_blocks, -3)
    denom = chain_sum(l_blocks, -2)
    # times the reciprocal, never a division by a broadcast (XLA turns that into this
    # product in some programs only, and the kernels must follow one order)
    return o * (1.0 / jnp.where(denom > 0, denom, 1.0))[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def blocked_attention(q, k, v, visible, scale: float):
    """Attention in the canonical order for queries that share their keys.

    q [..., M, D]; k, v [..., L, D] (key j at position j of the queries' sequence);
    visible bool [..., M, L] (broadcastable). Returns f32 [..., M, D].

    Only the forward's bits are part of the contract (log-probs the sampler recorded), so
    the backward pass is plain dense attention's (`_attention_backward`): one softmax and
    four dots instead of differentiating every block's small dots and sums (6x faster at
    16 rows of 80 on XLA:CPU).
    """
    kb, vb = key_blocks(k, -2), key_blocks(v, -2)  # [..., NB, KB, D]
    vis = key_blocks(jnp.broadcast_to(visible, (*visible.shape[:-1], k.shape[-2])), -1)
    vis = jnp.moveaxis(vis, -2, -3)  # [..., NB, M, KB]
    p, l_blocks = softmax_blocks(block_scores(q, kb, scale), vis)
    return combine_blocks(block_values(p, vb), l_blocks)


def _attention_forward(q, k, v, visible, scale):
    out = blocked_attention(q, k, v, visible, scale)
    return out, (q, k, v, visible, out)


def _attention_backward(scale, residuals, d_out):
    """Cotangents of q, k, v from the softmax recomputed densely (the standard attention
    backward: dS = P * (dP - rowsum(dO * O))); visible gets none."""
    q, k, v, visible, out = residuals
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    s = jnp.where(visible, jnp.einsum("...md,...ld->...ml", q32, k32) * scale, -jnp.inf)
    top = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    total = p.sum(-1, keepdims=True)
    p = p / jnp.where(total > 0, total, 1.0)
    d_out = d_out.astype(jnp.float32)
    dv = jnp.einsum("...ml,...md->...ld", p, d_out)
    dp = jnp.einsum("...md,...ld->...ml", d_out, v32)
    ds = p * (dp - (d_out * out).sum(-1, keepdims=True)) * scale
    dq = jnp.einsum("...ml,...ld->...md", ds, k32)
    dk = jnp.einsum("...ml,...md->...ld", ds, q32)
    return (_sum_to(dq, q), _sum_to(dk, k), _sum_to(dv, v), None)


def _sum_to(grad, x):
    """grad summed over the axes x was broadcast along, in x's dtype."""
    extra = grad.ndim - x.ndim
    grad = grad.sum(tuple(range(extra))) if extra else grad
    axes = tuple(i for i, (g, n) in enumerate(zip(grad.shape, x.shape)) if n == 1 and g != 1)
    return (grad.sum(axes, keepdims=True) if axes else grad).astype(x.dtype)


blocked_attention.defvjp(_attention_forward, _attention_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def gathered_attention(q, k, v, blocks, visible, items, scale: float):
    """`blocked_attention` over only the key blocks each query tile can see: the same bits
    (a key block no query of the tile sees adds exact zeros there, so leaving it out changes
    nothing), with work proportional to the visible key blocks, not to the row or to the
    longest tile's list.

    q [..., NQ, M, D] (queries in NQ tiles of M rows); k, v [..., L, D] (L a multiple of
    TILE); blocks int32 [..., NQ, KM] (KM a multiple of KEY_BLOCK // TILE): the TILEs of
    keys each query tile attends to, in its sequence's order, entry j holding the sequence's
    positions TILE * j ... TILE * j + TILE - 1 (so each run of KEY_BLOCK // TILE entries is
    one of its key blocks), padded with any index (those tiles must be invisible); visible
    bool [..., NQ, M, KM * TILE] over the gathered keys; items int32 [..., W]: the (tile,
    key block) pairs computed, as tile * KM / (KEY_BLOCK // TILE) + block, each at most
    once, -1 = none (`all_items`: every pair; rl.packing lists those with a visible key).
    Leading dims broadcast. Returns f32 [..., NQ, M, D]. Each pair is one [M, D] x
    [D, KEY_BLOCK] and one [M, KEY_BLOCK] x [KEY_BLOCK, D] dot, as in `blocked_attention`;
    a tile's blocks are chained in order, absent ones as exact zeros. The backward pass is
    dense attention's over the same pairs.
    """
    return _gathered_forward(q, k, v, blocks, visible, items, scale)[0]


def all_items(blocks):
    """blocks int32 [..., NQ, KM] -> int32 [1, ..., 1, NQ * KM / (KEY_BLOCK // TILE)]: every (tile,
    key block) pair (`gathered_attention` then computes what the padded lists hold)."""
    nq, km = blocks.shape[-2:]
    pairs = jnp.arange(nq * (km // (KEY_BLOCK // TILE)), dtype=jnp.int32)
    return pairs.reshape((1,) * (blocks.ndim - 2) + pairs.shape)


def _take(x, index, extra: int):
    """x [*A, N, *E] (len(E) = extra), index int [*B, W] (A, B broadcastable) ->
    [*broadcast(A, B), W, *E]: entries index of the N axis (clipped)."""
    lead = jnp.broadcast_shapes(x.shape[:x.ndim - 1 - extra], index.shape[:-1])
    x = jnp.broadcast_to(x, lead + x.shape[x.ndim - 1 - extra:])
    index = jnp.broadcast_to(index, lead + index.shape[-1:])
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * extra),
                               axis=len(lead), mode="clip")


def _pairs(q, blocks, visible, items):
    """The computed pairs' operands: (tile [..., W], key TILEs [..., W, KEY_BLOCK / TILE],
    q [..., W, M, D], visible [..., W, M, KEY_BLOCK], slot [..., NQ, NB] (each tile's
    pair per key block, W = none))."""
    per = KEY_BLOCK // TILE
    nq, km = blocks.shape[-2:]
    nb = km // per
    if km % per:
        raise ValueError(f"a tile's key list must be a multiple of {per} entries (whole key "
                         f"blocks), got {km}")
    pair = jnp.maximum(items, 0)
    tile = pair // nb
    key_tiles = _take(blocks.reshape(*blocks.shape[:-2], nq * nb, per), pair, 1)
    vis = visible.reshape(*visible.shape[:-2], visible.shape[-2], nb, KEY_BLOCK)
    vis = jnp.swapaxes(vis, -3, -2).reshape(*visible.shape[:-3], nq * nb, -1, KEY_BLOCK)
    vis = _take(vis, pair, 2) & (items >= 0)[..., None, None]
    width = items.shape[-1]
    flat_lead = items.shape[:-1]
    slot = jax.vmap(lambda i: jnp.full((nq * nb,), width, jnp.int32).at[i].set(
        jnp.arange(width, dtype=jnp.int32), mode="drop"))(
            jnp.where(items >= 0, items, nq * nb).reshape(-1, width))
    slot = slot.reshape(*flat_lead, nq, nb)
    return tile, key_tiles, _take(q, tile, 2), vis, slot


def _per_tile(x, slot, fill):
    """x [..., W, *E] per pair, slot [..., NQ, NB] -> [..., NQ, NB, *E] (fill where none)."""
    extra = x.ndim - slot.ndim + 1
    pad = jnp.full((*x.shape[:slot.ndim - 2], 1, *x.shape[slot.ndim - 1:]), fill, x.dtype)
    x = jnp.concatenate([x, pad], axis=slot.ndim - 2)
    got = _take(x, slot.reshape(*slot.shape[:-2], -1), extra)
    return got.reshape(*got.shape[:slot.ndim - 2], *slot.shape[-2:], *x.shape[slot.ndim - 1:])


def _gathered_forward(q, k, v, blocks, visible, items, scale):
    tile, key_tiles, qp, vis, slot = _pairs(q, blocks, visible, items)
    kp, vp = _gather_tiles(k, key_tiles), _gather_tiles(v, key_tiles)  # [..., W, KB, D]
    s = jnp.where(vis, block_scores(qp, kp[..., None, :, :], scale)[..., 0, :, :], -jnp.inf)
    p = _pair_exp(s, vis, tile, slot)  # [..., W, M, KB]
    o = block_values(p[..., None, :, :], vp[..., None, :, :])[..., 0, :, :]
    o_blocks, l_blocks = _per_tile(o, slot, 0.0), _per_tile(tree_sum(p, -1), slot, 0.0)
    out = combine_blocks(o_blocks, l_blocks)  # [..., NQ, M, D]
    return out, (q, k, v, blocks, visible, items, out)


def _pair_exp(s, vis, tile, slot):
    """s f32 [..., W, M, KB] scores of the pairs (-inf where invisible), vis, tile, slot as
    `_pairs` gives them -> exp(s - the max over every visible key of the query's row, all
    its tile's pairs) [..., W, M, KB], 0 where invisible (a row seeing nothing gets 0)."""
    top = _per_tile(s.max(-1), slot, -jnp.inf).max(-2)  # [..., NQ, M]
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    return jnp.where(vis, jnp.exp(s - _take(top, tile, 1)[..., None]), 0.0)


def _gather_tiles(x, key_tiles):
    """x [..., L, D], key_tiles int32 [..., W, KEY_BLOCK / TILE] -> [..., W, KEY_BLOCK, D]."""
    picked = _take(_tiles(x), key_tiles.reshape(*key_tiles.shape[:-2], -1), 2)
    return picked.reshape(*picked.shape[:-3], key_tiles.shape[-2], KEY_BLOCK, x.shape[-1])


def _tiles(x):
    """x [..., L, D] (L a multiple of TILE) -> [..., L / TILE, TILE, D]."""
    length = x.shape[-2]
    if length % TILE:
        raise ValueError(f"gathered keys need a row length that is a multiple of {TILE}, "
                         f"got {length}")
    return x.reshape(*x.shape[:-2], length // TILE, TILE, x.shape[-1])


def gathered_attention_backward(scale, residuals, d_out):
    """Dense attention's backward over the computed pairs (dS = P * (dP - rowsum(dO * O)));
    query cotangents summed per tile, key cotangents summed back into their TILEs (one
    several tiles see gets all their shares)."""
    q, k, v, blocks, visible, items, out = residuals
    tile, key_tiles, qp, vis, slot = _pairs(q, blocks, visible, items)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    kp, vp = f32(_gather_tiles(k, key_tiles)), f32(_gather_tiles(v, key_tiles))
    s = jnp.where(vis, jnp.einsum("...md,...kd->...mk", f32(qp), kp) * scale, -jnp.inf)
    p = _pair_exp(s, vis, tile, slot)
    denom = _per_tile(p.sum(-1), slot, 0.0).sum(-2)  # [..., NQ, M]
    p = p * _take(1.0 / jnp.where(denom > 0, denom, 1.0), tile, 1)[..., None]
    d_out = f32(d_out)
    delta = (d_out * out).sum(-1)  # [..., NQ, M]
    d_pair = _take(d_out, tile, 2)  # [..., W, M, D]
    dv = jnp.einsum("...mk,...md->...kd", p, d_pair)
    dp = jnp.einsum("...md,...kd->...mk", d_pair, vp)
    ds = p * (dp - _take(delta, tile, 1)[..., None]) * scale
    dq = _per_tile(jnp.einsum("...mk,...kd->...md", ds, kp), slot, 0.0).sum(-3)
    dk = jnp.einsum("...mk,...md->...kd", ds, f32(qp))

    def scatter(x, dg):  # dg [..., W, KB, D] -> [..., L, D]
        xt = _tiles(x)
        lead, (nt, d) = xt.shape[:-3], (xt.shape[-3], xt.shape[-1])
        dg = jnp.broadcast_to(dg, (*lead, *dg.shape[-3:])).reshape(*lead, -1, TILE, d)
        idx = jnp.broadcast_to(key_tiles, (*lead, *key_tiles.shape[-2:])).reshape(*lead, -1)
        flat_lead = int(np.prod(lead, dtype=np.int64))
        total = jax.vmap(lambda i, g: jnp.zeros((nt, TILE, d), jnp.float32).at[i].add(g))(
            idx.reshape(flat_lead, -1), dg.reshape(flat_lead, -1, TILE, d))
        return total.reshape(*lead, nt * TILE, d).astype(x.dtype)

    return (_sum_to(dq, q), scatter(k, dk), scatter(v, dv), None, None, None)


gathered_attention.defvjp(_gathered_forward, gathered_attention_backward)


@functools.lru_cache(maxsize=None)
def batch_invariant(head_dim: int, dtype: str = "float32") -> bool:
    """Whether this backend's dots keep the blocked order's bits at `head_dim` whatever the
    number of query rows (measured once: `block_scores` and `block_values` of the same rows
    alone, among 64 and among 512). On XLA:CPU true at every head size tried (16-128), as
    `block_values` runs p @ v at `value_width`; where it is false, exactness does not hold
    and the audit takes the calibrated tolerance (rl.audit.tolerance_for)."""
    rng = np.random.default_rng(0)
    with jax.ensure_compile_time_eval(), jax.transfer_guard("allow"):  # a one-off probe
        q = jnp.asarray(rng.standard_normal((2, 512, head_dim)), dtype)
        keys = 8 * KEY_BLOCK
        k = key_blocks(jnp.asarray(rng.standard_normal((2, keys, head_dim)), dtype), -2)
        p = jnp.asarray(rng.random((2, 8, 512, KEY_BLOCK)), jnp.float32)
        v = key_blocks(jnp.asarray(rng.standard_normal((2, keys, head_dim)), dtype), -2)
        scores = jax.jit(lambda q, k: block_scores(q, k, 0.5))
        values = jax.jit(block_values)
        s_ref, o_ref = np.asarray(scores(q, k)), np.asarray(values(p, v))
        for m in (1, 4, 64):
            if not (np.array_equal(np.asarray(scores(q[:, :m], k)), s_ref[..., :m, :]) and
                    np.array_equal(np.asarray(values(p[..., :m, :], v)), o_ref[..., :m, :])):
                return False
    return True
