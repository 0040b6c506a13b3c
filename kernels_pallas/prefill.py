"""Paged prefill attention: ragged packed query tokens over a paged KV pool, causal.

Sequence b owns packed query rows cu_q_lens[b]:cu_q_lens[b+1]; its new token j sits at
position kv_lens[b] - q_len[b] + j and sees every KV position <= its own, the cached prefix
pages included. The GPU kernel cuts each sequence into query tiles of `block_q` tokens; one
program owns (tile, kv head) with the whole GQA group folded into its `block_rows` rows
(block_q = block_rows // G, so a group of 5 wastes 3 of 128 rows, not 3 of 8), and walks KV
pages only up to the tile's causal bound. Tiles run longest-first.

exact=True (the default) reduces in the canonical order of `kernels_pallas.blocked`
(`_flash.exact_loop`: a max pass, then per 64-key block a tree-summed exp and a K = 64 dot
with V, chained left to right): in interpret mode the kernel returns
`paged_prefill_reference`'s bits, which the trainer's dense forward reproduces. It reads K
twice and runs fp32 p @ v. exact=False: one pass with an online softmax in fp32 (exp2, scale
folded), masking only the blocks that cross the diagonal or the sequence end.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import _common as c
from kernels_pallas._flash import (EXACT_DOT_ROWS, exact_loop, exact_program, head_dim_chunks,
                                   load_chunks, paged_flash_loop, store_chunks)
from kernels_pallas.blocked import TILE, blocked_attention, gathered_attention_backward


# Query rows (tokens x GQA group) per program, warps and keys per block, by head_dim. From
# ptxas for sm_90 (benchmarks/results/kernel_resources-*.md): D=128 at 128 rows / 8 warps
# needs 224 registers -> 1 program per SM; 64 rows / 4 warps: 233 -> 2 per SM, no spills.
# D=256 spills at 64 keys per block (652-952 B); 64 rows / 8 warps / 32 keys: 222, none.
# (exact=False; the exact kernel at 64 keys: benchmarks/results/kernel_resources-2026-12-03.md)
PREFILL_ROWS = 64
PREFILL_WARPS = {128: 4, 256: 8}  # head_dim up to the key -> warps
PREFILL_BLOCK_K = {128: 64, 256: 32}
# The exact kernel's program: _flash.exact_program (shared with decode). Interpret mode
# scores 64 keys per dot: XLA:CPU gives an element the reference's bits only at multiples
# of 64.
INTERPRET_BLOCK_K = 64


def _prefill_kernel(q_ref, k_ref, v_ref, pages_ref, info_ref, o_ref, *, sm_scale: float,
                    page_size: int, pages_per_block: int, group: int, chunks, exact: bool,
                    interpret: bool):
    # q_ref [R, D] (row r is token r // group, head r % group; rows past block_q * group
    # are padding); k_ref/v_ref [L*P, page_size, D]; pages_ref int32 [W] (this tile's
    # sequence); info_ref int32 [4] = (first q position, kv_len, page offset of the layer, 0);
    # o_ref [R, D]
    rows = q_ref.shape[0]
    block_k = pages_per_block * page_size
    q_pos0 = info_ref[0]
    kv_len = info_ref[1]
    row_pos = q_pos0 + jnp.arange(rows) // group  # [rows]
    kv_end = jnp.minimum(kv_len, q_pos0 + rows // group)  # causal bound of the tile

    def visible(i, block_k):  # causal, and below the sequence's length
        col_pos = i * block_k + jnp.arange(block_k)
        return (col_pos[None, :] <= row_pos[:, None]) & (col_pos < kv_len)[None, :]

    def key_valid(i, block_k):
        return i * block_k + jnp.arange(block_k) < kv_len

    if exact:
        o, l = exact_loop(load_chunks(q_ref, chunks), k_ref, v_ref, pages_ref, info_ref[2], 0,
                          pl.cdiv(kv_end, block_k), pages_per_block=pages_per_block,
                          sm_scale=sm_scale, mask=visible, key_valid=key_valid, chunks=chunks,
                          f32_scores=interpret)
        inv = (1.0 / jnp.where(l > 0, l, 1.0))[:, None]  # as blocked.combine_blocks
        store_chunks(o_ref, tuple(x * inv for x in o), chunks)
        return
    full_blocks = jnp.minimum(q_pos0 + 1, kv_len) // block_k  # visible to every row
    o, _, l = paged_flash_loop(load_chunks(q_ref, chunks), k_ref, v_ref, pages_ref,
                               info_ref[2], 0, full_blocks, pl.cdiv(kv_end, block_k),
                               pages_per_block=pages_per_block, sm_scale=sm_scale,
                               mask=visible,
                               key_valid=key_valid,
                               chunks=chunks)
    inv_l = 1.0 / jnp.where(l > 0, l, 1.0)
    store_chunks(o_ref, tuple(x * inv_l[:, None] for x in o), chunks)


def _tile_plan(cu_q_lens, kv_lens, num_tokens: int, block_q: int):
    """Maps query tiles of block_q tokens to sequences, longest causal bound first.

    Uses a static upper bound of cdiv(T, block_q) + B tiles; the surplus tiles have kv_len 0
    and do no work. Tiles are ordered by decreasing causal bound (their K/V work), so the
    longest programs start first and the short ones fill the tail of the grid.
    Returns tile_seq int32 [NT], q_pos0 int32 [NT] (position of the tile's first token),
    kv_len int32 [NT], src int32 [NT, block_q] (packed row of each tile row; num_tokens for
    rows past a sequence's end).
    """
    num_seqs = kv_lens.shape[0]
    num_tiles = pl.cdiv(num_tokens, block_q) + num_seqs
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    tiles_per_seq = pl.cdiv(q_lens, block_q)
    tile_end = jnp.cumsum(tiles_per_seq)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_seq = jnp.clip(jnp.searchsorted(tile_end, tile, side="right"), 0, num_seqs - 1)
    tile_real = tile < tile_end[-1]
    tile_q0 = (tile - (tile_end - tiles_per_seq)[tile_seq]) * block_q  # offset in the sequence
    q_pos0 = kv_lens[tile_seq] - q_lens[tile_seq] + tile_q0
    kv_len = jnp.where(tile_real, kv_lens[tile_seq], 0)
    order = jnp.argsort(-jnp.minimum(kv_len, q_pos0 + block_q), stable=True)
    tile_seq, tile_real, tile_q0, q_pos0, kv_len = (
        x[order] for x in (tile_seq, tile_real, tile_q0, q_pos0, kv_len))
    j = jnp.arange(block_q)
    row_real = tile_real[:, None] & (tile_q0[:, None] + j[None, :] < q_lens[tile_seq][:, None])
    src = jnp.where(row_real, cu_q_lens[tile_seq][:, None] + tile_q0[:, None] + j[None, :],
                    num_tokens)
    return (tile_seq.astype(jnp.int32), q_pos0.astype(jnp.int32), kv_len.astype(jnp.int32),
            src.astype(jnp.int32))


def _scatter_tiles(out, src, num_tokens: int):
    """out [NT, block_q, Hq, D] -> packed [T, Hq, D]; rows with src == T are dropped."""
    packed = jnp.zeros((num_tokens + 1,) + out.shape[2:], out.dtype)
    return packed.at[src.reshape(-1)].set(out.reshape((-1,) + out.shape[2:]),
                                          mode="drop")[:num_tokens]


def prefill_rows(num_tokens: int, group: int, rows: int | None = None) -> int:
    """Rows of one program: `rows` (default PREFILL_ROWS), shrunk for short inputs, >= 16."""
    rows = PREFILL_ROWS if rows is None else rows
    if not c.is_power_of_2(rows) or rows < group:
        raise ValueError(f"block_rows must be a power of two >= the GQA group {group}, "
                         f"got {rows}")
    return max(16, c.next_power_of_2(group), min(rows, c.next_power_of_2(num_tokens * group)))


def _prefill_pallas(q, k_pages, v_pages, page_offset, page_table, cu_q_lens, kv_lens, *,
                    sm_scale, block_rows, pages_per_block, num_warps, num_stages, interpret,
                    exact):
    # k_pages/v_pages [L*P, Hkv, ps, D] (flattened pool); page_offset int32 scalar
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    if exact and block_rows is None:  # one dot shape everywhere (_flash.EXACT_DOT_ROWS)
        rows = max(EXACT_DOT_ROWS, c.next_power_of_2(group))
        block_q = rows // group
    else:
        rows = prefill_rows(num_tokens, group, block_rows)
        block_q = rows // group  # tokens per tile; rows past block_q * group are padding
    size_class = 128 if head_dim <= 128 else 256
    if num_warps is None:
        num_warps = exact_program(head_dim)[0] if exact else PREFILL_WARPS[size_class]
    if pages_per_block is None:
        block_k = (INTERPRET_BLOCK_K if interpret else exact_program(head_dim)[1] if exact
                   else PREFILL_BLOCK_K[size_class])
        pages_per_block = max(1, block_k // page_size)
    if not c.is_power_of_2(pages_per_block):
        raise ValueError(f"pages_per_block must be a power of two, got {pages_per_block}")
    if not interpret and pages_per_block * page_size < 16:
        raise ValueError(f"pages_per_block * page_size = {pages_per_block * page_size} "
                         "must be >= 16 for the compiled kernel")
    width = pl.cdiv(page_table.shape[1], pages_per_block) * pages_per_block
    if width != page_table.shape[1]:  # a no-op for the engine's table widths
        page_table = jnp.pad(page_table, ((0, 0), (0, width - page_table.shape[1])))

    tile_seq, q_pos0, kv_len, src = _tile_plan(cu_q_lens, kv_lens, num_tokens, block_q)
    num_tiles = tile_seq.shape[0]
    zeros = jnp.zeros_like(tile_seq)
    info = jnp.stack([q_pos0, kv_len, zeros + page_offset, zeros], axis=1)  # [NT, 4]
    tile_pages = page_table[tile_seq]  # [NT, W]

    # Gather q into [NT, Hkv, R, D]; rows past a sequence's end or the tile are zeros.
    qg = jnp.pad(q, ((0, 1), (0, 0), (0, 0)))[src]  # [NT, block_q, Hq, D]
    qg = qg.reshape(num_tiles, block_q, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qg = qg.reshape(num_tiles, num_kv_heads, block_q * group, head_dim)
    if rows != block_q * group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - block_q * group), (0, 0)))

    kernel = functools.partial(_prefill_kernel, sm_scale=sm_scale, page_size=page_size,
                               pages_per_block=pages_per_block, group=group,
                               chunks=head_dim_chunks(head_dim), exact=exact,
                               interpret=interpret)
    out = pl.pallas_call(
        kernel,
        grid=(num_kv_heads, num_tiles),  # heads vary fastest: tiles start longest first
        in_specs=[
            pl.BlockSpec((None, None, rows, head_dim), lambda h, t: (t, h, 0, 0)),
            pl.BlockSpec((num_pages, None, page_size, head_dim), lambda h, t: (0, h, 0, 0)),
            pl.BlockSpec((num_pages, None, page_size, head_dim), lambda h, t: (0, h, 0, 0)),
            pl.BlockSpec((None, width), lambda h, t: (t, 0)),
            pl.BlockSpec((None, 4), lambda h, t: (t, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, rows, head_dim), lambda h, t: (t, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((num_tiles, num_kv_heads, rows, head_dim), q.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="paged_prefill_attention",
    )(qg, k_pages, v_pages, tile_pages, info)

    out = out[:, :, :block_q * group].reshape(num_tiles, num_kv_heads, block_q, group, head_dim)
    out = out.transpose(0, 2, 1, 3, 4)  # [NT, block_q, Hkv, G, D]
    return _scatter_tiles(out.reshape(num_tiles, block_q, num_q_heads, head_dim), src,
                          num_tokens)


def paged_prefill_reference(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, *,
                            layer=None, sm_scale=None, block_q: int = 32):
    """Pure-jnp paged prefill (the `xla` backend) in the canonical order of
    `kernels_pallas.blocked`: bit for bit what the dense causal forward computes.

    Query tiles of block_q tokens each gather their sequence's pages once and attend them
    block by block; memory O(T / block_q * W * page_size), fine on CPU for the demo.
    Shapes as `paged_prefill_attention`; gathers the table's pages of one layer, never the layer.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[-3]
    k_pages, page_offset = c.flatten_pool(k_pages, layer)
    v_pages, _ = c.flatten_pool(v_pages, layer)
    group = num_q_heads // num_kv_heads
    scale = c.default_scale(sm_scale, head_dim)
    block_q = min(block_q, c.next_power_of_2(num_tokens))
    tile_seq, q_pos0, kv_len, src = _tile_plan(cu_q_lens, kv_lens, num_tokens, block_q)
    num_tiles = tile_seq.shape[0]

    k, v = c.gather_kv(k_pages, v_pages, page_table[tile_seq] + page_offset,  # [NT, Hkv, L, D]
                       q.dtype)
    col = jnp.arange(k.shape[2])
    v = jnp.where((col[None, :] < kv_len[:, None])[:, None, :, None], v, jnp.zeros_like(v))
    qt = jnp.pad(q, ((0, 1), (0, 0), (0, 0)))[src]  # [NT, bq, Hq, D]
    qt = qt.reshape(num_tiles, block_q, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qt = qt.reshape(num_tiles, num_kv_heads, block_q * group, head_dim)
    row_pos = jnp.repeat(q_pos0[:, None] + jnp.arange(block_q)[None, :], group, axis=1)
    visible = (col[None, None, :] <= row_pos[:, :, None]) & (col[None, None, :]
                                                              < kv_len[:, None, None])
    out = blocked_attention(qt, k, v, visible[:, None], scale)  # [NT, Hkv, bq * G, D]
    out = out.reshape(num_tiles, num_kv_heads, block_q, group, head_dim).transpose(0, 2, 1, 3, 4)
    out = out.reshape(num_tiles, block_q, num_q_heads, head_dim).astype(q.dtype)
    return _scatter_tiles(out, src, num_tokens)


@c.kernel_keyed_jit(static_argnames=(
    "sm_scale", "backend", "block_rows", "pages_per_block", "num_warps", "num_stages",
    "exact"))
def paged_prefill_attention(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, *,
                            layer=None, sm_scale=None, backend="auto", block_rows=None,
                            pages_per_block=None, num_warps=None, num_stages=2,
                            exact=True):
    """Causal attention of packed new tokens over their sequences' pages.

    q [T, Hq, D] packed new tokens (T may exceed cu_q_lens[-1]; padded rows return zeros);
    k_pages, v_pages [P, Hkv, page_size, D], or stacked [L, P, Hkv, page_size, D] with `layer`
    an int32 scalar (may be traced); page_table int32 [B, W];
    cu_q_lens int32 [B + 1] offsets of each sequence's new tokens; kv_lens int32 [B] cached
    prefix + new tokens. Returns [T, Hq, D] in q's dtype with fp32 accumulation.
    exact (kernels only; the xla backend is always exact): True reduces in the canonical
    order of `kernels_pallas.blocked`; in interpret mode the result is the xla backend's,
    bit for bit, for fp32 and bf16 with a power-of-two head_dim (80 or 96 run as two chunks
    whose partial score dots are summed: another order) and pages_per_block * page_size a
    multiple of 64 (the default). False: one pass with an online softmax (faster on GPU).
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {q.shape}")
    c.check_pages("q", q, k_pages, v_pages, layer)
    for name, x in (("page_table", page_table), ("cu_q_lens", cu_q_lens), ("kv_lens", kv_lens)):
        c.check_int32(name, x)
    if page_table.ndim != 2:
        raise ValueError(f"page_table must be [B, W], got shape {page_table.shape}")
    num_seqs = page_table.shape[0]
    if kv_lens.shape != (num_seqs,):
        raise ValueError(f"kv_lens must be [B={num_seqs}], got shape {kv_lens.shape}")
    if cu_q_lens.shape != (num_seqs + 1,):
        raise ValueError(f"cu_q_lens must be [B+1={num_seqs + 1}], got shape {cu_q_lens.shape}")
    backend = c.resolve_backend(backend)
    scale = c.default_scale(sm_scale, q.shape[-1])
    if backend == "xla":
        return paged_prefill_reference(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens,
                                       layer=layer, sm_scale=scale)
    c.check_kernel_shapes(k_pages.shape[-2], q.shape[-1])
    k_flat, page_offset = c.flatten_pool(k_pages, layer)
    v_flat, _ = c.flatten_pool(v_pages, layer)
    return _prefill_pallas(q, k_flat, v_flat, page_offset, page_table, cu_q_lens, kv_lens,
                           sm_scale=scale,
                           block_rows=block_rows, pages_per_block=pages_per_block,
                           num_warps=num_warps, num_stages=num_stages,
                           interpret=backend == "interpret", exact=exact)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def gathered_prefill_attention(q, k, v, blocks, visible, items, scale: float, backend: str):
    """`blocked.gathered_attention` computed by the paged prefill kernel: the trainer's
    attention on the sampler's own program (on a GPU, where XLA's dots change their bits
    with the row count, the only way its bits can be the sampler's).

    The row's keys are viewed as a pool of TILE-token pages and each query tile as a
    sequence whose page table is its list of TILEs: the kernel's causal-by-position mask is
    then `visible` for packed rows whose sequences start on tile edges and whose tiles
    list every TILE they see in their sequence's order, their own last (`rl.packing` builds
    them so). Shapes as `gathered_attention`: q [B, Hkv, NQ, TILE * G, D]; k, v
    [B, Hkv, L, D] (L a multiple of TILE); blocks int32 [B, Hkv, NQ, KM] (the same for every
    head); visible bool [B, 1, NQ, TILE * G, KM * TILE] (counts the TILEs a tile sees);
    items int32 [B, 1, W] (the backward pass's pairs, as gathered_attention's).
    Returns f32 [B, Hkv, NQ, TILE * G, D]. The backward pass is gathered_attention's.
    """
    return _gathered_prefill(q, k, v, blocks, visible, scale, backend)


def _gathered_prefill(q, k, v, blocks, visible, scale, backend):
    batch, hkv, nq, rows, d = q.shape
    group, length = rows // TILE, k.shape[2]
    nb, km = length // TILE, blocks.shape[-1]
    seen = visible.reshape(batch, nq, rows, km, TILE).any(axis=(2, 4))  # [B, NQ, KM]
    kv_lens = (TILE * seen.sum(-1)).astype(jnp.int32).reshape(-1)  # [B * NQ]
    table = (jnp.arange(batch, dtype=jnp.int32)[:, None, None] * nb
             + jnp.clip(blocks[:, 0], 0, nb - 1)).reshape(batch * nq, km)

    def pool(x):  # [B, Hkv, L, D] -> pages [B * NB, Hkv, TILE, D]
        x = x.reshape(batch, hkv, nb, TILE, d).transpose(0, 2, 1, 3, 4)
        return x.reshape(batch * nb, hkv, TILE, d)

    packed = q.reshape(batch, hkv, nq, TILE, group, d).transpose(0, 2, 3, 1, 4, 5)
    packed = packed.reshape(batch * nq * TILE, hkv * group, d)
    cu_q_lens = jnp.arange(batch * nq + 1, dtype=jnp.int32) * TILE
    out = paged_prefill_attention(packed, pool(k), pool(v), table, cu_q_lens, kv_lens,
                                  sm_scale=scale, backend=backend)  # [B * NQ * KB, Hq, D]
    out = out.reshape(batch, nq, TILE, hkv, group, d).transpose(0, 3, 1, 2, 4, 5)
    return out.reshape(q.shape).astype(jnp.float32)


def _gathered_prefill_forward(q, k, v, blocks, visible, items, scale, backend):
    out = _gathered_prefill(q, k, v, blocks, visible, scale, backend)
    return out, (q, k, v, blocks, visible, items, out)


def _gathered_prefill_backward(scale, backend, residuals, d_out):
    return gathered_attention_backward(scale, residuals, d_out)


gathered_prefill_attention.defvjp(_gathered_prefill_forward, _gathered_prefill_backward)
