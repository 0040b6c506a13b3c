"""The Pallas kernels lower for CUDA (Triton) at a realistic serving shape, on a CPU host."""
import re

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import (gathered_prefill_attention, paged_decode_attention,
                            paged_prefill_attention)
from kernels_pallas._flash import exact_program
from kernels_pallas.matmul import tiled_matmul
from kernels_pallas.normaliser import log_sum_exp

B, HQ, HKV, D, PAGE, PAGES, WIDTH = 8, 32, 8, 128, 16, 1024, 128
ODD_PAGES = 1000  # real pools need not hold a power-of-two number of pages


def lower_for_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def pool(pages=PAGES, page=PAGE):
    return jax.ShapeDtypeStruct((pages, HKV, page, D), jnp.bfloat16)


@pytest.mark.parametrize("pages,page,width", [(PAGES, PAGE, WIDTH), (ODD_PAGES, 64, 24)])
def test_decode_lowers_to_triton_kernel(pages, page, width):
    text = lower_for_cuda(
        lambda q, k, v, t, n: paged_decode_attention(q, k, v, t, n, backend="pallas"),
        jax.ShapeDtypeStruct((B, HQ, D), jnp.bfloat16), pool(pages, page), pool(pages, page),
        jax.ShapeDtypeStruct((B, width), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32))
    assert "__gpu$xla.gpu.triton" in text
    assert "paged_decode_attention" in text


@pytest.mark.parametrize("pages,tokens,width", [(PAGES, 2048, WIDTH), (ODD_PAGES, 1000, 40)])
def test_prefill_lowers_to_triton_kernel(pages, tokens, width):
    text = lower_for_cuda(
        lambda q, k, v, t, cu, n: paged_prefill_attention(q, k, v, t, cu, n, backend="pallas"),
        jax.ShapeDtypeStruct((tokens, HQ, D), jnp.bfloat16), pool(pages), pool(pages),
        jax.ShapeDtypeStruct((B, width), jnp.int32), jax.ShapeDtypeStruct((B + 1,), jnp.int32),
        jax.ShapeDtypeStruct((B,), jnp.int32))
    assert "__gpu$xla.gpu.triton" in text
    assert "paged_prefill_attention" in text


# exact (default): one split, the canonical order. exact=False: batch 1 splits (partials +
# XLA merge), batch 64 does not (one launch, direct output).
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("head_dim,batch", [(64, 1), (80, 1), (96, 64), (128, 1), (128, 64),
                                            (256, 64)])
def test_every_head_size_lowers(head_dim, batch, exact):
    q = jax.ShapeDtypeStruct((batch, HQ, head_dim), jnp.bfloat16)
    pool_d = jax.ShapeDtypeStruct((PAGES, HKV, PAGE, head_dim), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((batch, WIDTH), jnp.int32)
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    text = lower_for_cuda(
        lambda *a: paged_decode_attention(*a, backend="pallas", num_sms=132, exact=exact),
        q, pool_d, pool_d, table, lens)
    assert text.count("__gpu$xla.gpu.triton") == 1
    text = lower_for_cuda(
        lambda q, k, v, t, cu, n: paged_prefill_attention(q, k, v, t, cu, n, backend="pallas",
                                                          exact=exact),
        jax.ShapeDtypeStruct((512, HQ, head_dim), jnp.bfloat16), pool_d, pool_d, table,
        jax.ShapeDtypeStruct((batch + 1,), jnp.int32), lens)
    assert text.count("__gpu$xla.gpu.triton") == 1


LAYERS = 28


@pytest.mark.parametrize("pages", [PAGES, 40_000])  # 40k pages x 28 layers: > 2**32 bytes
def test_stacked_pool_lowers_with_traced_layer(pages):
    """[L, P, Hkv, ps, D] pools indexed by a traced layer lower for both kernels."""
    stacked = jax.ShapeDtypeStruct((LAYERS, pages, HKV, PAGE, D), jnp.bfloat16)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    text = lower_for_cuda(
        lambda q, k, v, t, n, i: paged_decode_attention(q, k, v, t, n, layer=i,
                                                        backend="pallas"),
        jax.ShapeDtypeStruct((B, HQ, D), jnp.bfloat16), stacked, stacked,
        jax.ShapeDtypeStruct((B, WIDTH), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32),
        layer)
    assert "paged_decode_attention" in text
    text = lower_for_cuda(
        lambda q, k, v, t, cu, n, i: paged_prefill_attention(q, k, v, t, cu, n, layer=i,
                                                             backend="pallas"),
        jax.ShapeDtypeStruct((256, HQ, D), jnp.bfloat16), stacked, stacked,
        jax.ShapeDtypeStruct((B, WIDTH), jnp.int32), jax.ShapeDtypeStruct((B + 1,), jnp.int32),
        jax.ShapeDtypeStruct((B,), jnp.int32), layer)
    assert "paged_prefill_attention" in text


@pytest.mark.parametrize("exact", [True, False])
def test_lowering_rejects_too_small_dot(exact):
    """page 8 with one page per block would give tl.dot an N of 8: refused up front."""
    with pytest.raises(ValueError, match=">= 16"):
        lower_for_cuda(
            lambda q, k, v, t, n: paged_decode_attention(q, k, v, t, n, backend="pallas",
                                                         pages_per_block=1, exact=exact),
            jax.ShapeDtypeStruct((B, HQ, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((64, HKV, 8, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((64, HKV, 8, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, 8), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("k,n,rows_out", [(576, 1536, False), (576, 49152, True),
                                          (40, 24, False)])
def test_the_tiled_matmul_lowers_to_one_triton_kernel(dtype, k, n, rows_out):
    """models.dense on a GPU under JAXRL_CACHE_KERNELS=pallas (SmolLM2's projection and
    tied head, and a shape that needs padding); forward and the XLA backward."""
    w_shape = (n, k) if rows_out else (k, n)

    def loss(x, w):
        return tiled_matmul(x, w, w_rows_out=rows_out).sum()

    text = lower_for_cuda(jax.value_and_grad(loss, (0, 1)), jax.ShapeDtypeStruct((100, k), dtype),
                          jax.ShapeDtypeStruct(w_shape, dtype))
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "tiled_matmul" in text


@pytest.mark.parametrize("shape", [(64, 49152), (3, 40, 700)])
def test_the_log_sum_exp_kernels_lower_to_triton(shape):
    """distribution.log_normaliser on a GPU under JAXRL_CACHE_KERNELS=pallas (SmolLM2's
    vocabulary; a leading shape and a vocabulary that need padding), with its backward."""
    text = lower_for_cuda(jax.value_and_grad(lambda x: log_sum_exp(x).sum()),
                          jax.ShapeDtypeStruct(shape, jnp.float32))
    assert text.count("__gpu$xla.gpu.triton") == 2  # the chunks' max, then their sums
    assert re.findall(r'name = "(log_sum_exp\w*)"', text) == ["log_sum_exp_max", "log_sum_exp"]


def test_the_trainers_gathered_attention_lowers_to_the_prefill_kernel():
    hkv, group, d, nq, km = 2, 3, 64, 8, 4
    q = jax.ShapeDtypeStruct((2, hkv, nq, 16 * group, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, hkv, nq * 16, d), jnp.bfloat16)
    blocks = jax.ShapeDtypeStruct((2, hkv, nq, km), jnp.int32)
    visible = jax.ShapeDtypeStruct((2, 1, nq, 16 * group, km * 16), jnp.bool_)
    items = jax.ShapeDtypeStruct((2, 1, nq), jnp.int32)
    text = lower_for_cuda(
        lambda q, k, v, b, m, i: gathered_prefill_attention(q, k, v, b, m, i, 0.125, "pallas"),
        q, kv, kv, blocks, visible, items)
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "paged_prefill_attention" in text


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_exact_decode_runs_the_exact_prefill_program(head_dim):
    """Compiled exact=True: decode takes prefill's warps (and its 64-row dots and keys per
    block, `_flash.exact_program`), so a decoded token's attention is computed by the same
    instructions as the trainer's prefill-kernel forward."""
    def warps(text):
        return set(re.findall(r"num_warps = (\d+) : i32", text))

    q = jax.ShapeDtypeStruct((8, HQ, head_dim), jnp.bfloat16)
    pool_d = jax.ShapeDtypeStruct((PAGES, HKV, PAGE, head_dim), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((8, WIDTH), jnp.int32)
    lens = jax.ShapeDtypeStruct((8,), jnp.int32)
    decode = lower_for_cuda(lambda *a: paged_decode_attention(*a, backend="pallas"),
                            q, pool_d, pool_d, table, lens)
    prefill = lower_for_cuda(
        lambda q, k, v, t, cu, n: paged_prefill_attention(q, k, v, t, cu, n, backend="pallas"),
        jax.ShapeDtypeStruct((512, HQ, head_dim), jnp.bfloat16), pool_d, pool_d, table,
        jax.ShapeDtypeStruct((9,), jnp.int32), lens)
    assert warps(decode) == warps(prefill) == {str(exact_program(head_dim)[0])}
