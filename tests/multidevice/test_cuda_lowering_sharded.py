"""The sharded decode step lowers for CUDA with the Pallas kernels called per shard (each
shard's local heads, kv heads split and copied; under JAXRL_CACHE_KERNELS each shard's
projections on the tiled matmul), on a CPU host."""
import jax
import jax.numpy as jnp
import pytest

from jaxrl_cache.models import ModelConfig, decode_forward, init_params
from jaxrl_cache.parallel import engine_kv_cache, make_mesh, rollout_shardings, shard_forward
from kernels_pallas import KERNELS_ENV

CONFIG = ModelConfig(vocab_size=512, d_model=256, n_layers=1, n_heads=32, n_kv_heads=4,
                     head_dim=128, d_ff=512, max_seq_len=4096, dtype="bfloat16")


@pytest.mark.parametrize("tensor,kernels", [(2, "xla"), (8, "xla"), (8, "pallas")])
def test_sharded_decode_lowers_to_triton(tensor, kernels, monkeypatch):
    # tensor 2: 2 kv heads per shard; 8: each kv head on 2 shards
    monkeypatch.setenv(KERNELS_ENV, kernels)
    mesh = make_mesh({"tensor": tensor}, jax.devices()[:tensor])
    shapes = jax.eval_shape(lambda: init_params(CONFIG, jax.random.key(0)))
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          shapes, rollout_shardings(shapes, CONFIG, mesh))
    kv = jax.eval_shape(lambda: engine_kv_cache(CONFIG, 256, 16, mesh))
    kv = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding), kv)
    b = 16
    step = jax.jit(lambda p, kv, t, pos, table: shard_forward(decode_forward, mesh)(
        p, CONFIG, kv, t, pos, table, backend="pallas"))
    text = step.trace(params, kv, jax.ShapeDtypeStruct((b,), jnp.int32),
                      jax.ShapeDtypeStruct((b,), jnp.int32),
                      jax.ShapeDtypeStruct((b, 64), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "paged_decode_attention" in text
    assert ("tiled_matmul" in text) == (kernels == "pallas")
