"""Kernel-side flash-attention loop shared by the decode and prefill kernels."""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas._common import MASK_VALUE


def paged_flash_loop(q, k_ref, v_ref, pages_ref, page_offset, num_blocks, *,
                     pages_per_block: int, sm_scale: float, mask: Callable):
    """Online softmax of q over `num_blocks` blocks of pages_per_block pages each.

    q [rows, D]; k_ref, v_ref [L*P, page_size, D] (one kv head, layers flattened);
    pages_ref int32 [W] page ids within the layer; page_offset int32 scalar (layer * P);
    mask(i, block_k) -> bool [rows or 1, block_k], True where block i's key is visible.
    Returns (o f32 [rows, D] unnormalised, m f32 [rows] row max, l f32 [rows] row sum).
    """
    rows, head_dim = q.shape
    block_k = pages_per_block * k_ref.shape[1]

    def body(i, carry):
        o, m, l = carry
        page_ids = pages_ref[pl.ds(i * pages_per_block, pages_per_block)] + page_offset
        k = k_ref[page_ids].reshape(block_k, head_dim)
        v = v_ref[page_ids].reshape(block_k, head_dim)
        s = plgpu.dot(q, k.T).astype(jnp.float32) * sm_scale  # [rows, block_k]
        s = jnp.where(mask(i, block_k), s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l_new = alpha * l + p.sum(axis=-1)
        o_new = alpha[:, None] * o + plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return o_new, m_new, l_new

    init = (jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), jnp.finfo(jnp.float32).min, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    return lax.fori_loop(0, num_blocks, body, init)
