"""The batch-invariant kernels for a GPU (JAXRL_CACHE_KERNELS, kernels_pallas.invariant_kernels):
`tiled_matmul` is a right matmul whose row bits do not depend on the row count, the prefill
kernel computes the trainer's gathered attention bit for bit, and with both on the whole
chain (engine samples -> audit -> train step) stays exact. Interpret mode on CPU: the same
kernel programs the GPU compiles; tests/test_cuda_lowering.py checks they lower for CUDA."""
import copy
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import (KERNELS_ENV, gathered_prefill_attention, invariant_kernels,
                            kernel_keyed_jit, resolve_backend)
from kernels_pallas.blocked import (KEY_BLOCK, TILE, all_items, blocked_attention,
                                    gathered_attention)
from kernels_pallas.matmul import BLOCK_M, tile_sizes, tiled_matmul
from kernels_pallas.normaliser import BLOCK_V, CHUNK_V, chunk_size, log_sum_exp

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k,n,rows_out", [(96, 80, False), (64, 48, True), (40, 24, False)])
def test_tiled_matmul_is_a_matmul_whose_rows_ignore_the_batch(dtype, k, n, rows_out):
    """Right against float64 numpy (K and N that need zero padding included), and each row
    has the same bits alone, among a few rows, or among more than two tiles of rows."""
    x = jnp.asarray(RNG.standard_normal((2 * BLOCK_M + 5, k)), dtype)
    w = jnp.asarray(RNG.standard_normal((n, k) if rows_out else (k, n)), dtype)
    f = jax.jit(lambda x, w: tiled_matmul(x, w, w_rows_out=rows_out, backend="interpret"))
    full = np.asarray(f(x, w))
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    np.testing.assert_allclose(full, x64 @ (w64.T if rows_out else w64), rtol=1e-5, atol=1e-4)
    for rows in (1, 3, 17, BLOCK_M, BLOCK_M + 1):
        np.testing.assert_array_equal(np.asarray(f(x[:rows], w)), full[:rows])


def test_tile_sizes_depend_on_the_weight_alone():
    assert tile_sizes(576, 1536, jnp.bfloat16) == (64, 128)
    assert tile_sizes(576, 1536, jnp.float32) == (32, 128)
    assert tile_sizes(576, 192, jnp.float32) == (32, 64)
    assert tile_sizes(40, 24, jnp.float32) == (32, 128)  # padded: no power of two >= 16 fits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_column_slice_tiled_as_its_whole_weight_keeps_its_bits(dtype):
    """A tensor-parallel shard's columns (`columns`: the whole weight's N) get the bits of
    the whole product, whether its slices are whole tiles (256 = 2 x 128) or cut them
    (64 of a 128-wide tile: zero-padded to the whole tile) and for the tied-head layout."""
    k, n = 96, 256
    x = jnp.asarray(RNG.standard_normal((5, k)), dtype)
    w = jnp.asarray(RNG.standard_normal((k, n)), dtype)
    f = jax.jit(lambda x, w, cols: tiled_matmul(x, w, backend="interpret", columns=cols),
                static_argnums=2)
    full = np.asarray(f(x, w, None))
    for width in (128, 64):
        for start in range(0, n, width):
            np.testing.assert_array_equal(np.asarray(f(x, w[:, start:start + width], n)),
                                          full[:, start:start + width])
    # 576 columns (64-wide tiles) in four 144-column slices: slices start mid-tile
    w576 = jnp.asarray(RNG.standard_normal((k, 576)), dtype)
    full576 = np.asarray(f(x, w576, None))
    for start in range(0, 576, 144):
        np.testing.assert_array_equal(np.asarray(f(x, w576[:, start:start + 144], 576)),
                                      full576[:, start:start + 144])
    wt = w.T  # [N, K]
    g = jax.jit(lambda x, w, cols: tiled_matmul(x, w, w_rows_out=True, backend="interpret",
                                                columns=cols), static_argnums=2)
    np.testing.assert_array_equal(np.asarray(g(x, wt[64:128], n)),
                                  np.asarray(g(x, wt, None))[:, 64:128])
    with pytest.raises(ValueError, match="fewer than"):
        tiled_matmul(x, w, backend="interpret", columns=n - 1)


def test_tiled_matmul_gradients_are_the_matmuls():
    x = jnp.asarray(RNG.standard_normal((5, 40)), jnp.float32)
    for rows_out in (False, True):
        w = jnp.asarray(RNG.standard_normal((24, 40) if rows_out else (40, 24)), jnp.float32)
        plain = (lambda x, w: x @ w.T) if rows_out else (lambda x, w: x @ w)
        got = jax.grad(lambda x, w: (tiled_matmul(x, w, w_rows_out=rows_out,
                                                  backend="interpret") ** 2).sum(), (0, 1))(x, w)
        want = jax.grad(lambda x, w: (plain(x, w) ** 2).sum(), (0, 1))(x, w)
        for g, h in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-5, atol=1e-4)


def test_tiled_matmul_refuses_bad_input():
    with pytest.raises(ValueError, match="backend"):
        tiled_matmul(jnp.ones((2, 3)), jnp.ones((3, 4)), backend="xla")
    with pytest.raises(ValueError, match="contract"):
        tiled_matmul(jnp.ones((2, 3)), jnp.ones((4, 5)), backend="interpret")


def _logits(rows: int, vocab: int, seed: int = 0):
    """f32 [rows, vocab] logits with some entries (and one whole row) excluded (-inf)."""
    rng = np.random.default_rng(seed)
    x = 4 * rng.standard_normal((rows, vocab)).astype(np.float32)
    x[1, : vocab - 3] = -np.inf  # a top-k-filtered row: 3 tokens left
    x[2] = -np.inf  # nothing left
    return jnp.asarray(x)


@pytest.mark.parametrize("vocab", [BLOCK_V, 700, 40, CHUNK_V + 904])
def test_log_sum_exp_is_the_normaliser_and_its_rows_ignore_the_batch(vocab):
    """numpy's log-sum-exp within fp32 rounding (-inf for a row with nothing left); each
    row's bits are the same among 1, 3, 17 or 64 rows as among 133 (one program per
    BLOCK_ROWS rows, the vocabulary walked in BLOCK_V columns whatever the row count)."""
    x = _logits(133, vocab)
    lse = jax.jit(lambda a: log_sum_exp(a, backend="interpret"))
    full = np.asarray(lse(x))
    xs = np.asarray(x, np.float64)
    top = np.max(xs, axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        want = (top[:, 0] + np.log(np.exp(xs - np.where(np.isfinite(top), top, 0)).sum(1))
                - np.where(np.isfinite(top[:, 0]), 0, top[:, 0]))
    finite = np.isfinite(want)
    np.testing.assert_allclose(full[finite], want[finite], rtol=2e-6, atol=2e-6)
    assert full[2] == -np.inf and finite.sum() == 132
    for rows in (1, 3, 17, 64):
        assert np.array_equal(np.asarray(lse(x[:rows])), full[:rows]), rows
    assert log_sum_exp(x.reshape(7, 19, vocab), backend="interpret").shape == (7, 19)


def test_the_vocabulary_chunk_is_a_function_of_the_vocabulary():
    assert [chunk_size(v) for v in (1, 40, BLOCK_V, 700, 49152, 151936)] == [
        BLOCK_V, BLOCK_V, BLOCK_V, 1024, CHUNK_V, CHUNK_V]


def test_log_sum_exp_gradient_is_the_softmax():
    x = _logits(5, 300)
    g = jax.grad(lambda a: (log_sum_exp(a, backend="interpret")[jnp.array([0, 1, 3])]
                            * jnp.array([1.0, 2.0, -1.0])).sum())(x)
    want = np.zeros((5, 300), np.float32)
    for row, weight in zip((0, 1, 3), (1.0, 2.0, -1.0)):
        want[row] = weight * np.asarray(jax.nn.softmax(x[row]))
    np.testing.assert_allclose(np.asarray(g), want, atol=1e-6)


def test_log_sum_exp_refuses_bad_input():
    with pytest.raises(ValueError, match="backend"):
        log_sum_exp(jnp.zeros((2, 8)), backend="xla")
    with pytest.raises(ValueError, match="V > 0"):
        log_sum_exp(jnp.zeros((2, 0)), backend="interpret")
    assert log_sum_exp(jnp.zeros((0, 8)), backend="interpret").shape == (0,)


def test_the_samplers_normaliser_runs_on_the_kernel_under_the_setting(monkeypatch):
    """distribution.log_normaliser (every recorded and recomputed log-prob) is
    log_sum_exp's program under JAXRL_CACHE_KERNELS, its tree form otherwise."""
    from jaxrl_cache.distribution import log_normaliser
    x = _logits(9, 200, seed=3)
    monkeypatch.setenv(KERNELS_ENV, "interpret")
    assert "pallas_call" in str(jax.make_jaxpr(lambda a: log_normaliser(a))(x))
    assert np.array_equal(np.asarray(log_normaliser(x)),
                          np.asarray(log_sum_exp(x, backend="interpret")))
    monkeypatch.setenv(KERNELS_ENV, "xla")
    assert "pallas_call" not in str(jax.make_jaxpr(lambda a: log_normaliser(a))(x))
    tree = np.asarray(log_normaliser(x))
    finite = np.isfinite(tree)
    np.testing.assert_allclose(tree[finite], np.asarray(log_sum_exp(x, backend="interpret"))[finite],
                               rtol=2e-6, atol=2e-6)


def test_invariant_kernels_reads_the_environment(monkeypatch):
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert invariant_kernels() is None
    assert resolve_backend("auto") == ("pallas" if jax.default_backend() == "gpu" else "xla")
    monkeypatch.setenv(KERNELS_ENV, "interpret")
    assert invariant_kernels() == "interpret"
    assert resolve_backend("auto") == "interpret"  # the engine's attention follows
    monkeypatch.setenv(KERNELS_ENV, "gpu")
    with pytest.raises(ValueError, match=KERNELS_ENV):
        invariant_kernels()


def test_jitted_entry_points_keep_a_program_per_setting(monkeypatch):
    """A plain jit would serve the program traced under one setting to a call under another
    (the setting is read while tracing); a kernel-keyed jit traces once per setting and
    reuses each: here the model's projection, on XLA's dot or on the tiled kernel."""
    from jaxrl_cache.models.dense import dense
    traces = []

    def project(x, w):
        traces.append(invariant_kernels())
        return dense(x, w)

    f = kernel_keyed_jit(project)
    x = jnp.asarray(RNG.standard_normal((3, 40)), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((40, 24)), jnp.float32)
    jaxpr = lambda: str(f.trace(x, w).jaxpr)
    for setting in ("xla", "interpret", "xla", "interpret"):
        monkeypatch.setenv(KERNELS_ENV, setting)
        want = jax.jit(lambda x, w: dense(x, w))(x, w)  # a fresh trace under the setting
        np.testing.assert_array_equal(np.asarray(f(x, w)), np.asarray(want))
        assert ("pallas_call" in jaxpr()) == (setting == "interpret")
    assert traces == [None, "interpret"]  # trace() hits the cache of each setting too
    assert f._cache_size() == 1  # the current setting's own cache
    copied = copy.copy(f)  # attribute lookups on a blank instance do not recurse
    np.testing.assert_array_equal(np.asarray(copied(x, w)), np.asarray(f(x, w)))


def test_every_entry_point_that_traces_the_setting_is_kernel_keyed():
    from jaxrl_cache.rl import logprobs, sft, train
    from jaxrl_cache.rollout import core
    from kernels_pallas import paged_decode_attention, paged_prefill_attention
    from kernels_pallas._common import KernelKeyedJit
    for entry in (core.prefill_step, core.decode_chunk, logprobs._next_token_log_probs,
                  sft.sft_step, train._score, train._version_audit, *train.TRAIN_JITS.values(),
                  paged_prefill_attention, paged_decode_attention):
        assert isinstance(entry, KernelKeyedJit), entry


# Two packed rows of 8 TILEs, as rl.packing lays them out (segment, parent per tile): row 0
# holds sequences A (tiles 0-4, crossing a key-block edge) and B (tiles 5-7, starting
# mid-block in the row); row 1 a shared prefix P (tiles 0-2) and samples S1 (3-5) and S2
# (6-7) attending to it, whose first key blocks mix P's tiles and their own.
SEGMENTS = np.array([[1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 2, 2, 2, 3, 3]])
PARENTS = np.array([[0, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1, 1]])


def _packed_rows(group: int):
    """-> (blocks int32 [2, NQ, KM] (each tile's TILEs in its sequence's order: its parent's,
    then its own up to itself; -1 after), visible bool [2, NQ, TILE * G, KM * TILE], items
    int32 [2, 1, W]: the (tile, key block) pairs with a listed TILE, shuffled, -1 between)."""
    nq = SEGMENTS.shape[1]
    km = -(-nq // (KEY_BLOCK // TILE)) * (KEY_BLOCK // TILE)
    blocks = np.full((2, nq, km), -1, np.int32)
    for b in range(2):
        for t in range(nq):
            seg, par = SEGMENTS[b, t], PARENTS[b, t]
            seen = [u for u in range(nq) if par and SEGMENTS[b, u] == par]
            seen += [u for u in range(t + 1) if SEGMENTS[b, u] == seg]
            blocks[b, t, :len(seen)] = seen
    segments, parents = np.repeat(SEGMENTS, TILE, axis=1), np.repeat(PARENTS, TILE, axis=1)
    cols = (np.maximum(blocks, 0)[..., None] * TILE + np.arange(TILE)).reshape(2, nq, -1)
    q_cols = np.arange(nq * TILE).reshape(nq, TILE)
    visible = np.zeros((2, nq, TILE, cols.shape[-1]), bool)
    for b in range(2):
        for t in range(nq):
            for i in range(TILE):
                qc, kc = q_cols[t, i], cols[b, t]
                seg = segments[b, kc]
                sees = (seg == segments[b, qc]) | ((seg == parents[b, qc]) & (parents[b, qc] > 0))
                valid = np.repeat(blocks[b, t] >= 0, TILE)
                visible[b, t, i] = sees & valid & (kc <= qc)
    filled = blocks[..., ::KEY_BLOCK // TILE].reshape(2, -1) >= 0
    items = np.full((2, 1, filled.shape[1] + 3), -1, np.int32)
    for b in range(2):  # any order, pads anywhere: each pair is chained by its block index
        slots = np.sort(RNG.choice(items.shape[-1], filled[b].sum(), replace=False))
        items[b, 0, slots] = RNG.permutation(np.flatnonzero(filled[b]))
    return blocks, np.repeat(visible, group, axis=2), items


def test_gathered_attention_gives_each_packed_sequence_its_own_bits():
    """Each sequence of the packed rows, attended alone from position 0 in the canonical
    order (`blocked_attention`: the sampler's), has the bits gathered_attention gives its
    rows: a sequence starting mid-block in its row, and one whose key blocks mix a shared
    prefix's TILEs with its own, included."""
    hkv, group, d, nq = 2, 2, 16, SEGMENTS.shape[1]
    blocks, visible, items = _packed_rows(group)
    q = RNG.standard_normal((2, hkv, nq, TILE * group, d)).astype(np.float32)
    k = RNG.standard_normal((2, hkv, nq * TILE, d)).astype(np.float32)
    v = RNG.standard_normal((2, hkv, nq * TILE, d)).astype(np.float32)
    heads_blocks = jnp.broadcast_to(jnp.maximum(jnp.asarray(blocks), 0)[:, None],
                                    (2, hkv, *blocks.shape[1:]))
    attend = jax.jit(gathered_attention, static_argnums=6)
    got = np.asarray(attend(q, k, v, heads_blocks, jnp.asarray(visible)[:, None], items, 0.25))
    every_pair = attend(q, k, v, heads_blocks, jnp.asarray(visible)[:, None],
                        all_items(heads_blocks), 0.25)
    np.testing.assert_array_equal(np.asarray(every_pair), got)  # empty blocks add nothing
    checked = 0
    for b in range(2):
        for seg in range(1, SEGMENTS[b].max() + 1):
            own = [t for t in range(nq) if SEGMENTS[b, t] == seg]
            par = PARENTS[b, own[0]]
            keys = [t for t in range(nq) if par and SEGMENTS[b, t] == par] + own
            cols = (np.array(keys)[:, None] * TILE + np.arange(TILE)).reshape(-1)
            first = len(keys) - len(own)  # the sequence's own rows start at this tile
            qs = q[b][:, own].reshape(hkv, -1, d)  # [Hkv, own * TILE * G, D]
            pos = np.repeat(first * TILE + np.arange(len(own) * TILE), group)
            causal = np.arange(len(cols))[None, :] <= pos[:, None]
            want = np.asarray(blocked_attention(qs, k[b][:, cols], v[b][:, cols],
                                                causal[None], 0.25))
            np.testing.assert_array_equal(got[b][:, own].reshape(want.shape), want)
            checked += 1
    assert checked == 5  # A, B, P, S1, S2


def test_gathered_attention_gradient_is_dense_attentions_over_the_row():
    """The cotangents of q, k and v from the computed pairs alone (shuffled, with unused
    slots) equal autodiff through plain dense attention over each whole row under its
    segment/parent/causal mask: a key TILE several tiles see gets all their shares."""
    hkv, group, d, nq = 2, 2, 16, SEGMENTS.shape[1]
    blocks, visible, items = _packed_rows(group)
    q, k, v = (jnp.asarray(RNG.standard_normal(shape), jnp.float32) for shape in (
        (2, hkv, nq, TILE * group, d), (2, hkv, nq * TILE, d), (2, hkv, nq * TILE, d)))
    heads_blocks = jnp.broadcast_to(jnp.maximum(jnp.asarray(blocks), 0)[:, None],
                                    (2, hkv, *blocks.shape[1:]))
    segments, parents = np.repeat(SEGMENTS, TILE, axis=1), np.repeat(PARENTS, TILE, axis=1)
    cols = np.arange(nq * TILE)
    q_cols = np.repeat(cols, group)  # query row i of the flattened tiles is column i // G
    mask = (segments[:, q_cols, None] == segments[:, None, :]) | (
        (parents[:, q_cols, None] == segments[:, None, :]) & (parents[:, q_cols, None] > 0))
    mask = jnp.asarray(mask & (cols[None, :] <= q_cols[:, None])[None])[:, None]

    def dense(q, k, v):  # [2, Hkv, NQ * TILE * G, L] scores, one softmax per row
        s = jnp.einsum("bhmd,bhld->bhml", q.reshape(2, hkv, -1, d), k) * 0.25
        out = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1) @ v
        return out.reshape(q.shape)

    def gathered(q, k, v):
        return gathered_attention(q, k, v, heads_blocks, jnp.asarray(visible)[:, None], items,
                                  0.25)

    weights = jnp.asarray(RNG.standard_normal(q.shape), jnp.float32)
    loss = lambda f: lambda *x: (f(*x) * weights).sum()  # noqa: E731
    np.testing.assert_allclose(np.asarray(gathered(q, k, v)), np.asarray(dense(q, k, v)),
                               rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.grad(loss(gathered), (0, 1, 2))(q, k, v),
                         jax.grad(loss(dense), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_prefill_kernel_computes_the_trainers_gathered_attention(dtype):
    """Packed rows with separate sequences and a shared prefix: the prefill kernel over the
    row's TILEs as pages returns gathered_attention's bits (in the model's dtype, as the
    model casts it), and its gradient (bf16: the kernel's output, a residual of the shared
    backward pass, is already rounded)."""
    hkv, group, d, nq = 2, 2, 16, SEGMENTS.shape[1]
    blocks, visible, items = _packed_rows(group)
    q = jnp.asarray(RNG.standard_normal((2, hkv, nq, TILE * group, d)), dtype)
    k = jnp.asarray(RNG.standard_normal((2, hkv, nq * TILE, d)), dtype)
    v = jnp.asarray(RNG.standard_normal((2, hkv, nq * TILE, d)), dtype)
    heads_blocks = jnp.broadcast_to(jnp.maximum(jnp.asarray(blocks), 0)[:, None],
                                    (2, hkv, *blocks.shape[1:]))
    vis = jnp.asarray(visible)[:, None]
    want = jax.jit(gathered_attention, static_argnums=6)(q, k, v, heads_blocks, vis, items,
                                                         0.25)
    kernel = jax.jit(lambda *a: gathered_prefill_attention(*a, 0.25, "interpret"))
    got = kernel(q, k, v, heads_blocks, vis, items)
    np.testing.assert_array_equal(np.asarray(got.astype(dtype)), np.asarray(want.astype(dtype)))
    loss = lambda f: lambda q, k, v: (f(q, k, v) ** 2).sum()  # noqa: E731
    g_want = jax.grad(loss(lambda q, k, v: gathered_attention(q, k, v, heads_blocks, vis,
                                                              items, 0.25)), (0, 1, 2))(q, k, v)
    g_got = jax.grad(loss(lambda q, k, v: kernel(q, k, v, heads_blocks, vis, items)),
                     (0, 1, 2))(q, k, v)
    for a, b in zip(g_got, g_want):
        if dtype == "float32":
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                       rtol=0.05, atol=0.05)


def test_the_exactness_suite_holds_on_the_invariant_kernels():
    """tests/test_exactness.py's detection and property tests under
    JAXRL_CACHE_KERNELS=interpret: the engine's attention runs the interpret kernels, the
    projections tiled_matmul, the trainer's attention the prefill kernel. Every recorded bit
    reproduces over drawn batch compositions, schedules, page sizes, prefix hits and
    packings, and one update at lr 1e-7 (and 1e-6 under `make test-full`) gets every stale
    sample flagged. Interpret mode compiles slowly, so `make test` draws 3 of the property
    test's examples (`JAXRL_EXACTNESS_EXAMPLES`), the full sweep all of them."""
    full = os.environ.get("JAXRL_FULL_SWEEP") == "1"
    env = dict(os.environ, **{KERNELS_ENV: "interpret"})
    if not full:
        env["JAXRL_EXACTNESS_EXAMPLES"] = "3"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-p", "no:xdist",
         str(pathlib.Path(__file__).with_name("test_exactness.py")),
         "-k", "one_update or every_token" if full else "one_update and 1e-07 or every_token"],
        env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert ("3 passed" if full else "2 passed") in proc.stdout
