"""The sampler draws from the distribution it records: empirical frequencies of many draws
against exact probabilities (numpy softmax of the warped logits), excluded tokens never
drawn, and the recorded log-prob equal to the behavior log-softmax of the drawn token."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_cache.distribution import behavior_log_probs
from jaxrl_cache.rollout.sampling import DRAW_BLOCK, sample_tokens

VOCAB = 2 * DRAW_BLOCK + 44  # three blocks, the last one padded
DRAWS = 20_000


def _draws(logits_row, temperature, top_p, top_k, seed=0):
    """DRAWS samples of one logits row, each with its own key -> (tokens [N], logp [N])."""
    logits = jnp.broadcast_to(jnp.asarray(logits_row, jnp.float32), (DRAWS, VOCAB))
    keys = jax.random.split(jax.random.key(seed), DRAWS)
    fn = jax.jit(sample_tokens)
    tok, logp = fn(logits, keys, jnp.float32(temperature), jnp.float32(top_p),
                   jnp.int32(top_k))
    return np.asarray(tok), np.asarray(logp)


def _exact(logits_row, temperature, top_p, top_k):
    """numpy probabilities of the warped distribution, independent of the sampler's code."""
    z = np.asarray(logits_row, np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(VOCAB, bool)
    k = top_k if top_k > 0 else VOCAB
    top = order[:k]
    p = np.exp(z[top] - z[top].max())
    p /= p.sum()
    before = np.cumsum(p) - p
    keep[top[before < top_p]] = True
    probs = np.where(keep, np.exp(z - z.max()), 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize("temperature,top_p,top_k", [
    (1.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 1.0, 7), (1.0, 0.8, 0), (0.9, 0.9, 20)])
def test_frequencies_match_the_warped_distribution(temperature, top_p, top_k):
    rng = np.random.default_rng(3)
    row = rng.normal(size=VOCAB) * 2.0
    row[[5, DRAW_BLOCK + 1, VOCAB - 1]] += 4.0  # mass in every block, the padded one too
    tok, logp = _draws(row, temperature, top_p, top_k)
    probs = _exact(row, temperature, top_p, top_k)
    freq = np.bincount(tok, minlength=VOCAB) / DRAWS
    assert np.all(freq[probs == 0] == 0), "a token outside top-k / top-p was drawn"
    sigma = np.sqrt(probs * (1 - probs) / DRAWS)
    assert np.all(np.abs(freq - probs) <= 5 * sigma + 1e-4)
    ref = np.asarray(behavior_log_probs(jnp.asarray(row, jnp.float32)[None],
                                        jnp.float32(temperature), jnp.float32(top_p),
                                        jnp.int32(top_k)))[0]
    np.testing.assert_allclose(logp, ref[tok], atol=1e-5)
    np.testing.assert_allclose(np.exp(ref), probs, atol=1e-5)


@pytest.mark.parametrize("only", [0, DRAW_BLOCK - 1, DRAW_BLOCK, VOCAB - 1])
def test_a_single_allowed_token_is_always_drawn(only):
    """Every other token at -inf (as top-k 1 leaves it): rounding never lands beside it."""
    row = np.full(VOCAB, -np.inf, np.float32)
    row[only] = 0.0
    tok, logp = _draws(row, 1.0, 1.0, 0)
    assert np.all(tok == only)
    np.testing.assert_allclose(logp, 0.0, atol=1e-6)


def test_greedy_takes_the_argmax_and_records_the_plain_log_softmax():
    row = np.random.default_rng(0).normal(size=VOCAB).astype(np.float32)
    tok, logp = _draws(row, 0.0, 1.0, 0)
    assert np.all(tok == np.argmax(row))
    ref = row - np.log(np.exp(row - row.max()).sum()) - row.max()
    np.testing.assert_allclose(logp, ref[np.argmax(row)], atol=1e-5)


def test_a_draw_depends_only_on_its_key():
    """Row i of a batch draws what it draws alone with the same key (batch independence)."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(6, VOCAB)), jnp.float32)
    keys = jax.random.split(jax.random.key(9), 6)
    knobs = (jnp.float32(1.0), jnp.float32(1.0), jnp.int32(0))
    tok, _ = sample_tokens(logits, keys, *knobs)
    for i in range(6):
        alone, _ = sample_tokens(logits[i:i + 1], keys[i:i + 1], *knobs)
        assert int(alone[0]) == int(tok[i])
