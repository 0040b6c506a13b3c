"""Paged decode attention: one new query token per sequence over a paged KV pool.

Flash-decoding on GPU: each program owns one (sequence, kv head, split) and the whole GQA
group of query heads (padded to the 16 rows `tl.dot` needs). The sequence's page list is cut
into `num_splits` contiguous chunks handled by separate programs; each walks only the pages
below its row's `seq_len`, keeps an online softmax in fp32 and writes (o, l, m). The chunks
are merged afterwards with the log-sum-exp rule. Rows with `seq_len == 0` return zeros.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import _common as c
from kernels_pallas._flash import paged_flash_loop

MIN_DOT_ROWS = 16  # tl.dot needs M, N, K >= 16


def _decode_kernel(q_ref, k_ref, v_ref, pages_ref, len_ref, offset_ref, o_ref, l_ref, m_ref, *,
                   sm_scale: float, page_size: int, pages_per_block: int):
    # q_ref [G_pad, D]; k_ref/v_ref [L*P, page_size, D] (this program's kv head);
    # pages_ref int32 [pages_per_split]; len_ref int32 [1]; offset_ref int32 [1] (layer * P);
    # o_ref f32 [G_pad, D]; l_ref, m_ref f32 [G_pad]
    split = pl.program_id(2)
    pages_per_split = pages_ref.shape[0]
    seq_len = len_ref[0]
    first_page = split * pages_per_split
    valid_pages = jnp.clip(pl.cdiv(seq_len, page_size) - first_page, 0, pages_per_split)
    num_blocks = pl.cdiv(valid_pages, pages_per_block)

    def visible(i, block_k):  # keys below this row's length
        pos = (first_page + i * pages_per_block) * page_size + jnp.arange(block_k)
        return (pos < seq_len)[None, :]

    o, m, l = paged_flash_loop(q_ref[...], k_ref, v_ref, pages_ref, offset_ref[0], num_blocks,
                               pages_per_block=pages_per_block, sm_scale=sm_scale,
                               mask=visible)
    o_ref[...] = o
    l_ref[...] = l
    m_ref[...] = m


def merge_splits(o, l, m):
    """Log-sum-exp merge of split-K partials.

    o [S, ..., D] unnormalised outputs, l [S, ...] sums, m [S, ...] maxima -> [..., D] fp32.
    Partials with l == 0 (no valid token) contribute nothing; all-empty rows give zeros.
    """
    m_all = m.max(axis=0)
    w = jnp.where(l > 0, jnp.exp(m - m_all[None]), 0.0)
    denom = (l * w).sum(axis=0)
    num = (o * w[..., None]).sum(axis=0)
    return jnp.where(denom[..., None] > 0, num / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)


def _decode_pallas(q, k_pages, v_pages, page_offset, page_table, seq_lens, *, sm_scale,
                   pages_per_block, num_splits, num_warps, num_stages, interpret):
    # k_pages/v_pages [L*P, Hkv, ps, D] (flattened pool); page_offset int32 scalar
    batch, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    rows = max(MIN_DOT_ROWS, c.next_power_of_2(group))
    max_pages = page_table.shape[1]
    if pages_per_block is None:
        pages_per_block = max(1, 64 // page_size)
    if not c.is_power_of_2(pages_per_block):
        raise ValueError(f"pages_per_block must be a power of two, got {pages_per_block}")
    if not interpret and pages_per_block * page_size < MIN_DOT_ROWS:
        raise ValueError(
            f"pages_per_block * page_size = {pages_per_block * page_size} must be >= 16 "
            "for the compiled kernel (tl.dot minimum)")
    num_blocks = pl.cdiv(max_pages, pages_per_block)
    if num_splits is None:
        num_splits = min(16, c.next_power_of_2(max(1, num_blocks // 4)))
    num_splits = min(num_splits, c.next_power_of_2(num_blocks))
    pages_per_split = c.next_power_of_2(pl.cdiv(num_blocks, num_splits)) * pages_per_block
    padded_pages = pages_per_split * num_splits
    page_table = jnp.pad(page_table, ((0, 0), (0, padded_pages - max_pages)))

    qg = q.reshape(batch, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    kernel = functools.partial(_decode_kernel, sm_scale=sm_scale, page_size=page_size,
                               pages_per_block=pages_per_block)
    part_shape = (num_splits, batch, num_kv_heads, rows)
    o, l, m = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
            pl.BlockSpec((num_pages, None, page_size, head_dim), lambda b, h, s: (0, h, 0, 0)),
            pl.BlockSpec((num_pages, None, page_size, head_dim), lambda b, h, s: (0, h, 0, 0)),
            pl.BlockSpec((None, pages_per_split), lambda b, h, s: (b, s)),
            pl.BlockSpec((1,), lambda b, h, s: (b,)),
            pl.BlockSpec((1,), lambda b, h, s: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (s, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (s, b, h, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (s, b, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*part_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(part_shape, jnp.float32),
            jax.ShapeDtypeStruct(part_shape, jnp.float32),
        ],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="paged_decode_attention",
    )(qg, k_pages, v_pages, page_table, seq_lens, page_offset.reshape(1))
    out = merge_splits(o, l, m)[:, :, :group]  # [B, Hkv, G, D]
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def paged_decode_reference(q, k_pages, v_pages, page_table, seq_lens, *, layer=None,
                           sm_scale=None):
    """Pure-jnp paged decode: gathers each row's pages once, then dense masked attention.

    q [B, Hq, D]; k_pages/v_pages [P, Hkv, page_size, D] or [L, P, Hkv, page_size, D] with
    `layer`; page_table int32 [B, W]; seq_lens int32 [B] -> [B, Hq, D]. This is the `xla`
    backend (the fast CPU path); it gathers the table's pages of one layer, never the layer.
    """
    batch, num_q_heads, head_dim = q.shape
    *_, num_kv_heads, page_size, _ = k_pages.shape
    k_pages, page_offset = c.flatten_pool(k_pages, layer)
    v_pages, _ = c.flatten_pool(v_pages, layer)
    page_table = page_table + page_offset
    group = num_q_heads // num_kv_heads
    scale = c.default_scale(sm_scale, head_dim)

    def gather(pages):  # -> [B, Hkv, W * page_size, D]
        x = pages[page_table]  # [B, W, Hkv, ps, D]
        x = jnp.swapaxes(x, 1, 2)
        return x.reshape(batch, num_kv_heads, -1, head_dim)

    k, v = gather(k_pages).astype(jnp.float32), gather(v_pages).astype(jnp.float32)
    qg = q.reshape(batch, num_kv_heads, group, head_dim).astype(jnp.float32)
    s = jnp.einsum("bhgd,bhld->bhgl", qg, k, preferred_element_type=jnp.float32) * scale
    valid = jnp.arange(k.shape[2])[None, :] < seq_lens[:, None]  # [B, L]
    s = jnp.where(valid[:, None, None, :], s, c.MASK_VALUE)
    p = jnp.exp(s - s.max(axis=-1, keepdims=True))
    p = jnp.where(valid[:, None, None, :], p, 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhgl,bhld->bhgd", p, v)
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "backend", "pages_per_block", "num_splits", "num_warps", "num_stages"))
def paged_decode_attention(q, k_pages, v_pages, page_table, seq_lens, *, layer=None,
                           sm_scale=None, backend="auto", pages_per_block=None,
                           num_splits=None, num_warps=4, num_stages=2):
    """Attention of one query token per sequence over its pages.

    q [B, Hq, D]; k_pages, v_pages [P, Hkv, page_size, D] (page 0 is the null page), or a
    stacked [L, P, Hkv, page_size, D] pool with `layer` an int32 scalar (may be traced);
    page_table int32 [B, W] (unused slots hold 0); seq_lens int32 [B] (0 = padded row).
    Returns [B, Hq, D] in q's dtype; fp32 accumulation; rows with seq_len 0 are zeros.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {q.shape}")
    c.check_pages("q", q, k_pages, v_pages, layer)
    c.check_int32("page_table", page_table)
    c.check_int32("seq_lens", seq_lens)
    if page_table.ndim != 2 or page_table.shape[0] != q.shape[0]:
        raise ValueError(f"page_table must be [B={q.shape[0]}, W], got shape {page_table.shape}")
    if seq_lens.shape != (q.shape[0],):
        raise ValueError(f"seq_lens must be [B={q.shape[0]}], got shape {seq_lens.shape}")
    backend = c.resolve_backend(backend)
    scale = c.default_scale(sm_scale, q.shape[-1])
    if backend == "xla":
        return paged_decode_reference(q, k_pages, v_pages, page_table, seq_lens, layer=layer,
                                      sm_scale=scale)
    c.check_kernel_shapes(k_pages.shape[-2], q.shape[-1])
    k_flat, page_offset = c.flatten_pool(k_pages, layer)
    v_flat, _ = c.flatten_pool(v_pages, layer)
    return _decode_pallas(q, k_flat, v_flat, page_offset, page_table, seq_lens, sm_scale=scale,
                          pages_per_block=pages_per_block, num_splits=num_splits,
                          num_warps=num_warps, num_stages=num_stages,
                          interpret=backend == "interpret")
