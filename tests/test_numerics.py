"""The batch-invariant building blocks of exact numerics (kernels_pallas/blocked.py,
models.llama.dense): right against numpy, and bit-identical however a row is batched.

The facts the design rests on are measured on the CPU the tests run on, never pinned to one
CPU's figures (an AVX2 EPYC and an AVX-512 Xeon need different row bounds): a dot's row bits
depend on the row count for few rows, by a bound `invariant_rows` measures per shape, and
each measured bound is checked right and tight here against a brute-force dot of its own.
"""
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_cache.models.dense import (FALLBACK_ROWS, PROBE_ROWS, Transposed, dense,
                                      invariant_rows, rows_out_rows, transpose_pays)
from kernels_pallas.blocked import (KEY_BLOCK, block_scores, blocked_attention, chain_sum,
                                    key_blocks, tree_sum)

RNG = np.random.default_rng(0)


def test_tree_sum_is_a_sum_and_ignores_zero_padding():
    x = RNG.standard_normal((5, 37)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(tree_sum(jnp.asarray(x))), x.sum(-1), rtol=1e-5)
    for extra in (1, 27, 91):  # any zero tail: the same bits
        padded = np.pad(x, ((0, 0), (0, extra)))
        np.testing.assert_array_equal(np.asarray(tree_sum(jnp.asarray(padded))),
                                      np.asarray(tree_sum(jnp.asarray(x))))


def test_chain_sum_ignores_leading_and_trailing_zeros():
    x = RNG.standard_normal((6, 3)).astype(np.float32)
    padded = np.concatenate([np.zeros((4, 3), np.float32), x, np.zeros((5, 3), np.float32)])
    np.testing.assert_array_equal(np.asarray(chain_sum(jnp.asarray(padded), 0)),
                                  np.asarray(chain_sum(jnp.asarray(x), 0)))


@pytest.mark.parametrize("k,n,rows_out", [(576, 1536, False), (1536, 576, False),
                                          (576, 4096, True), (64, 32, False), (64, 40, True)])
def test_dense_rows_do_not_depend_on_the_batch(k, n, rows_out):
    """A row's bits are the same alone, among a few rows, or among thousands (SmolLM2's
    projection and tied-head shapes, the tiny model's narrow k/v projection)."""
    x = RNG.standard_normal((1100, k)).astype(np.float32)
    w = jnp.asarray(RNG.standard_normal((n, k) if rows_out else (k, n)).astype(np.float32)
                    * 0.05)
    f = jax.jit(lambda x, w: dense(x, w, w_rows_out=rows_out))
    ref = np.asarray(f(jnp.asarray(x[:256]), w))
    for rows in (1, 3, 16, 32, 33, 47, 51, 64, 100, 1100):
        got = np.asarray(f(jnp.asarray(x[:rows]), w))
        np.testing.assert_array_equal(got[:min(rows, 256)], ref[:min(rows, 256)])
    np.testing.assert_allclose(ref, x[:256] @ np.asarray(w.T if rows_out else w), rtol=1e-4,
                               atol=1e-4)


def _agrees(k: int, n: int, rows_out: bool, counts, transposed: bool = False) -> list:
    """For each count: whether a [count, k] dot gives each row the bits the [in, out] (or
    [out, in] when rows_out) dot gives it among 256 rows; transposed: the counts run on a
    row-major copy of the weight in the other layout. Data of its own, so the probe's
    inputs are not what decides it."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((256, k)), jnp.float32)
    w = rng.standard_normal((n, k) if rows_out else (k, n)).astype(np.float32)
    dims = lambda rows_out: (((1,), (1 if rows_out else 0,)), ((), ()))  # noqa: E731
    dot = jax.jit(lambda x, w, rows_out: jax.lax.dot_general(x, w, dims(rows_out)),
                  static_argnums=2)
    ref = np.asarray(dot(x, jnp.asarray(w), rows_out))
    probe = jnp.asarray(np.ascontiguousarray(w.T)) if transposed else jnp.asarray(w)
    return [np.array_equal(np.asarray(dot(x[:c], probe, rows_out != transposed)), ref[:c])
            for c in counts]


def _check_bound(bound, k, n, rows_out, transposed=False):
    """A measured bound is right (every count from it on keeps the bits, probed or not) and
    tight (the probed count below it does not: no padding beyond what this CPU needs)."""
    counts = sorted({c for c in PROBE_ROWS if c >= bound} | {bound + 1, bound + 3, 200})
    assert all(_agrees(k, n, rows_out, counts, transposed)), (k, n, bound)
    below = [c for c in PROBE_ROWS if c < bound]
    if below and bound != FALLBACK_ROWS:
        assert not _agrees(k, n, rows_out, below[-1:], transposed)[0], (k, n, bound)


@pytest.mark.parametrize("k,n,rows_out", [(576, 1536, False), (1536, 576, False),
                                          (64, 32, False), (64, 40, True)])
def test_the_measured_row_bound_is_right_and_tight_on_this_cpu(k, n, rows_out):
    """`invariant_rows` is what this CPU's dot needs (which differs between CPUs: 33 at
    [576, 1536] on one AVX-512 Xeon, 64 on an AVX2 EPYC): every row count from the bound
    on gives a row the bits it has among 256, and the probed count below it does not."""
    _check_bound(invariant_rows(k, n, "float32", rows_out), k, n, rows_out)


@pytest.mark.parametrize("k,n", [(576, 1536), (576, 192), (1536, 576), (64, 32), (64, 128)])
def test_the_measured_transpose_bound_is_right_and_tight_on_this_cpu(k, n):
    """`rows_out_rows`: from its bound on, the [out, in] copy gives every row the [in, out]
    dot's bits among 256, and the probed count below it does not (None: the layouts never
    agree, not even at 256 rows); the engine holds a transpose exactly where that bound is
    below the [in, out] one (`transpose_pays`)."""
    bound = rows_out_rows(k, n, "float32")
    if bound is None:
        assert not _agrees(k, n, False, [256], transposed=True)[0]
    else:
        _check_bound(bound, k, n, False, transposed=True)
    assert transpose_pays(k, n, "float32") == (
        bound is not None and bound < min(invariant_rows(k, n, "float32", False),
                                          FALLBACK_ROWS))


@pytest.mark.parametrize("k,n", [(576, 1536), (576, 192), (1536, 576), (64, 32), (64, 96)])
def test_the_transpose_gives_the_trainer_bits_at_every_row_count(k, n):
    """The rollout engine's few-row dots run on the [out, in] transpose (`Transposed`): each
    row gets the bits the [in, out] weight gives it among 256 rows (the trainer's), at every
    count from 1 (padded to the measured bound) to 1100, and in a jitted scan over stacked
    layers as the decode slices them."""
    x = RNG.standard_normal((1100, k)).astype(np.float32)
    w = RNG.standard_normal((3, k, n)).astype(np.float32) * 0.05
    both = Transposed(jnp.asarray(w), jnp.asarray(np.ascontiguousarray(w.swapaxes(1, 2))))
    trainer = jax.jit(lambda x, w: dense(x, w[1]))
    ref = np.asarray(trainer(jnp.asarray(x[:256]), jnp.asarray(w)))
    sampler = jax.jit(lambda x, ws: jax.lax.scan(lambda c, wl: (c, dense(x, wl)), 0, ws)[1][1])
    for rows in (1, 2, 3, 8, 16, 31, 33, 49, 51, 64, 100, 256, 1100):
        got = np.asarray(sampler(jnp.asarray(x[:rows]), both))
        np.testing.assert_array_equal(got[:min(rows, 256)], ref[:min(rows, 256)])


def test_block_scores_do_not_depend_on_query_or_key_counts():
    q = RNG.standard_normal((2, 300, 64)).astype(np.float32)
    k = RNG.standard_normal((2, 400, 64)).astype(np.float32)
    f = jax.jit(lambda q, k: block_scores(q, key_blocks(k, -2), 0.125))
    ref = np.asarray(f(q[:, :64], k[:, :64]))  # [2, 4, 64, 16]
    for m in (1, 2, 5, 64, 300):
        for keys in (16, 32, 48, 96, 400):
            got = np.asarray(f(q[:, :m], k[:, :keys]))
            blocks = min(keys, 64) // KEY_BLOCK
            np.testing.assert_array_equal(got[:, :blocks, :min(m, 64)],
                                          ref[:, :blocks, :min(m, 64)])


def _numpy_attention(q, k, v, visible, scale):
    s = np.einsum("md,ld->ml", q.astype(np.float64), k) * scale
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def test_blocked_attention_is_attention_and_position_aligned():
    """Against numpy; and a sequence placed after another one's keys (a packed row, keys
    on block edges) or followed by free slots gives the same bits as alone."""
    length, d = 37, 16
    q = RNG.standard_normal((length, d)).astype(np.float32)
    k = RNG.standard_normal((length, d)).astype(np.float32)
    v = RNG.standard_normal((length, d)).astype(np.float32)
    causal = np.tril(np.ones((length, length), bool))
    alone = np.asarray(jax.jit(blocked_attention, static_argnums=4)(q, k, v, causal, 0.25))
    np.testing.assert_allclose(alone, _numpy_attention(q, k, v, causal, 0.25), atol=1e-5)
    before = 2 * KEY_BLOCK  # another segment's keys first, then padding after
    total = before + length + 23
    kk = RNG.standard_normal((total, d)).astype(np.float32)
    vv = RNG.standard_normal((total, d)).astype(np.float32)
    kk[before:before + length], vv[before:before + length] = k, v
    vis = np.zeros((length, total), bool)
    vis[:, before:before + length] = causal
    shifted = np.asarray(jax.jit(blocked_attention, static_argnums=4)(q, kk, vv, vis, 0.25))
    np.testing.assert_array_equal(shifted, alone)


def test_blocked_attention_gradients_are_attention_gradients():
    """The backward pass (dense, not the blocks') gives dense attention's gradients, with
    a visibility mask broadcast over heads, a query row that sees no key (its gradient 0)
    and causal packing; cotangents come back in the inputs' dtype."""
    batch, heads, m, length, d = 2, 3, 9, 21, 16
    q = jnp.asarray(RNG.standard_normal((batch, heads, m, d)), jnp.float32)
    k = jnp.asarray(RNG.standard_normal((batch, heads, length, d)), jnp.float32)
    v = jnp.asarray(RNG.standard_normal((batch, heads, length, d)), jnp.float32)
    visible = np.tril(np.ones((m, length), bool), k=length - m)[None, None].repeat(batch, 0)
    visible[1, 0, 4] = False  # a row without a visible key
    cot = jnp.asarray(RNG.standard_normal((batch, heads, m, d)), jnp.float32)

    def dense_attention(q, k, v):
        s = jnp.where(visible, jnp.einsum("...md,...ld->...ml", q, k) * 0.25, -jnp.inf)
        p = jnp.exp(s - jnp.max(s, -1, keepdims=True, initial=-1e30))
        p = jnp.where(visible, p, 0.0)
        return jnp.einsum("...ml,...ld->...md", p / jnp.maximum(p.sum(-1, keepdims=True),
                                                               1e-30), v)

    def grads(attention):
        return jax.jit(jax.grad(lambda q, k, v: (attention(q, k, v) * cot).sum(),
                                argnums=(0, 1, 2)))(q, k, v)

    ours = grads(lambda q, k, v: blocked_attention(q, k, v, jnp.asarray(visible), 0.25))
    for got, want in zip(ours, grads(dense_attention)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    assert not np.asarray(ours[0])[1, 0, 4].any()
    half = jax.grad(lambda q: blocked_attention(q, k.astype(jnp.bfloat16), v, visible,
                                                0.25).sum())(q.astype(jnp.bfloat16))
    assert half.dtype == jnp.bfloat16


def _score_forms_agree(head_dim: int) -> bool:
    """Whether the [D, L] score dot gives the [L, D] form's bits at the decode (4 rows),
    training-tile (48 rows) and probe shapes."""
    from kernels_pallas.blocked import _score_dot
    rng = np.random.default_rng(3)
    laid = jax.jit(lambda q, k: _score_dot(q, k, transposed=True))
    plain = jax.jit(lambda q, k: _score_dot(q, k, transposed=False))
    for lead, m, n in (((8, 3), 4, 192), ((2, 3, 5), 48, 192), ((2,), 4, 64)):
        q = jnp.asarray(rng.standard_normal((*lead, m, head_dim)), jnp.float32)
        keys = jnp.asarray(rng.standard_normal((*lead, n, head_dim)), jnp.float32)
        if not np.array_equal(np.asarray(laid(q, keys)), np.asarray(plain(q, keys))):
            return False
    return True


def test_scores_read_keys_laid_out_d_by_l_only_where_that_keeps_the_bits():
    """`_score_dot` takes the [D, L] key layout (2-3x faster on XLA:CPU at decode) only where
    the probe found it gives the [L, D] form's bits, so the score bits never depend on the
    choice; the barrier really keeps the layout (XLA folds a bare transpose into the dot).
    The probe's answer depends on the compiler: this suite compiles at
    xla_backend_optimization_level 0, where the forms differ at every head size, so the
    production setting is checked in a subprocess below."""
    from kernels_pallas.blocked import _score_dot, keys_transposed
    for d in (16, 64, 128):
        if keys_transposed(d):
            assert _score_forms_agree(d)
    q, keys = jnp.zeros((2, 4, 64)), jnp.zeros((2, 64, 64))
    hlo = jax.jit(lambda q, k: _score_dot(q, k, transposed=True)).lower(q, keys).as_text()
    assert "optimization_barrier" in hlo


PRODUCTION_SCORES = """
import dataclasses, jax, numpy as np
from tests.test_numerics import _score_forms_agree
from kernels_pallas.blocked import keys_transposed
from jaxrl_cache.app.demo import builtin_model_config
from jaxrl_cache.models import init_params
from jaxrl_cache.rl.audit import audit_attribution
from jaxrl_cache.rollout import CacheConfig, RolloutEngine, SamplingParams
from jaxrl_cache.rollout.types import SchedulerConfig
assert [keys_transposed(d) for d in (16, 32, 48, 64, 80, 96, 128)] == [True] * 4 + [False] * 3
assert _score_forms_agree(64)
config = builtin_model_config(vocab_size=40)
params = init_params(config, jax.random.key(0))
engine = RolloutEngine(config, CacheConfig(num_pages=128, page_size=4),
                       scheduler_config=SchedulerConfig(max_num_seqs=8, chunk_steps=8))
prompts = [list(range(3, 23)), list(range(7, 30))]
batch = engine.rollout(params, 0, prompts, SamplingParams(n=2, max_new_tokens=60),
                       rng=jax.random.key(1))
report = audit_attribution(batch, {0: params}, config)
assert report.ok and report.max_abs_diff == 0.0, report
print("ok")
"""


def test_scores_read_keys_laid_out_d_by_l_at_the_default_optimisation_level():
    """The setting users run (XLA's default optimisation): the [D, L] form gives the [L, D]
    form's bits up to head_dim 64 and is taken there, not at 80-128; an engine sampling
    through it over two key blocks reproduces every log-prob bit for bit."""
    import os
    import subprocess
    import sys
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(
        "--xla_backend_optimization_level=0", "").strip()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", PRODUCTION_SCORES], env=env, cwd=root,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_every_head_size_keeps_the_order_with_p_at_v_at_its_measured_width():
    """The probe behind rl.audit.tolerance_for. Where XLA:CPU's p @ v dot [M, 16] x [16, D]
    gives a row other bits at few rows than among many (which head sizes: the CPU's; on an
    AVX-512 Xeon 32, 48, 80 and 96), `block_values` runs it zero-padded to `value_width`,
    the first of the next power of two and its doubles where it does not; every head size
    then keeps the order and an engine of such a model is audited at tolerance 0, its
    samples reproducing bit for bit on the xla backend."""
    from jaxrl_cache.models import ModelConfig, init_params
    from jaxrl_cache.rl.audit import CALIBRATED_TOLERANCE, audit_attribution, tolerance_for
    from jaxrl_cache.rollout import CacheConfig, RolloutEngine, SamplingParams
    from kernels_pallas import KERNELS_ENV
    from kernels_pallas.blocked import _values_keep_rows, batch_invariant, value_width
    for d in (16, 32, 48, 64, 80, 96, 128):
        width, first = value_width(d), 1 << (d - 1).bit_length()
        candidates = list(dict.fromkeys((d, first, 2 * first, 4 * first)))
        keeps = [_values_keep_rows(c) for c in candidates]
        assert width == candidates[keeps.index(True) if True in keeps else 0], (d, keeps)
        assert batch_invariant(d), d
    prompts = [list(range(1, 20)), list(range(5, 9))]
    for head_dim in (32, 80):
        config = ModelConfig.tiny(vocab_size=32, head_dim=head_dim)
        params = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x,
                              init_params(config, jax.random.key(head_dim)))
        engine = RolloutEngine(config, CacheConfig(num_pages=32, page_size=4), backend="xla")
        assert tolerance_for(engine) == 0.0
        batch = engine.rollout(params, 0, prompts, SamplingParams(n=3, max_new_tokens=6),
                               rng=jax.random.key(0))
        report = audit_attribution(batch, {0: params}, config)
        assert report.ok and report.exact and report.max_abs_diff == 0.0, report
        # the kernels chunk 80 as 64 + 16, XLA's attention runs it whole: an engine and a
        # trainer on different sides of the setting are exact at 32 only
        kernel = RolloutEngine(config, CacheConfig(num_pages=32, page_size=4),
                               backend="interpret")
        want = 0.0 if head_dim == 32 else CALIBRATED_TOLERANCE
        assert tolerance_for(kernel) == want
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(KERNELS_ENV, "interpret")  # the trainer on the kernels
            assert tolerance_for(engine) == want and tolerance_for(kernel) == 0.0
        if head_dim == 32:
            batch = kernel.rollout(params, 0, prompts, SamplingParams(n=3, max_new_tokens=6),
                                   rng=jax.random.key(0))
            report = audit_attribution(batch, {0: params}, config)
            assert report.ok and report.exact and report.max_abs_diff == 0.0, report


def test_the_one_off_probes_run_inside_a_trace_that_disallows_transfers():
    """The row-count probes (`value_width`, `batch_invariant`, `invariant_rows`) measure
    with host arrays the first time a size is traced; a caller's
    jax.transfer_guard("disallow") does not turn that into an error (sizes used nowhere
    else, so each is measured here for the first time)."""
    from kernels_pallas.blocked import batch_invariant
    q = jnp.ones((1, 4, 112))
    visible = jnp.ones((4, 4), bool)
    x, w = jnp.ones((3, 41)), jnp.ones((41, 23))
    with jax.transfer_guard("disallow"):
        out = jax.jit(lambda q: blocked_attention(q, q, q, visible, 0.5))(q)
        np.testing.assert_array_equal(np.asarray(out), np.ones((1, 4, 112)))
        np.testing.assert_array_equal(np.asarray(jax.jit(dense)(x, w)), np.full((3, 23), 41.0))
        assert batch_invariant(112)


def _dots(jaxpr) -> list:
    """Every dot_general of a jaxpr, sub-jaxprs (custom_vjp, pjit) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _dots(sub)
    return found


@pytest.mark.parametrize("rows_out", [False, True])
def test_bf16_dense_backward_is_the_gradient_in_row_major_bf16_dots(rows_out):
    """bf16 dense: the forward keeps its bits, the gradients are the fp32 gradients to bf16
    precision, and every dot of the backward takes bf16 operands as [M, K] x [K, N] (the
    only form XLA:CPU's fast bf16 dot takes; autodiff's transposed forms are upcast)."""
    k, n, m = 48, 40, 24
    x32 = jnp.asarray(RNG.standard_normal((m, k)), jnp.float32)
    w32 = jnp.asarray(RNG.standard_normal((n, k) if rows_out else (k, n)), jnp.float32)
    probe = jnp.asarray(RNG.standard_normal((m, n)), jnp.float32)
    x, w = x32.astype(jnp.bfloat16), w32.astype(jnp.bfloat16)

    def loss(x, w):
        return jnp.sum(dense(x, w, jnp.float32, w_rows_out=rows_out) * probe)

    plain = jnp.dot(x.astype(jnp.float32), (w.T if rows_out else w).astype(jnp.float32))
    assert np.array_equal(np.asarray(dense(x, w, jnp.float32, w_rows_out=rows_out)),
                          np.asarray(jax.lax.dot_general(
                              x, w, (((1,), (1 if rows_out else 0,)), ((), ())),
                              preferred_element_type=jnp.float32)))
    np.testing.assert_allclose(np.asarray(dense(x, w, jnp.float32, w_rows_out=rows_out)),
                               np.asarray(plain), rtol=1e-5, atol=1e-4)
    dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
    ref_x, ref_w = jax.grad(lambda a, b: jnp.sum(jnp.dot(a, b.T if rows_out else b) * probe),
                            argnums=(0, 1))(x.astype(jnp.float32), w.astype(jnp.float32))
    assert dx.dtype == dw.dtype == jnp.bfloat16
    for got, want in ((dx, ref_x), (dw, ref_w)):
        got, want = np.asarray(got, np.float32), np.asarray(want)
        assert np.max(np.abs(got - want)) <= 0.02 * np.max(np.abs(want))
    dots = _dots(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w).jaxpr)
    backward = dots[1:]  # the forward's own dot first
    assert len(backward) == 2
    for eqn in backward:
        assert [v.aval.dtype for v in eqn.invars] == [jnp.bfloat16] * 2
        assert eqn.params["dimension_numbers"] == (((1,), (0,)), ((), ()))
