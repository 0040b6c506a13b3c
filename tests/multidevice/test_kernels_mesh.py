"""Under JAXRL_CACHE_KERNELS a training mesh runs every Pallas kernel (projections, the
trainer's attention, the log-softmax normaliser) per batch shard (`spmd.per_batch_shard`):
XLA's partitioner cannot split a custom call and would gather the whole batch onto every
device. A token's log-prob keeps its single-device bits on a data 2 x fsdp 4 mesh
(interpret mode), and lowered for CUDA every kernel takes its shard's rows."""
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl_cache.models import ModelConfig, init_params
from jaxrl_cache.parallel import make_mesh
from jaxrl_cache.models.sharding import TRAIN_RULES
from jaxrl_cache.parallel.mesh import tree_shardings
from jaxrl_cache.rl.logprobs import token_log_probs
from kernels_pallas import KERNELS_ENV

CONFIG = ModelConfig.tiny(vocab_size=64, n_layers=1, d_model=64, n_heads=4, n_kv_heads=2,
                          head_dim=16, d_ff=64)
KNOBS = dict(temperature=jnp.float32(1.0), top_p=jnp.float32(1.0), top_k=jnp.int32(0))
ROWS = jnp.asarray(np.random.default_rng(0).integers(1, 64, (8, 32)), jnp.int32)


def log_probs(params, tokens):  # tokens int32 [B, T] -> f32 [B, T]
    return token_log_probs(params, CONFIG, tokens, jnp.roll(tokens, -1, axis=1), KNOBS,
                           kind="none")


def split(mesh):
    return NamedSharding(mesh, P(("data", "fsdp")))


def test_log_probs_on_the_mesh_keep_their_single_device_bits(monkeypatch):
    """The forward's bits are the single device's; the gradient (each kernel's backward
    per shard, the weight gradients summed over shards) agrees to fp32 rounding."""
    monkeypatch.setenv(KERNELS_ENV, "interpret")
    params = init_params(CONFIG, jax.random.key(0))
    grad = jax.jit(jax.grad(lambda p, t: log_probs(p, t).sum()))
    single, single_grad = np.asarray(jax.jit(log_probs)(params, ROWS)), grad(params, ROWS)
    mesh = make_mesh({"data": 2, "fsdp": 4})
    with jax.set_mesh(mesh):  # the params laid out as the train step keeps them (FSDP)
        placed = jax.device_put(params, tree_shardings(params, TRAIN_RULES, mesh))
        assert any(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(placed))
        rows = jax.device_put(ROWS, split(mesh))
        got, got_grad = np.asarray(jax.jit(log_probs)(placed, rows)), grad(placed, rows)
    assert np.array_equal(got, single)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(
        np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5 * np.abs(np.asarray(w)).max()),
        got_grad, single_grad)


def _kernel_operands(text: str) -> list[tuple[int, ...]]:
    """The first operand's shape of every Triton custom call in lowered StableHLO."""
    shapes = []
    for line in text.splitlines():
        if "xla.gpu.triton" in line:
            (first,) = re.findall(r": \(tensor<([0-9x]+)x\w+>", line)[:1]
            shapes.append(tuple(int(d) for d in first.split("x")))
    return shapes


def test_every_kernel_takes_its_shards_rows_when_lowered_for_cuda(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "pallas")
    shapes = jax.eval_shape(lambda: init_params(CONFIG, jax.random.key(0)))
    step = jax.jit(jax.value_and_grad(lambda p, t: log_probs(p, t).sum()))

    def lowered(tokens):
        return step.trace(shapes, tokens).lower(lowering_platforms=("cuda",)).as_text()

    whole = _kernel_operands(lowered(jax.ShapeDtypeStruct(ROWS.shape, jnp.int32)))
    mesh = make_mesh({"data": 2, "fsdp": 4})
    with jax.set_mesh(mesh):
        text = lowered(jax.ShapeDtypeStruct(ROWS.shape, jnp.int32, sharding=split(mesh)))
    sharded = _kernel_operands(text)
    # q/k/v/o/gate/up/down and the LM head, the attention, the normaliser: each takes 1/8
    # of the rows (padded to its row tile: tiled_matmul 64, log_sum_exp 16; attention's
    # leading dim is the batch), none the gathered batch, not even half of it
    def per_shard(w):
        tile = 1 if len(w) > 2 else 16 if w[1] == 512 else 64
        return -(-(w[0] // 8) // tile) * tile

    assert len(sharded) == len(whole) >= 3 and all(w[0] % 8 == 0 for w in whole)
    assert [s[0] for s in sharded] == [per_shard(w) for w in whole], (sharded, whole)
    assert "manual_computation" in text
