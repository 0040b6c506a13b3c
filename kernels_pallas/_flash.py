"""Kernel-side attention loops shared by the decode and prefill kernels: `exact_loop` (the
canonical order of kernels_pallas.blocked, the default) and `paged_flash_loop` (online
softmax, exact=False: one pass over K, flash-decoding splits)."""
from __future__ import annotations

import math
from typing import Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas._common import MASK_VALUE
from kernels_pallas.blocked import KEY_BLOCK, values_at_width

LOG2E = math.log2(math.e)
# Query rows of every dot of the compiled exact kernels (decode pads its GQA group to it,
# prefill never shrinks its tiles below it): one MMA shape (wgmma m64 on sm_90; 16 rows
# would be mma.sync) in the sampler's decode, its prefill and the trainer's attention
# (`prefill.gathered_prefill_attention`), so a query's bits cannot depend on which ran it.
EXACT_DOT_ROWS = 64
# ... and the same program around it: warps and keys per block by head_dim (from ptxas for
# sm_90, benchmarks/results/kernel_resources-*.md: the exact kernel holds p and an fp32
# p @ v, so 4 warps spill at D=128 and 8 do not; keys per block are KEY_BLOCK, the order's
# block: D=256 at 64 keys, 8 warps, 244 registers, no spills since p @ v is one K = 64 dot).
EXACT_WARPS = {64: 4, 128: 8, 256: 8}
EXACT_BLOCK_K = {128: KEY_BLOCK, 256: KEY_BLOCK}


def exact_program(head_dim: int) -> tuple[int, int]:
    """(num_warps, keys per block) of the compiled exact decode and prefill kernels."""
    size_class = 128 if head_dim <= 128 else 256
    return EXACT_WARPS[64 if head_dim <= 64 else size_class], EXACT_BLOCK_K[size_class]


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


def halving_sum(x):
    """x [rows, 2^k] -> f32 [rows]: the halving tree of `blocked.tree_sum` (x[:n/2] + x[n/2:],
    repeated), written with equal two-way splits, which the Triton lowering supports."""
    while x.shape[-1] > 1:
        left, right = jnp.split(x, 2, axis=-1)
        x = left + right
    return x[..., 0]


def _parts(x, n: int, axis: int):
    return [x] if n == 1 else jnp.split(x, n, axis=axis)


def _exact_scores(q, k_ref, page_ids, chunks, visible, sm_scale: float, block_k: int):
    """f32 [rows, block_k]: q's scores against the keys of page_ids, scaled, -inf where not
    visible (one dot per head-dim chunk, summed in chunk order)."""
    s = None
    for (off, size), qc in zip(chunks, q):
        k = k_ref[page_ids, :, pl.ds(off, size)].reshape(block_k, size).astype(qc.dtype)
        part = _dot(qc, k, 1)
        s = part if s is None else s + part
    return jnp.where(visible, s * sm_scale, -jnp.inf)


def _key_block_values(v_ref, pages_ref, page_offset, first_page, j: int, off: int, size: int):
    """V [KEY_BLOCK, size] (the pool's dtype) of key block j of the kernel block whose page
    table entries start at first_page."""
    page_size = v_ref.shape[1]
    sub_pages = max(1, KEY_BLOCK // page_size)  # pages of one key block
    sub_keys = min(page_size, KEY_BLOCK)  # its keys within each of them
    first_key = j * KEY_BLOCK
    page_ids = pages_ref[pl.ds(first_page + first_key // page_size, sub_pages)]
    return v_ref[page_ids + page_offset, pl.ds(first_key % page_size, sub_keys),
                 pl.ds(off, size)].reshape(KEY_BLOCK, size)


def _weighted(pj, v, f32_scores: bool):
    """pj [rows, KEY_BLOCK] @ v [KEY_BLOCK, size] (at the references' width in interpret
    mode, f32_scores)."""
    if not f32_scores:
        return _dot(pj, v, 0)
    return _dot(pj, values_at_width(v), 0)[:, :v.shape[1]]


def exact_loop(q, k_ref, v_ref, pages_ref, page_offset, first_block, last_block, *,
               pages_per_block: int, sm_scale: float, mask: Callable, key_valid: Callable,
               chunks, f32_scores: bool):
    """Attention of q over blocks [first_block, last_block) of pages_per_block pages in the
    canonical order of `kernels_pallas.blocked` (the references' and the trainer's order):

    pass 1: the row max over every visible key (a max is exact in any order);
    pass 2: per block, s = dot(q, k) * scale once more, p = exp(s - max) (0 where invisible),
    then for each KEY_BLOCK of it, first key first: l += halving tree sum of p,
    o += dot(p [rows, KEY_BLOCK], v [KEY_BLOCK, size]). No online rescaling.

    Key blocks of the sequence start at position 0 and a kernel block holds whole ones
    (block_k = pages_per_block * page_size, a power of two >= KEY_BLOCK), so o and l are the
    references' left-to-right chains; blocks outside [first_block, last_block) hold no
    visible key and would add exact zeros. The score dot spans the whole block (N = block_k):
    XLA:CPU (interpret mode) gives the reference's bits for N a multiple of 64.
    f32_scores: interpret mode, mirroring the references' XLA dots: q and k in fp32 for the
    score dot (as blocked.block_scores), and p @ v at `blocked.value_width` columns (v
    zero-padded, as blocked.block_values); else q and k in their own dtype (the GPU: bf16
    products are exact either way, MMA at full rate) and p @ v at the chunk's width.
    p @ v runs in fp32 (v converted; TF32 on the GPU).

    q: tuple of [rows, size] chunks; mask(i, block_k) -> bool [rows or 1, block_k] visible
    keys of block i; key_valid(i, n) -> bool [n] whether keys i * n ... i * n + n - 1 hold
    written data (V zeroed elsewhere, so NaN / Inf in free slots cannot leak).
    Returns (o: tuple of f32 [rows, size] unnormalised, l f32 [rows]).
    """
    rows = q[0].shape[0]
    block_k = pages_per_block * k_ref.shape[1]
    if block_k % KEY_BLOCK:
        raise ValueError(f"the exact order needs pages_per_block * page_size >= {KEY_BLOCK}, "
                         f"got {block_k}")
    parts = block_k // KEY_BLOCK
    if f32_scores:
        q = tuple(x.astype(jnp.float32) for x in q)

    def pages(i):
        return pages_ref[pl.ds(i * pages_per_block, pages_per_block)] + page_offset

    def scores(i, page_ids):
        return _exact_scores(q, k_ref, page_ids, chunks, mask(i, block_k), sm_scale, block_k)

    top = lax.fori_loop(first_block, last_block,
                        lambda i, m: jnp.maximum(m, scores(i, pages(i)).max(axis=-1)),
                        jnp.full((rows,), -jnp.inf, jnp.float32))
    top = jnp.where((top > -jnp.inf) & (top < jnp.inf), top, 0.0)[:, None]

    def values(i, j, off, size):
        """fp32 V [KEY_BLOCK, size] of key block j of block i; 0 where not written."""
        v = _key_block_values(v_ref, pages_ref, page_offset, i * pages_per_block, j, off, size)
        valid = key_valid(i * parts + j, KEY_BLOCK)[:, None]  # keys i*block_k + j*KB + ...
        return jnp.where(valid, v, jnp.zeros_like(v)).astype(jnp.float32)

    def body(i, carry):
        o, l = carry
        p = jnp.where(mask(i, block_k), jnp.exp(scores(i, pages(i)) - top), 0.0)
        o = list(o)
        for j, pj in enumerate(_parts(p, parts, 1)):
            l = l + halving_sum(pj)
            o = [oc + _weighted(pj, values(i, j, off, size), f32_scores)
                 for oc, (off, size) in zip(o, chunks)]
        return tuple(o), l

    carry = (tuple(jnp.zeros((rows, size), jnp.float32) for _, size in chunks),
             jnp.zeros((rows,), jnp.float32))
    return lax.fori_loop(first_block, last_block, body, carry)
