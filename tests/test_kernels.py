"""Paged decode/prefill kernels (interpret mode and the xla path) vs a dense numpy attention,
and the interpret-mode kernels vs the xla references bit for bit (exact numerics, issue 33)."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import (paged_decode_attention, paged_prefill_attention, plan_decode,
                            write_kv, write_kv_jit)
from tests.dense_reference import dense_attention, gather_tokens

TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def random_pool(rng, num_pages, num_kv_heads, page_size, head_dim, dtype, layers=None):
    """[P, Hkv, ps, D] pools, or stacked [layers, P, Hkv, ps, D] ones."""
    shape = (num_pages, num_kv_heads, page_size, head_dim)
    shape = shape if layers is None else (layers,) + shape
    k = jnp.asarray(rng.standard_normal(shape), dtype)
    v = jnp.asarray(rng.standard_normal(shape), dtype)
    return k, v


def random_page_table(rng, num_seqs, width, num_pages):
    """Distinct, randomly permuted pages (never the null page 0)."""
    pages = rng.permutation(np.arange(1, num_pages))[: num_seqs * width]
    return pages.reshape(num_seqs, width).astype(np.int32)


def stacked_args(k_pages, v_pages, layer):
    """(kernel keyword args, the layer's [P, Hkv, ps, D] pools as float64 numpy)."""
    k, v = np.asarray(k_pages, np.float64), np.asarray(v_pages, np.float64)
    if layer is None:
        return {}, k, v
    return {"layer": jnp.int32(layer)}, k[layer], v[layer]


def poison_unused(k_pages, v_pages, table, lens):
    """NaN/Inf into every slot no row may read (free pages, the null page 0, slots past each
    row's length); unused table slots point at the null page. Returns (k, v, table)."""
    page_size = k_pages.shape[-2]
    used = np.zeros((k_pages.shape[0], page_size), bool)
    table = np.array(table)
    for b, n in enumerate(lens):
        for t in range(n):
            used[table[b, t // page_size], t % page_size] = True
        table[b, -(-n // page_size):] = 0
    free = ~used[:, None, :, None]
    odd = (np.arange(page_size) % 2 == 1)[None, None, :, None]
    k = np.where(free, np.nan, np.asarray(k_pages, np.float32))
    v = np.where(free & odd, np.inf, np.where(free, np.nan, np.asarray(v_pages, np.float32)))
    return jnp.asarray(k, k_pages.dtype), jnp.asarray(v, v_pages.dtype), table


def decode_case(backend, page_size, hq, hkv, head_dim, dtype, seed=0, layers=None, layer=None,
                poison=False, **kernel_args):
    rng = np.random.default_rng(seed)
    lens = [1, 2 * page_size, 2 * page_size + 3, 0]  # single token, exact pages, ragged, pad
    width = 4
    num_pages = len(lens) * width + 3
    k_pages, v_pages = random_pool(rng, num_pages, hkv, page_size, head_dim, dtype, layers)
    table = random_page_table(rng, len(lens), width, num_pages)
    if poison:
        k_pages, v_pages, table = poison_unused(k_pages, v_pages, table, lens)
    q = jnp.asarray(rng.standard_normal((len(lens), hq, head_dim)), dtype)
    layer_args, kf, vf = stacked_args(k_pages, v_pages, layer)
    out = paged_decode_attention(q, k_pages, v_pages, jnp.asarray(table),
                                 jnp.asarray(lens, jnp.int32), backend=backend, **layer_args,
                                 **kernel_args)
    qf = np.asarray(q, np.float64)
    for b, n in enumerate(lens):
        ref = dense_attention(qf[b:b + 1], gather_tokens(kf, table[b], n),
                              gather_tokens(vf, table[b], n), [n - 1], head_dim ** -0.5)
        np.testing.assert_allclose(np.asarray(out[b], np.float64), ref[0], **TOL[dtype])
    assert not np.isnan(np.asarray(out, np.float32)).any()


def prefill_case(backend, page_size, hq, hkv, head_dim, dtype, cached, seed=0, layers=None,
                 layer=None, poison=False, **kernel_args):
    rng = np.random.default_rng(seed)
    q_lens = [page_size + 3, 1, 2 * page_size]  # ragged, single token, exact pages
    cached_lens = [page_size, 2 * page_size, page_size] if cached else [0, 0, 0]
    kv_lens = [c + n for c, n in zip(cached_lens, q_lens)]
    width = max(-(-n // page_size) for n in kv_lens) + 1
    num_pages = len(q_lens) * width + 2
    k_pages, v_pages = random_pool(rng, num_pages, hkv, page_size, head_dim, dtype, layers)
    table = random_page_table(rng, len(q_lens), width, num_pages)
    if poison:
        k_pages, v_pages, table = poison_unused(k_pages, v_pages, table, kv_lens)
    layer_args, kf, vf = stacked_args(k_pages, v_pages, layer)
    total = sum(q_lens)
    padded = total + 5  # padded T
    q = jnp.asarray(rng.standard_normal((padded, hq, head_dim)), dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    out = paged_prefill_attention(q, k_pages, v_pages, jnp.asarray(table), jnp.asarray(cu),
                                  jnp.asarray(kv_lens, jnp.int32), backend=backend,
                                  **layer_args, **kernel_args)
    qf = np.asarray(q, np.float64)
    for b in range(len(q_lens)):
        rows = slice(cu[b], cu[b + 1])
        pos = np.arange(cached_lens[b], kv_lens[b])
        ref = dense_attention(qf[rows], gather_tokens(kf, table[b], kv_lens[b]),
                              gather_tokens(vf, table[b], kv_lens[b]), pos, head_dim ** -0.5)
        np.testing.assert_allclose(np.asarray(out[rows], np.float64), ref, **TOL[dtype])
    np.testing.assert_array_equal(np.asarray(out[total:], np.float32), 0.0)


PAGE_SIZES = (8, 16, 32)
GQA = ((4, 4), (8, 2), (8, 1))  # (Hq, Hkv): group 1, 4, 8
HEAD_DIMS = (64, 128)
# The xla path runs every pair of axis values in `make test` (every page size x group, each
# with both head dims across the groups) and the full grid under `make test-full`; interpret
# mode (slow) covers every value of every axis.
PAIRWISE = [(p, g, HEAD_DIMS[(i + j) % 2]) for i, p in enumerate(PAGE_SIZES)
            for j, g in enumerate(GQA)]
FULL_GRID = [pytest.param(*case, marks=() if case in PAIRWISE else pytest.mark.slow)
             for case in itertools.product(PAGE_SIZES, GQA, HEAD_DIMS)]
INTERPRET_GRID = [(8, (4, 4), 64), (16, (8, 2), 128), (32, (8, 1), 64), (16, (8, 1), 64)]


@pytest.mark.parametrize("page_size,heads,head_dim", FULL_GRID)
def test_decode_xla(page_size, heads, head_dim):
    decode_case("xla", page_size, *heads, head_dim, jnp.float32)


@pytest.mark.parametrize("page_size,heads,head_dim", INTERPRET_GRID)
def test_decode_interpret(page_size, heads, head_dim):
    decode_case("interpret", page_size, *heads, head_dim, jnp.float32)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_decode_bf16(backend):
    decode_case(backend, 16, 8, 2, 64, jnp.bfloat16, seed=1)


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("page_size,heads,head_dim", FULL_GRID)
def test_prefill_xla(page_size, heads, head_dim, cached):
    prefill_case("xla", page_size, *heads, head_dim, jnp.float32, cached)


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("page_size,heads,head_dim", INTERPRET_GRID)
def test_prefill_interpret(page_size, heads, head_dim, cached):
    prefill_case("interpret", page_size, *heads, head_dim, jnp.float32, cached)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_non_power_of_two_gqa_group(backend):
    """Hq=6, Hkv=2: a group of 3 is padded to the kernel's row tiles and sliced back."""
    decode_case(backend, 16, 6, 2, 64, jnp.float32, seed=5)
    prefill_case(backend, 16, 6, 2, 64, jnp.float32, cached=True, seed=5)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_prefill_sequence_without_new_tokens(backend):
    """A sequence with q_len 0 in the middle of the pack gets no rows and disturbs nothing."""
    rng = np.random.default_rng(6)
    k_pages, v_pages = random_pool(rng, 20, 2, 8, 64, jnp.float32)
    table = random_page_table(rng, 3, 4, 20)
    q_lens, kv_lens = [5, 0, 3], [5, 16, 11]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((8, 4, 64)), jnp.float32)
    out = paged_prefill_attention(q, k_pages, v_pages, jnp.asarray(table), jnp.asarray(cu),
                                  jnp.asarray(kv_lens, jnp.int32), backend=backend)
    kf, vf = np.asarray(k_pages, np.float64), np.asarray(v_pages, np.float64)
    for b in (0, 2):
        pos = np.arange(kv_lens[b] - q_lens[b], kv_lens[b])
        ref = dense_attention(np.asarray(q, np.float64)[cu[b]:cu[b + 1]],
                              gather_tokens(kf, table[b], kv_lens[b]),
                              gather_tokens(vf, table[b], kv_lens[b]), pos, 64 ** -0.5)
        np.testing.assert_allclose(np.asarray(out[cu[b]:cu[b + 1]]), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_rows,pages_per_block,exact", [(16, 8, True), (32, 8, True),
                                                              (16, 1, False)])
def test_prefill_interpret_many_tiles_per_sequence(block_rows, pages_per_block, exact):
    """Small query tiles (4 and 8 tokens of a group of 4): several tiles per sequence, each
    stopping at its causal bound, run longest first (blocks of 64 keys, and 8 for the
    online softmax)."""
    prefill_case("interpret", 8, 8, 2, 64, jnp.float32, cached=True, block_rows=block_rows,
                 pages_per_block=pages_per_block, exact=exact)


def test_exact_order_needs_whole_key_blocks():
    """The exact kernels chain KEY_BLOCK (64)-key blocks: a kernel block of 8 keys is
    refused."""
    rng = np.random.default_rng(14)
    k_pages, v_pages = random_pool(rng, 12, 2, 8, 64, jnp.float32)
    table = jnp.asarray(random_page_table(rng, 2, 3, 12))
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
    with pytest.raises(ValueError, match="exact order"):
        paged_decode_attention(q, k_pages, v_pages, table, jnp.asarray([5, 20], jnp.int32),
                               backend="interpret", pages_per_block=1)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_prefill_bf16(backend):
    prefill_case(backend, 16, 8, 2, 64, jnp.bfloat16, cached=True, seed=2)


def test_decode_split_k_merge_matches_single_split():
    """exact=False: many splits (most empty for short rows) give the same result as one."""
    rng = np.random.default_rng(3)
    k_pages, v_pages = random_pool(rng, 40, 2, 8, 64, jnp.float32)
    table = jnp.asarray(random_page_table(rng, 2, 16, 40))
    lens = jnp.asarray([3, 120], jnp.int32)
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
    one = paged_decode_attention(q, k_pages, v_pages, table, lens, backend="interpret",
                                 num_splits=1, pages_per_block=2, exact=False)
    many = paged_decode_attention(q, k_pages, v_pages, table, lens, backend="interpret",
                                  num_splits=8, pages_per_block=1, exact=False)
    np.testing.assert_allclose(np.asarray(one), np.asarray(many), atol=2e-5, rtol=2e-5)


class TestDecodePlan:
    """Split planning (Llama-3-8B heads: Hq 32, Hkv 8, D 128; page 16, table of 256 pages)
    for exact=False; the exact order runs one split."""
    def plan(self, batch, max_kv_len, num_sms=132):
        return plan_decode(batch, 32, 8, 128, 16, 256, max_kv_len=max_kv_len, num_sms=num_sms,
                           exact=False)

    def test_exact_runs_one_split(self):
        assert plan_decode(1, 32, 8, 128, 16, 256, max_kv_len=16384).num_splits == 1
        with pytest.raises(ValueError, match="one split"):
            plan_decode(1, 32, 8, 128, 16, 256, num_splits=4)

    def test_full_batch_does_not_split(self):
        for length in (512, 4096):
            assert self.plan(64, length).num_splits == 1  # 512 programs: one wave already

    def test_splits_fill_the_sms_when_the_batch_is_small(self):
        plan = self.plan(8, 16384)
        assert plan.programs <= 132 * 4 < plan.programs + 8 * 8  # at most one resident wave
        assert plan.num_splits == 8

    def test_no_split_of_the_longest_row_is_short_or_empty(self):
        for batch, length in itertools.product((1, 8, 32), (100, 512, 4096, 16384)):
            plan = self.plan(batch, length)
            blocks = -(-length // plan.block_k)
            assert plan.num_splits * plan.min_blocks_per_split <= max(blocks, plan.min_blocks_per_split)
            # fp32 partial writes + reads stay within 1/8 of the split's bf16 K/V bytes
            if plan.num_splits > 1:
                tokens = plan.min_blocks_per_split * plan.block_k
                assert 2 * plan.group_rows * 128 * 4 <= (2 * tokens * 128 * 2) / 8

    def test_partials_hold_real_group_rows(self):
        assert self.plan(1, 4096).group_rows == 4  # group of 4: 4 rows, not 16
        assert plan_decode(1, 28, 4, 128, 16, 256, exact=False).group_rows == 8  # group of 7

    def test_more_sms_more_splits(self):
        assert self.plan(1, 16384, num_sms=132).num_splits > self.plan(1, 16384, num_sms=16).num_splits


@pytest.mark.parametrize("backend", ["interpret"])
def test_decode_exact_when_lengths_exceed_max_kv_len(backend):
    """max_kv_len only steers the split count: longer rows still attend to every key."""
    decode_case(backend, 8, 8, 2, 64, jnp.float32, seed=12, max_kv_len=8, pages_per_block=1,
                num_splits=3, exact=False)


def test_write_kv_matches_numpy_and_drops_padding():
    rng = np.random.default_rng(4)
    k_pages, v_pages = random_pool(rng, 10, 2, 4, 8, jnp.float32)
    table = np.array([[3, 7, 0], [5, 2, 9]], np.int32)
    seq = np.array([0, 0, 1, 1, 0], np.int32)
    pos = np.array([0, 5, 11, 2, -1], np.int32)  # last token is padding
    k_new = rng.standard_normal((5, 2, 8)).astype(np.float32)
    v_new = rng.standard_normal((5, 2, 8)).astype(np.float32)
    want_k, want_v = np.array(k_pages), np.array(v_pages)
    for t in range(4):
        page = table[seq[t], pos[t] // 4]
        want_k[page, :, pos[t] % 4] = k_new[t]
        want_v[page, :, pos[t] % 4] = v_new[t]
    args = (jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(table), jnp.asarray(seq),
            jnp.asarray(pos))
    k_out, v_out = write_kv(k_pages, v_pages, *args)
    np.testing.assert_array_equal(np.asarray(k_out), want_k)
    np.testing.assert_array_equal(np.asarray(v_out), want_v)
    k_don, v_don = write_kv_jit(jnp.array(k_pages), jnp.array(v_pages), *args)
    np.testing.assert_array_equal(np.asarray(k_don), want_k)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_poisoned_free_slots_do_not_leak(backend):
    """NaN/Inf in free pages, the null page and slots past each length leave outputs exact:
    the exact order, and exact=False with several splits (idle splits included)."""
    decode_case(backend, 8, 8, 2, 64, jnp.float32, seed=10, poison=True)
    prefill_case(backend, 8, 8, 2, 64, jnp.float32, cached=True, seed=10, poison=True)
    if backend == "interpret":
        decode_case(backend, 8, 8, 2, 64, jnp.float32, seed=10, poison=True, num_splits=4,
                    pages_per_block=1, exact=False)
        prefill_case(backend, 8, 8, 2, 64, jnp.float32, cached=True, seed=10, poison=True,
                     exact=False)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("layer", [None, 1])
def test_decode_shared_prefix_pages(backend, layer):
    """Rows that start with the same pages (a shared prompt) passed once as shared_pages,
    their tables holding only the rest, match numpy over each row's whole table; free slots
    poisoned, a padded row (length 0) stays zero."""
    rng = np.random.default_rng(13)
    page_size, shared, width = 8, 2, 3
    lens = [2 * page_size + 1, 3 * page_size + 5, 2 * page_size + page_size, 0]
    num_pages = shared + len(lens) * width + 2
    k_pages, v_pages = random_pool(rng, num_pages, 2, page_size, 64, jnp.float32,
                                   None if layer is None else 2)
    pages = rng.permutation(np.arange(1, num_pages))
    common, rest = pages[:shared], pages[shared:shared + len(lens) * width]
    full = np.concatenate([np.broadcast_to(common, (len(lens), shared)),
                           rest.reshape(len(lens), width)], 1).astype(np.int32)
    full[3] = 0  # the padded row has no table
    if layer is None:
        k_pages, v_pages, full = poison_unused(k_pages, v_pages, full, lens)
    q = jnp.asarray(rng.standard_normal((len(lens), 8, 64)), jnp.float32)
    layer_args, kf, vf = stacked_args(k_pages, v_pages, layer)
    out = paged_decode_attention(q, k_pages, v_pages, jnp.asarray(full[:, shared:]),
                                 jnp.asarray(lens, jnp.int32), backend=backend,
                                 shared_pages=jnp.asarray(common, jnp.int32), **layer_args)
    qf = np.asarray(q, np.float64)
    for b, n in enumerate(lens[:3]):
        ref = dense_attention(qf[b:b + 1], gather_tokens(kf, full[b], n),
                              gather_tokens(vf, full[b], n), [n - 1], 64 ** -0.5)
        np.testing.assert_allclose(np.asarray(out[b], np.float64), ref[0], **TOL[jnp.float32])
    np.testing.assert_array_equal(np.asarray(out[3]), 0.0)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("head_dim", [80, 96])
def test_head_dims_not_a_power_of_two(backend, head_dim):
    """Phi-2's 80 and 96 run as power-of-two chunks (64 + 16, 64 + 32) against numpy.
    Interpret mode (slow) runs decode at 80 and prefill at 96: each kernel sees 2 chunks."""
    if backend == "xla" or head_dim == 80:
        decode_case(backend, 16, 8, 2, head_dim, jnp.float32, seed=11)
    if backend == "xla" or head_dim == 96:
        prefill_case(backend, 8, 6, 2, head_dim, jnp.float32, cached=True, seed=11)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_stacked_pool_reads_only_its_layer(backend):
    """[L, P, Hkv, ps, D] pools with a layer index match numpy on that layer's pages."""
    decode_case(backend, 16, 8, 2, 64, jnp.float32, seed=7, layers=3, layer=2)
    prefill_case(backend, 8, 8, 2, 64, jnp.float32, cached=True, seed=7, layers=3, layer=1)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_stacked_pool_traced_layer_in_scan(backend):
    """A layer index traced inside lax.scan (the model's layer loop) picks each layer's pages."""
    rng = np.random.default_rng(8)
    layers, num_pages = 2, 12
    k_pages, v_pages = random_pool(rng, num_pages, 2, 8, 64, jnp.float32, layers)
    table = jnp.asarray(random_page_table(rng, 2, 3, num_pages))
    lens = jnp.asarray([5, 20], jnp.int32)
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)

    def step(carry, layer):
        return carry, paged_decode_attention(q, k_pages, v_pages, table, lens, layer=layer,
                                             backend=backend)

    _, outs = jax.lax.scan(step, None, jnp.arange(layers, dtype=jnp.int32))
    for layer in range(layers):
        want = paged_decode_attention(q, k_pages[layer], v_pages[layer], table, lens,
                                      backend="xla")
        np.testing.assert_allclose(np.asarray(outs[layer]), np.asarray(want), atol=2e-5,
                                   rtol=2e-5)


def test_write_kv_stacked_pool_writes_one_layer():
    rng = np.random.default_rng(9)
    k_pages, v_pages = random_pool(rng, 6, 2, 4, 8, jnp.float32, layers=3)
    table = np.array([[3, 1], [5, 2]], np.int32)
    seq, pos = np.array([0, 1, 1], np.int32), np.array([5, 0, -1], np.int32)
    k_new = rng.standard_normal((3, 2, 8)).astype(np.float32)
    v_new = rng.standard_normal((3, 2, 8)).astype(np.float32)
    want_k, want_v = np.array(k_pages), np.array(v_pages)
    for t in range(2):  # token 2 is padding
        page = table[seq[t], pos[t] // 4]
        want_k[1, page, :, pos[t] % 4] = k_new[t]
        want_v[1, page, :, pos[t] % 4] = v_new[t]
    k_out, v_out = write_kv_jit(jnp.array(k_pages), jnp.array(v_pages), jnp.asarray(k_new),
                                jnp.asarray(v_new), jnp.asarray(table), jnp.asarray(seq),
                                jnp.asarray(pos), layer=jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(k_out), want_k)
    np.testing.assert_array_equal(np.asarray(v_out), want_v)


class TestBadInput:
    def setup_method(self):
        self.k = jnp.zeros((8, 2, 16, 64), jnp.float32)
        self.q = jnp.zeros((2, 4, 64), jnp.float32)
        self.table = jnp.zeros((2, 3), jnp.int32)
        self.lens = jnp.ones((2,), jnp.int32)

    def test_head_dim_mismatch(self):
        with pytest.raises(ValueError, match="head_dim"):
            paged_decode_attention(jnp.zeros((2, 4, 32)), self.k, self.k, self.table, self.lens)

    def test_gqa_not_multiple(self):
        with pytest.raises(ValueError, match="multiple of Hkv"):
            paged_decode_attention(jnp.zeros((2, 3, 64)), self.k, self.k, self.table, self.lens)

    def test_index_dtype(self):
        with pytest.raises(ValueError, match="page_table must be int32"):
            paged_decode_attention(self.q, self.k, self.k, self.table.astype(jnp.float32),
                                   self.lens)
        with pytest.raises(ValueError, match="cu_q_lens must be int32"):
            paged_prefill_attention(jnp.zeros((4, 4, 64)), self.k, self.k, self.table,
                                    jnp.zeros((3,), jnp.int64 if jax.config.x64_enabled
                                              else jnp.uint32), self.lens)

    def test_batch_mismatch(self):
        with pytest.raises(ValueError, match="seq_lens"):
            paged_decode_attention(self.q, self.k, self.k, self.table, jnp.ones((3,), jnp.int32))
        with pytest.raises(ValueError, match="cu_q_lens"):
            paged_prefill_attention(jnp.zeros((4, 4, 64)), self.k, self.k, self.table,
                                    jnp.zeros((2,), jnp.int32), self.lens)

    def test_v_pages_shape(self):
        with pytest.raises(ValueError, match="v_pages"):
            paged_decode_attention(self.q, self.k, self.k[:4], self.table, self.lens)

    def test_page_size_power_of_two_for_kernel(self):
        k = jnp.zeros((8, 2, 12, 64), jnp.float32)
        with pytest.raises(ValueError, match="page_size must be a power of two"):
            paged_decode_attention(self.q, k, k, self.table, self.lens, backend="interpret")
        # the xla reference has no such restriction
        paged_decode_attention(self.q, k, k, self.table, self.lens, backend="xla")

    def test_layer_and_pool_rank_must_agree(self):
        with pytest.raises(ValueError, match="needs layer"):
            paged_decode_attention(self.q, self.k[None], self.k[None], self.table, self.lens)
        with pytest.raises(ValueError, match="only valid with a stacked"):
            paged_decode_attention(self.q, self.k, self.k, self.table, self.lens,
                                   layer=jnp.int32(0))
        with pytest.raises(ValueError, match="layer must be an int32 scalar"):
            paged_decode_attention(self.q, self.k[None], self.k[None], self.table, self.lens,
                                   layer=jnp.zeros((2,), jnp.int32))

    def test_unknown_backend(self):
        with pytest.raises(ValueError, match="backend"):
            paged_decode_attention(self.q, self.k, self.k, self.table, self.lens, backend="tpu")



# Exact numerics: in interpret mode the kernels reduce in the canonical order of
# kernels_pallas.blocked and return the xla references' bits (which the trainer's dense
# forward reproduces, tests/test_exactness.py). Every page size x GQA group x head dim under
# `make test-full` (JAXRL_FULL_SWEEP=1); `make test` runs each value of each axis once.
EXACT_PAGES, EXACT_GROUPS, EXACT_DIMS = (4, 8, 16, 32), (1, 2, 3, 4), (16, 32, 64, 128)
EXACT_QUICK = [(4, 1, 16), (8, 2, 32), (16, 3, 64), (32, 4, 128), (8, 4, 64)]
EXACT_FULL = [pytest.param(*case, marks=() if case in EXACT_QUICK else pytest.mark.slow)
              for case in itertools.product(EXACT_PAGES, EXACT_GROUPS, EXACT_DIMS)]


def assert_same_bits(got, want):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.isnan(np.asarray(got, np.float32)).any()


EXACT_HKV = 2


def exact_pool(rng, lens, page_size, head_dim, dtype, layers):
    """(k, v, table, layer kwargs) for rows of `lens` tokens: a pool with a spare page per
    row; single pools get their free slots poisoned, stacked ones read their last layer."""
    width = max(-(-n // page_size) for n in lens) + 1
    num_pages = len(lens) * width + 4
    k, v = random_pool(rng, num_pages, EXACT_HKV, page_size, head_dim, dtype, layers)
    table = random_page_table(rng, len(lens), width, num_pages)
    if layers is None:
        k, v, table = poison_unused(k, v, table, lens)
        return k, v, table, {}
    return k, v, table, {"layer": jnp.int32(layers - 1)}


def exact_decode_case(page_size, group, head_dim, dtype, seed, layers=None):
    """Ragged rows (one token, two pages and 3, past the first 64-key score block), a padded
    row (length 0); free slots poisoned; then the same rows behind shared prompt pages (72
    keys: 64 shared and the pages after the key-block edge per row, or 64 on the edge, by
    page size)."""
    rng = np.random.default_rng(seed)
    lens = [1, 2 * page_size + 3, 0, 75]
    k, v, table, layer_args = exact_pool(rng, lens, page_size, head_dim, dtype, layers)
    q = jnp.asarray(rng.standard_normal((len(lens), group * EXACT_HKV, head_dim)), dtype)
    args = (q, k, v, jnp.asarray(table), jnp.asarray(lens, jnp.int32))
    want = paged_decode_attention(*args, backend="xla", **layer_args)
    assert_same_bits(paged_decode_attention(*args, backend="interpret", **layer_args), want)
    shared = max(1, 72 // page_size)  # 72 keys (pages of 4, 8: off a block edge), else 64
    keys = shared * page_size
    shared_lens = jnp.asarray([keys, keys + 1, 0, 75], jnp.int32)
    common = jnp.asarray(table[3, :shared])
    rest = jnp.asarray(np.where(table[:, shared:] == 0, table[3, shared:], table[:, shared:]))
    args = (q, k, v, rest, shared_lens)
    want = paged_decode_attention(*args, shared_pages=common, backend="xla", **layer_args)
    assert_same_bits(paged_decode_attention(*args, shared_pages=common, backend="interpret",
                                            **layer_args), want)


def exact_prefill_case(page_size, group, head_dim, dtype, seed, layers=None):
    """Cached prefixes (none, one page, a 64-key block edge, 70 tokens), new tokens ragged,
    one, none, across several 64-key blocks; padded T; free slots poisoned."""
    rng = np.random.default_rng(seed)
    q_lens, cached = [page_size + 3, 1, 0, 2 * page_size + 5], [0, page_size, 64, 70]
    kv_lens = [c + n for c, n in zip(cached, q_lens)]
    k, v, table, layer_args = exact_pool(rng, kv_lens, page_size, head_dim, dtype, layers)
    q = jnp.asarray(rng.standard_normal((sum(q_lens) + 5, group * EXACT_HKV, head_dim)), dtype)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    args = (q, k, v, jnp.asarray(table), cu, jnp.asarray(kv_lens, jnp.int32))
    want = paged_prefill_attention(*args, backend="xla", **layer_args)
    assert_same_bits(paged_prefill_attention(*args, backend="interpret", **layer_args), want)


@pytest.mark.parametrize("page_size,group,head_dim", EXACT_FULL)
def test_interpret_decode_is_the_reference_bit_for_bit(page_size, group, head_dim):
    exact_decode_case(page_size, group, head_dim, jnp.float32, seed=page_size + head_dim)


@pytest.mark.parametrize("page_size,group,head_dim", EXACT_FULL)
def test_interpret_prefill_is_the_reference_bit_for_bit(page_size, group, head_dim):
    exact_prefill_case(page_size, group, head_dim, jnp.float32, seed=page_size + group)


def test_interpret_kernels_bit_for_bit_bf16_and_stacked_pool():
    """bf16 pools (computed in fp32 as the references do) and a stacked pool with a layer."""
    exact_decode_case(16, 2, 64, jnp.bfloat16, seed=20)
    exact_prefill_case(8, 4, 32, jnp.bfloat16, seed=21)
    exact_decode_case(8, 3, 32, jnp.float32, seed=22, layers=2)
    exact_prefill_case(16, 1, 64, jnp.float32, seed=23, layers=2)
