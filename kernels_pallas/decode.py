"""Paged decode attention: one new query token per sequence over a paged KV pool.

Each program owns one (sequence, kv head, split) and the whole GQA group of query heads
(padded to the 16 rows `tl.dot` needs).

exact=True (the default): one split per (sequence, kv head), reducing in the canonical order
of `kernels_pallas.blocked` (`_flash.exact_loop`: a max pass over the keys, then per 64-key
block a tree-summed exp and a K = 64 dot with V, chained left to right), so in interpret mode
the kernel returns `paged_decode_reference`'s bits, which the trainer's dense forward
reproduces. Splitting the keys would break that chain, so there is no flash-decoding.

exact=False: flash-decoding. `plan_decode` picks the split count on the host from batch, SM
count and the longest length; each row divides its own valid blocks evenly among its splits
(short rows use fewer, the rest idle), keeps an online softmax in fp32 (exp2, scale folded)
and, when unsplit, writes the normalised output directly; otherwise (o, lse) partials of the
group's rows, merged by one log-sum-exp in XLA.
Rows with `seq_len == 0` return zeros.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import _common as c
from kernels_pallas._common import MASK_VALUE
from kernels_pallas.blocked import (KEY_BLOCK, block_scores, block_values, combine_blocks,
                                    key_blocks, softmax_blocks)
from kernels_pallas._flash import (EXACT_DOT_ROWS, exact_loop, exact_program, head_dim_chunks,
                                   load_chunks, paged_flash_loop, store_chunks)

MIN_DOT_ROWS = 16  # tl.dot needs M, N, K >= 16
DEFAULT_NUM_SMS = 132  # H100 SXM / H200; on a GPU the device's own count is used
PROGRAMS_PER_SM = 4  # resident decode programs per SM at D=128 (registers; see benchmarks/)
PARTIAL_BUDGET = 1 / 8  # max fp32 partial traffic (write + read) relative to a split's K/V


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Static work plan of one decode call (all Python ints; see `plan_decode`)."""
    batch: int
    num_kv_heads: int
    group: int  # query heads per kv head
    group_rows: int  # next_power_of_2(group): rows of the partials and of the output tile
    dot_rows: int  # max(16, group_rows): rows of q in the kernel (tl.dot minimum; 64 compiled
    #                exact, set by paged_decode_attention: _flash.EXACT_DOT_ROWS)
    head_dim: int
    page_size: int
    pages_per_block: int
    table_blocks: int  # blocks of the padded page table
    max_blocks: int  # blocks of the longest row (from max_kv_len)
    min_blocks_per_split: int
    num_splits: int

    @property
    def programs(self) -> int:
        return self.batch * self.num_kv_heads * self.num_splits

    @property
    def block_k(self) -> int:
        return self.pages_per_block * self.page_size


def num_sms_of_device() -> int:
    """SM count of the default GPU (core_count), DEFAULT_NUM_SMS when there is none."""
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or 0) if device.platform == "gpu" else 0


def plan_decode(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                page_size: int, table_width: int, *, max_kv_len: int | None = None,
                num_sms: int | None = None, pages_per_block: int | None = None,
                num_splits: int | None = None, exact: bool = True) -> DecodePlan:
    """Chooses the split count from batch, SM count and the longest real length.

    exact=True (the kernels' default): one split, whatever the shape (the canonical order
    chains every key block of a row left to right in one program); num_splits > 1 is refused.
    Splits only when B * Hkv programs fill less than PROGRAMS_PER_SM per SM, and never so far
    that a split of the longest row (max_kv_len, default table_width * page_size) holds fewer
    than `min_blocks_per_split` blocks, which keeps fp32 partial traffic under PARTIAL_BUDGET
    of the K/V bytes. Rows split their own blocks evenly, so max_kv_len only steers speed:
    results are exact for any seq_lens <= table_width * page_size.
    """
    group = num_q_heads // num_kv_heads
    group_rows = c.next_power_of_2(group)
    if pages_per_block is None:
        pages_per_block = max(1, 64 // page_size)
    if not c.is_power_of_2(pages_per_block):
        raise ValueError(f"pages_per_block must be a power of two, got {pages_per_block}")
    table_blocks = pl.cdiv(table_width, pages_per_block)
    if max_kv_len is None:
        max_kv_len = table_width * page_size
    if max_kv_len < 1:
        raise ValueError(f"max_kv_len must be >= 1, got {max_kv_len}")
    max_pages = min(table_width, pl.cdiv(max_kv_len, page_size))
    max_blocks = pl.cdiv(max_pages, pages_per_block)
    block_k = pages_per_block * page_size
    # partial bytes per split ~ 2 (write + read) * group_rows * D * 4; K/V bytes per split
    # ~ 2 (K and V) * tokens * D * 2 (bf16): ratio 2 * group_rows / tokens.
    min_tokens = 2 * group_rows / PARTIAL_BUDGET
    min_blocks = max(1, math.ceil(min_tokens / block_k))
    if exact:
        if num_splits not in (None, 1):
            raise ValueError(f"exact=True runs one split (the canonical order chains a row's "
                             f"key blocks in one program), got num_splits={num_splits}")
        num_splits = 1
    if num_splits is None:
        num_sms = num_sms or num_sms_of_device() or DEFAULT_NUM_SMS
        wanted = num_sms * PROGRAMS_PER_SM // (batch * num_kv_heads)  # <= one resident wave
        num_splits = max(1, min(wanted, max_blocks // min_blocks))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return DecodePlan(batch=batch, num_kv_heads=num_kv_heads, group=group,
                      group_rows=group_rows, dot_rows=max(MIN_DOT_ROWS, group_rows),
                      head_dim=head_dim, page_size=page_size, pages_per_block=pages_per_block,
                      table_blocks=table_blocks, max_blocks=max_blocks,
                      min_blocks_per_split=min_blocks, num_splits=num_splits)


def top_rows(x, n: int):
    """First n rows of x [R, ...] (R and n powers of two) with an equal split Triton lowers."""
    return x if x.shape[0] == n else jnp.split(x, x.shape[0] // n, axis=0)[0]


def _decode_kernel(q_ref, k_ref, v_ref, pages_ref, len_ref, offset_ref, *out_refs,
                   plan: DecodePlan, sm_scale: float, chunks, exact: bool, interpret: bool):
    # q_ref [dot_rows (EXACT_DOT_ROWS compiled exact), D];
    # k_ref/v_ref [L*P, page_size, D] (this program's kv head);
    # pages_ref int32 [table_blocks * pages_per_block] (this row's table); len_ref int32 [1];
    # offset_ref int32 [1] (layer * P). One split: out_refs = (o [group_rows, D] in q's dtype,).
    # Several: out_refs = (o f32 [group_rows, D] normalised, lse f32 [group_rows] log2 units).
    split = pl.program_id(2)
    seq_len = len_ref[0]
    page_size, pages_per_block = plan.page_size, plan.pages_per_block
    row_blocks = jnp.minimum(pl.cdiv(pl.cdiv(seq_len, page_size), pages_per_block),
                             plan.table_blocks)
    # This row's split count: short rows use fewer, fuller splits; the rest stay idle.
    splits = jnp.clip(pl.cdiv(row_blocks, plan.min_blocks_per_split), 1, plan.num_splits)
    first = split * row_blocks // splits
    last = (split + 1) * row_blocks // splits

    def visible(i, block_k):  # keys below this row's length
        return (i * block_k + jnp.arange(block_k) < seq_len)[None, :]

    if exact:  # one split: [first, last) = every block of the row
        o, l = exact_loop(load_chunks(q_ref, chunks), k_ref, v_ref, pages_ref, offset_ref[0],
                          first, last, pages_per_block=pages_per_block, sm_scale=sm_scale,
                          mask=visible, key_valid=lambda i, bk: visible(i, bk)[0],
                          chunks=chunks, f32_scores=interpret)
        inv = (1.0 / jnp.where(l > 0, l, 1.0))[:, None]  # as blocked.combine_blocks
        store_chunks(out_refs[0], tuple(top_rows(x * inv, plan.group_rows) for x in o),
                     chunks)
        return
    full_blocks = seq_len // plan.block_k  # blocks without a key past seq_len
    o, m, l = paged_flash_loop(load_chunks(q_ref, chunks), k_ref, v_ref, pages_ref,
                               offset_ref[0], first, full_blocks, last,
                               pages_per_block=pages_per_block, sm_scale=sm_scale,
                               mask=visible, key_valid=lambda i, bk: visible(i, bk)[0],
                               chunks=chunks)
    inv_l = 1.0 / jnp.where(l > 0, l, 1.0)
    o = tuple(top_rows(x * inv_l[:, None], plan.group_rows) for x in o)
    if plan.num_splits == 1:
        store_chunks(out_refs[0], o, chunks)
        return

    @pl.when(split < splits)
    def _():
        store_chunks(out_refs[0], o, chunks)
        out_refs[1][...] = top_rows(jnp.where(l > 0, m + jnp.log2(jnp.where(l > 0, l, 1.0)),
                                              MASK_VALUE), plan.group_rows)

    @pl.when(split >= splits)
    def _():  # idle split: weight zero in the merge, its o is never read
        out_refs[1][...] = jnp.full((plan.group_rows,), MASK_VALUE, jnp.float32)


def merge_splits(o, lse):
    """Merges split-K partials: o [S, ..., D] normalised per split, lse [S, ...] (log2 units,
    MASK_VALUE for splits without keys) -> [..., D] fp32. Rows without any key give zeros;
    the o of a masked split is never read (select, not multiply), so it may hold garbage."""
    lse_max = lse.max(axis=0)
    live = lse > MASK_VALUE
    w = jnp.where(live, jnp.exp2(lse - lse_max[None]), 0.0)
    denom = w.sum(axis=0)
    num = jnp.where(live[..., None], o * w[..., None], 0.0).sum(axis=0)
    return num / jnp.where(denom > 0, denom, 1.0)[..., None]


def _decode_pallas(q, k_pages, v_pages, page_offset, page_table, seq_lens, *, plan, sm_scale,
                   num_warps, num_stages, interpret, exact):
    # q [B, Hq, D]; k_pages/v_pages [L*P, Hkv, ps, D] (flattened pool); page_offset int32 scalar
    batch, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, page_size, _ = k_pages.shape
    group, rows, group_rows, splits = plan.group, plan.dot_rows, plan.group_rows, plan.num_splits
    width = plan.table_blocks * plan.pages_per_block
    if width != page_table.shape[1]:  # a no-op for the engine's table widths
        page_table = jnp.pad(page_table, ((0, 0), (0, width - page_table.shape[1])))
    qg = q.reshape(batch, num_kv_heads, group, head_dim)
    if rows != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    chunks = head_dim_chunks(head_dim)
    kernel = functools.partial(_decode_kernel, plan=plan, sm_scale=sm_scale, chunks=chunks,
                               exact=exact, interpret=interpret)
    out_dim = (batch, num_kv_heads, group_rows, head_dim)
    if splits == 1:
        out_specs = [pl.BlockSpec((None, None, group_rows, head_dim),
                                  lambda b, h, s: (b, h, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct(out_dim, q.dtype)]
    else:
        out_specs = [
            pl.BlockSpec((None, None, None, group_rows, head_dim),
                         lambda b, h, s: (s, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, group_rows), lambda b, h, s: (s, b, h, 0)),
        ]
        out_shape = [jax.ShapeDtypeStruct((splits, *out_dim), jnp.float32),
                     jax.ShapeDtypeStruct((splits, *out_dim[:-1]), jnp.float32)]
    outs = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, splits),
        in_specs=[
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
            pl.BlockSpec((num_pages, None, page_size, head_dim), lambda b, h, s: (0, h, 0, 0)),
            pl.BlockSpec((num_pages, None, page_size, head_dim), lambda b, h, s: (0, h, 0, 0)),
            pl.BlockSpec((None, width), lambda b, h, s: (b, 0)),
            pl.BlockSpec((1,), lambda b, h, s: (b,)),
            pl.BlockSpec((1,), lambda b, h, s: (0,)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="paged_decode_attention",
    )(qg, k_pages, v_pages, page_table, seq_lens, page_offset.reshape(1))
    out = outs[0] if splits == 1 else merge_splits(*outs)
    if group_rows != group:
        out = out[:, :, :group]
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def paged_decode_reference(q, k_pages, v_pages, page_table, seq_lens, *, layer=None,
                           sm_scale=None, shared_pages=None):
    """Pure-jnp paged decode in the canonical order of `kernels_pallas.blocked` (the `xla`
    backend, the fast CPU path): bit for bit what the dense causal forward computes.

    q [B, Hq, D]; k_pages/v_pages [P, Hkv, page_size, D] or [L, P, Hkv, page_size, D] with
    `layer`; page_table int32 [B, W]; seq_lens int32 [B] -> [B, Hq, D]. Gathers the table's
    pages of one layer, never the layer. shared_pages int32 [S] (optional): the first S
    pages of every row (a shared prompt), gathered once and scored for all rows in one dot
    up to their last key-block edge (pages after it join each row's table); page_table then
    holds each row's pages after them.
    Shared pages must be fully written.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_pages.shape[-3], k_pages.shape[-2]
    k_pages, page_offset = c.flatten_pool(k_pages, layer)
    v_pages, _ = c.flatten_pool(v_pages, layer)
    group = num_q_heads // num_kv_heads
    scale = c.default_scale(sm_scale, head_dim)
    shared = 0 if shared_pages is None else shared_pages.shape[0]
    edge = shared  # shared pages up to the last key-block edge; the rest go per row
    while edge and (edge * page_size) % KEY_BLOCK:
        edge -= 1
    if edge < shared:
        page_table = jnp.concatenate(
            [jnp.broadcast_to(shared_pages[edge:], (batch, shared - edge)), page_table], axis=1)
        shared_pages, shared = shared_pages[:edge], edge
    shared_keys = shared * page_size
    qg = q.reshape(batch, num_kv_heads, group, head_dim)
    k, v = c.gather_kv(k_pages, v_pages, page_table + page_offset, q.dtype)  # [B, Hkv, L, D]
    valid = jnp.arange(k.shape[2])[None, :] < (seq_lens - shared_keys)[:, None]  # [B, L]
    v = jnp.where(valid[:, None, :, None], v, jnp.zeros_like(v))  # free slots: NaN/Inf
    kb, vb = key_blocks(k, 2), key_blocks(v, 2)  # [B, Hkv, NB, KB, D]
    scores = block_scores(qg, kb, scale)  # [B, Hkv, NB, G, KB]
    visible = key_blocks(valid, 1)[:, None, :, None, :]  # [B, 1, NB, 1, KB]
    if shared:
        ks, vs = c.gather_kv(k_pages, v_pages, shared_pages[None] + page_offset, q.dtype)
        ks, vs = key_blocks(ks[0], 1), key_blocks(vs[0], 1)  # [Hkv, NS, KB, D]
        q_all = qg.transpose(1, 0, 2, 3).reshape(num_kv_heads, batch * group, head_dim)
        s_shared = block_scores(q_all, ks, scale)  # [Hkv, NS, B * G, KB]
        s_shared = s_shared.reshape(num_kv_heads, -1, batch, group, KEY_BLOCK)
        scores = jnp.concatenate([s_shared.transpose(2, 0, 1, 3, 4), scores], axis=2)
        vis_shared = key_blocks(jnp.arange(shared_keys)[None, :] < seq_lens[:, None], 1)
        visible = jnp.concatenate([vis_shared[:, None, :, None, :],
                                   jnp.broadcast_to(visible, (batch, 1) + visible.shape[2:])],
                                  axis=2)
    p, l_blocks = softmax_blocks(scores, visible)  # [B, Hkv, NB', G, KB]
    num_shared = scores.shape[2] - kb.shape[2]
    o = block_values(p[:, :, num_shared:], vb)  # [B, Hkv, NB, G, D]
    if shared:
        p_shared = p[:, :, :num_shared].transpose(1, 2, 0, 3, 4)  # [Hkv, NS, B, G, KB]
        o_shared = block_values(
            p_shared.reshape(num_kv_heads, num_shared, batch * group, KEY_BLOCK), vs)
        o_shared = o_shared.reshape(num_kv_heads, num_shared, batch, group, head_dim)
        o = jnp.concatenate([o_shared.transpose(2, 0, 1, 3, 4), o], axis=2)
    out = combine_blocks(o, l_blocks)  # [B, Hkv, G, D]
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


@c.kernel_keyed_jit(static_argnames=(
    "sm_scale", "backend", "max_kv_len", "num_sms", "pages_per_block", "num_splits",
    "num_warps", "num_stages", "exact"))
def paged_decode_attention(q, k_pages, v_pages, page_table, seq_lens, *, layer=None,
                           shared_pages=None, sm_scale=None, backend="auto", max_kv_len=None,
                           num_sms=None,
                           pages_per_block=None, num_splits=None, num_warps=None, num_stages=2,
                           exact=True):
    """Attention of one query token per sequence over its pages.

    q [B, Hq, D]; k_pages, v_pages [P, Hkv, page_size, D] (page 0 is the null page), or a
    stacked [L, P, Hkv, page_size, D] pool with `layer` an int32 scalar (may be traced);
    page_table int32 [B, W] (unused slots hold 0); seq_lens int32 [B] (0 = padded row).
    Returns [B, Hq, D] in q's dtype; fp32 accumulation; rows with seq_len 0 are zeros.
    Only keys below seq_len are read into the result: NaN/Inf in free slots never leak.
    shared_pages int32 [S] (optional): pages every row starts with, before its page_table
    (see paged_decode_reference; the xla backend attends them once for all rows, the
    kernels read them through each row's table).
    Kernel planning (static, see `plan_decode`): max_kv_len, a bucketed upper bound of
    seq_lens (speed only, never correctness); num_sms (default: the GPU's, else 132).
    exact (kernels only; the xla backend is always exact): True reduces in the canonical
    order of `kernels_pallas.blocked`, one split per row; in interpret mode the result is
    the xla backend's, bit for bit, for fp32 and bf16 pools with a power-of-two head_dim
    (80 or 96 run as two chunks whose partial score dots are summed: another order) and
    pages_per_block * page_size a multiple of 64 (the default). False: flash-decoding
    (online softmax, num_splits from `plan_decode`), faster for few long rows. Compiled,
    exact=True runs the exact prefill kernel's program (`_flash.exact_program`: its warps,
    keys per block and 64-row dots, the group zero-padded), so a token's attention has the
    same bits decoded or prefilled; num_warps (default 4 otherwise) overrides it.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {q.shape}")
    c.check_pages("q", q, k_pages, v_pages, layer)
    c.check_int32("page_table", page_table)
    c.check_int32("seq_lens", seq_lens)
    if shared_pages is not None:
        c.check_int32("shared_pages", shared_pages)
        if shared_pages.ndim != 1:
            raise ValueError(f"shared_pages must be [S], got shape {shared_pages.shape}")
    if page_table.ndim != 2 or page_table.shape[0] != q.shape[0]:
        raise ValueError(f"page_table must be [B={q.shape[0]}, W], got shape {page_table.shape}")
    if seq_lens.shape != (q.shape[0],):
        raise ValueError(f"seq_lens must be [B={q.shape[0]}], got shape {seq_lens.shape}")
    backend = c.resolve_backend(backend)
    scale = c.default_scale(sm_scale, q.shape[-1])
    if backend == "xla":
        return paged_decode_reference(q, k_pages, v_pages, page_table, seq_lens, layer=layer,
                                      sm_scale=scale, shared_pages=shared_pages)
    if shared_pages is not None and shared_pages.shape[0]:
        page_table = jnp.concatenate(
            [jnp.broadcast_to(shared_pages, (q.shape[0], shared_pages.shape[0])), page_table], 1)
    c.check_kernel_shapes(k_pages.shape[-2], q.shape[-1])
    batch, num_q_heads, head_dim = q.shape
    *_, num_kv_heads, page_size, _ = k_pages.shape
    interpret = backend == "interpret"
    if exact and not interpret:  # the compiled exact prefill kernel's program, dot for dot
        warps, block_k = exact_program(head_dim)
        num_warps = warps if num_warps is None else num_warps
        if pages_per_block is None:
            pages_per_block = max(1, block_k // page_size)
    num_warps = 4 if num_warps is None else num_warps
    plan = plan_decode(batch, num_q_heads, num_kv_heads, head_dim, page_size,
                       page_table.shape[1], max_kv_len=max_kv_len, num_sms=num_sms,
                       pages_per_block=pages_per_block, num_splits=num_splits, exact=exact)
    if exact and not interpret:  # the prefill kernel's dot shape too (_flash.EXACT_DOT_ROWS)
        plan = dataclasses.replace(plan, dot_rows=max(plan.dot_rows, EXACT_DOT_ROWS))
    if not interpret and plan.block_k < MIN_DOT_ROWS:
        raise ValueError(
            f"pages_per_block * page_size = {plan.block_k} must be >= 16 "
            "for the compiled kernel (tl.dot minimum)")
    k_flat, page_offset = c.flatten_pool(k_pages, layer)
    v_flat, _ = c.flatten_pool(v_pages, layer)
    return _decode_pallas(q, k_flat, v_flat, page_offset, page_table, seq_lens, plan=plan,
                          sm_scale=scale, num_warps=num_warps, num_stages=num_stages,
                          interpret=interpret, exact=exact)
