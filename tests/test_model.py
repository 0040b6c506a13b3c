"""The paged forward (prefill + decode through kernels_pallas) equals the dense forward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_cache.models import RopeScaling
from jaxrl_cache.models.llama import (ModelConfig, copy_pages, decode_forward, forward,
                                      init_kv_cache, init_params, prefill_forward)
from tests.helpers import CONFIG, scale_matrices, varied_params

PS = 8


def paged_logits(params, config, seq, cached, backend):
    """Prefill seq[cached:] on top of a cache holding seq[:cached] (itself prefilled), then
    decode nothing: returns logits at every position >= cached via one-token decode steps."""
    kv = init_kv_cache(config, 16, PS)
    table = jnp.asarray([np.arange(1, 9)], jnp.int32)  # one sequence, pages 1..8

    def prefill(kv, lo, hi):
        n = hi - lo
        toks = jnp.asarray(seq[lo:hi], jnp.int32)
        return prefill_forward(params, config, kv, toks, jnp.zeros(n, jnp.int32),
                               jnp.arange(lo, hi, dtype=jnp.int32), table,
                               jnp.asarray([0, n], jnp.int32), jnp.asarray([hi], jnp.int32),
                               jnp.asarray([n - 1], jnp.int32), backend=backend)

    if cached:
        _, kv = prefill(kv, 0, cached)
    split = (cached + len(seq)) // 2
    logits, kv = prefill(kv, cached, split)  # last-token logits of the prefill part
    out = [logits[0]]
    for pos in range(split, len(seq)):
        lg, kv = decode_forward(params, config, kv, jnp.asarray([seq[pos]], jnp.int32),
                                jnp.asarray([pos], jnp.int32), table, backend=backend)
        out.append(lg[0])
    return jnp.stack(out), split


@pytest.mark.parametrize("cached,backend", [
    (0, "xla"), (8, "xla"), (0, "interpret"),
    pytest.param(8, "interpret", marks=pytest.mark.slow)])  # the kernels: test_kernels.py
def test_paged_matches_dense(cached, backend):
    params = varied_params(0)
    seq = list(np.random.default_rng(0).integers(0, CONFIG.vocab_size, 27))
    dense = forward(params, CONFIG, jnp.asarray([seq], jnp.int32))[0]
    paged, split = paged_logits(params, CONFIG, seq, cached, backend)
    np.testing.assert_allclose(np.asarray(paged), np.asarray(dense[split - 1:]),
                               atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("overrides", [
    dict(qkv_bias=False, tie_embeddings=False, n_kv_heads=1),
    dict(qk_norm=True, out_bias=True, head_dim=8),  # Qwen3-like, head_dim decoupled
    dict(rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16), rope_theta=500000.0),
    dict(rope_scaling=RopeScaling("linear", 4.0)),
], ids=["untied-nobias-mqa", "qknorm-outbias-hd8", "llama3-rope", "linear-rope"])
def test_variants_paged_match_dense(overrides):
    config = ModelConfig.tiny(vocab_size=40, **overrides)
    params = scale_matrices(init_params(config, jax.random.key(3)), 12.0)
    seq = list(range(3, 23))
    dense = forward(params, config, jnp.asarray([seq], jnp.int32))[0]
    paged, split = paged_logits(params, config, seq, 0, "xla")
    np.testing.assert_allclose(np.asarray(paged), np.asarray(dense[split - 1:]),
                               atol=2e-4, rtol=2e-4)


def test_copy_pages_copies_every_layer_and_nothing_else():
    k, v = init_kv_cache(CONFIG, 6, PS)
    k = jax.random.normal(jax.random.key(0), k.shape)
    v = jax.random.normal(jax.random.key(1), v.shape)
    k2, v2 = copy_pages((k, v), jnp.asarray([2, 0], jnp.int32), jnp.asarray([5, 0], jnp.int32))
    want_k = np.asarray(k).copy()
    want_k[:, 5] = want_k[:, 2]
    np.testing.assert_array_equal(np.asarray(k2), want_k)
    np.testing.assert_array_equal(np.asarray(v2[:, 5]), np.asarray(v[:, 2]))


def test_forward_refuses_sequences_past_max_seq_len():
    params = init_params(CONFIG, jax.random.key(0))
    with pytest.raises(ValueError, match="max_seq_len"):
        forward(params, CONFIG, jnp.zeros((1, CONFIG.max_seq_len + 1), jnp.int32))


def test_config_validation():
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        ModelConfig.tiny(n_heads=3, n_kv_heads=2)


def test_nnx_module_and_functional_params_agree():
    from flax import nnx

    from jaxrl_cache.models.llama import DecoderLM
    model = DecoderLM(CONFIG, rngs=nnx.Rngs(params=jax.random.key(7)))
    params = init_params(CONFIG, jax.random.key(7))
    for a, b in zip(jax.tree.leaves(model.params()), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(x.shape[0] == CONFIG.n_layers for x in params["layers"].values())
    tokens = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    np.testing.assert_allclose(np.asarray(model(tokens)),
                               np.asarray(forward(params, CONFIG, tokens)), atol=1e-6)
