"""make_optimizer's global-norm clip (one scalar factor) against optax's own clip, and the
whole direction against the optax chain it stands for."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_cache.rl.train import clip_by_global_norm, make_optimizer


def _tree(seed: int, scale: float):
    rng = np.random.default_rng(seed)
    return {"a": jnp.asarray(rng.standard_normal((3, 5)) * scale, jnp.float32),
            "b": [jnp.asarray(rng.standard_normal(7) * scale, jnp.float32)]}


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([0.0, 1e-3, 0.3, 1.0, 30.0]),
       max_norm=st.sampled_from([1e-2, 0.5, 1.0, 4.0]))
def test_clip_matches_optax(seed, scale, max_norm):
    grads = _tree(seed, scale)
    ours, _ = clip_by_global_norm(max_norm).update(grads, optax.EmptyState())
    want, _ = optax.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)
    assert float(optax.tree.norm(ours)) <= max_norm * (1 + 1e-6)


def test_direction_matches_the_optax_chain_over_updates():
    tx = make_optimizer(weight_decay=0.1, max_grad_norm=1.0, b1=0.9, b2=0.99)
    ref = optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b1=0.9, b2=0.99),
                      optax.add_decayed_weights(0.1))
    params = _tree(0, 1.0)
    s, r = tx.init(params), ref.init(params)
    for step in range(4):
        grads = _tree(step + 1, [0.1, 5.0, 0.5, 20.0][step])  # under and over the clip
        d, s = tx.update(grads, s, params)
        e, r = ref.update(grads, r, params)
        for a, b in zip(jax.tree.leaves(d), jax.tree.leaves(e)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert make_optimizer(weight_decay=0.1, b2=0.99) is tx  # memoised
