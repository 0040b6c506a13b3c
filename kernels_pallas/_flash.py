"""Kernel-side flash-attention loop shared by the decode and prefill kernels."""
from __future__ import annotations

import math
from typing import Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas._common import MASK_VALUE

LOG2E = math.log2(math.e)


def _dot(a, b, contract_b: int):
    """a [M, K] x b ([N, K] if contract_b == 1 else [K, N]) -> f32 [M, N]. Plain dot_general:
    the Pallas Triton lowering maps it to tl.dot on every jax version (0.10 and 0.11)."""
    return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())),
                           preferred_element_type=jnp.float32)


def head_dim_chunks(head_dim: int) -> tuple[tuple[int, int], ...]:
    """(offset, size) power-of-two chunks >= 16 covering head_dim, largest first.

    80 -> (0, 64), (64, 16); 96 -> (0, 64), (64, 32); 128 -> (0, 128). The kernels run one
    dot per chunk, so head sizes that are not a power of two need neither a padded pool copy
    nor masked loads. Requires head_dim to be a positive multiple of 16.
    """
    chunks, offset = [], 0
    for bit in reversed(range(head_dim.bit_length())):
        size = 1 << bit
        if head_dim & size:
            chunks.append((offset, size))
            offset += size
    return tuple(chunks)


def load_chunks(ref, chunks):
    """ref [..., D] -> tuple of [..., size] loads, one per head-dim chunk."""
    return tuple(ref[..., pl.ds(off, size)] for off, size in chunks)


def store_chunks(ref, x, chunks):
    """Stores the chunk tuple x (as from `paged_flash_loop`) into ref [..., D]."""
    for (off, size), part in zip(chunks, x):
        ref[..., pl.ds(off, size)] = part.astype(ref.dtype)


def paged_flash_loop(q, k_ref, v_ref, pages_ref, page_offset, first_block, masked_from,
                     last_block, *, pages_per_block: int, sm_scale: float, mask: Callable,
                     key_valid: Callable, chunks):
    """Online softmax (base 2) of q over blocks [first_block, last_block) of pages_per_block pages.

    q: tuple of [rows, size] chunks of the query rows (see `head_dim_chunks`);
    k_ref, v_ref [L*P, page_size, D] (one kv head, layers flattened); pages_ref int32 [W]
    page ids within the layer; page_offset int32 scalar (layer * P).
    Blocks below `masked_from` must be fully visible to every row and hold only written keys:
    they skip the masks. From `masked_from` on, mask(i, block_k) -> bool [rows or 1, block_k]
    (True where block i's key is visible) applies, and key_valid(i, block_k) -> bool [block_k]
    (True for keys that hold written data) zeroes V elsewhere, so NaN/Inf in free slots or the
    null page cannot reach the output.
    Returns (o: tuple of f32 [rows, size] unnormalised, m f32 [rows] running max of the
    log2-scaled scores, l f32 [rows] row sum); the scale and log2(e) are folded into one
    multiply so every exponential is an exp2.
    """
    rows = q[0].shape[0]
    block_k = pages_per_block * k_ref.shape[1]
    qk_scale = sm_scale * LOG2E

    def body(i, carry, masked: bool):
        o, m, l = carry
        page_ids = pages_ref[pl.ds(i * pages_per_block, pages_per_block)] + page_offset
        s = None
        for (off, size), qc in zip(chunks, q):
            k = k_ref[page_ids, :, pl.ds(off, size)].reshape(block_k, size)
            part = _dot(qc, k, 1)
            s = part if s is None else s + part
        s = s * qk_scale  # [rows, block_k]
        if masked:
            s = jnp.where(mask(i, block_k), s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l_new = alpha * l + p.sum(axis=-1)
        o_new = []
        for (off, size), oc in zip(chunks, o):
            v = v_ref[page_ids, :, pl.ds(off, size)].reshape(block_k, size)
            if masked:
                v = jnp.where(key_valid(i, block_k)[:, None], v, jnp.zeros_like(v))
            o_new.append(alpha[:, None] * oc + _dot(p.astype(v.dtype), v, 0))
        return tuple(o_new), m_new, l_new

    carry = (tuple(jnp.zeros((rows, size), jnp.float32) for _, size in chunks),
             jnp.full((rows,), MASK_VALUE, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    masked_from = jnp.clip(masked_from, first_block, last_block)
    carry = lax.fori_loop(first_block, masked_from, lambda i, c: body(i, c, False), carry)
    return lax.fori_loop(masked_from, last_block, lambda i, c: body(i, c, True), carry)


def _halving_sum(x):
    """x [rows, 2^k] -> [rows]: the halving tree of `blocked.tree_sum` (equal splits, which
    the Triton lowering supports)."""
    while x.shape[-1] > 1:
        left, right = jnp.split(x, 2, axis=-1)
        x = left + right
    return x[..., 0]


def exact_flash_loop(q, k_ref, v_ref, pages_ref, page_offset, first_block, last_block, *,
                     pages_per_block: int, sm_scale: float, mask: Callable,
                     key_valid: Callable, chunks, key_block: int = 16):
    """Attention of q over blocks [first_block, last_block) in the canonical order of
    `kernels_pallas.blocked` (what the references and the trainer compute, bit for bit in
    interpret mode): pass 1 takes the row max over every visible key; pass 2 adds, block by
    block and within a block `key_block` keys at a time, first key first, the tree-summed
    exp(s - max) and its dot with V. No online rescaling: the max is final before any sum.

    q: chunks of [rows, size]; mask(i, block_k) -> bool [rows or 1, block_k] visible keys;
    key_valid(i, block_k) -> bool [block_k] written keys (V zeroed elsewhere). Blocks
    outside [first_block, last_block) hold no visible key. Returns (o: tuple of f32
    [rows, size] unnormalised, l f32 [rows]).
    """
    rows = q[0].shape[0]
    block_k = pages_per_block * k_ref.shape[1]
    parts = block_k // key_block

    def scores(i, page_ids):
        s = None
        for (off, size), qc in zip(chunks, q):  # fp32 operands, as blocked.block_scores
            k = k_ref[page_ids, :, pl.ds(off, size)].reshape(block_k, size)
            part = _dot(qc.astype(jnp.float32), k.astype(jnp.float32), 1)
            s = part if s is None else s + part
        return jnp.where(mask(i, block_k), s * sm_scale, -jnp.inf)

    def pages(i):
        return pages_ref[pl.ds(i * pages_per_block, pages_per_block)] + page_offset

    top = lax.fori_loop(first_block, last_block,
                        lambda i, m: jnp.maximum(m, scores(i, pages(i)).max(axis=-1)),
                        jnp.full((rows,), -jnp.inf, jnp.float32))
    top = jnp.where(top > -jnp.inf, top, 0.0)

    def body(i, carry):
        o, l = carry
        page_ids = pages(i)
        visible = mask(i, block_k)
        p = jnp.where(visible, jnp.exp(scores(i, page_ids) - top[:, None]), 0.0)
        valid = key_valid(i, block_k)[:, None]
        p_parts = jnp.split(p, parts, axis=-1) if parts > 1 else [p]
        o_new = list(o)
        for j, pj in enumerate(p_parts):
            l = l + _halving_sum(pj)
            for c, (off, size) in enumerate(chunks):
                v = v_ref[page_ids, :, pl.ds(off, size)].reshape(block_k, size)
                v = jnp.where(valid, v, jnp.zeros_like(v)).astype(jnp.float32)
                vj = jnp.split(v, parts, axis=0)[j] if parts > 1 else v
                o_new[c] = o_new[c] + _dot(pj, vj, 0)
        return tuple(o_new), l

    carry = (tuple(jnp.zeros((rows, size), jnp.float32) for _, size in chunks),
             jnp.zeros((rows,), jnp.float32))
    return lax.fori_loop(first_block, last_block, body, carry)
