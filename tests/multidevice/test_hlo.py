"""No accidental communication: the collectives XLA compiles into the sharded decode loop
are the expected ones (the train step's are checked in test_sharded_training)."""
import jax
import jax.numpy as jnp

from jaxrl_cache.models import copy_pages, decode_forward
from jaxrl_cache.parallel import engine_kv_cache, make_mesh, rollout_shardings, shard_forward
from tests.multidevice import common

CONFIG = common.CONFIG


def test_decode_loop_only_gathers_activations():
    """A decode loop as the engine runs it (page copies, then steps of forward + greedy pick):
    per layer per step, wo and w_down each all-gather their input (heads' outputs
    [B, Hq * D], the FFN hidden [B, d_ff]) and their output columns ([B, d_model]), nothing
    else: no partial sums reduced, no gather of the KV pool, params or logits."""
    mesh = make_mesh({"tensor": 8})
    params = common.params()
    params = jax.device_put(params, rollout_shardings(params, CONFIG, mesh))
    kv = engine_kv_cache(CONFIG, common.NUM_PAGES, common.PAGE_SIZE, mesh)
    decode = shard_forward(decode_forward, mesh)

    def loop(params, kv, tokens, positions, page_table, src, dst):
        kv = copy_pages(kv, src, dst)

        def step(_, carry):
            kv, tokens, positions = carry
            logits, kv = decode(params, CONFIG, kv, tokens, positions, page_table,
                                backend="xla")
            return kv, jnp.argmax(logits, -1).astype(jnp.int32), positions + 1
        return jax.lax.fori_loop(0, 4, step, (kv, tokens, positions))

    b = 2
    args = (params, kv, jnp.zeros(b, jnp.int32), jnp.zeros(b, jnp.int32),
            jnp.ones((b, 3), jnp.int32), jnp.array([1], jnp.int32), jnp.array([2], jnp.int32))
    text = jax.jit(loop, donate_argnums=1).lower(*args).compile().as_text()
    found = common.collectives(text)
    assert found, "expected the activation all-gathers"
    # the layer scan's body is compiled once (inside the decode loop): its 4 all-gathers
    heads, d, ffn = CONFIG.n_heads * CONFIG.head_dim, CONFIG.d_model, CONFIG.d_ff
    assert found == [("all-gather", (f"f32[{b},{n}]",)) for n in (heads, d, ffn, d)], found

