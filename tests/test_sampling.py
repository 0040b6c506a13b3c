"""The sampler draws from the distribution it records: empirical frequencies of many draws
against exact probabilities (numpy softmax of the warped logits: repetition penalty,
temperature, top-k, top-p, min-p, in transformers' order), excluded tokens never drawn, and
the recorded log-prob equal to the behavior log-softmax of the drawn token."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_cache.distribution import behavior_log_probs
from jaxrl_cache.rollout.sampling import DRAW_BLOCK, sample_tokens

VOCAB = 2 * DRAW_BLOCK + 44  # three blocks, the last one padded
DRAWS = 20_000


def _draws(logits_row, temperature, top_p, top_k, seed=0, min_p=0.0, penalty=1.0,
           presence=None):
    """DRAWS samples of one logits row, each with its own key -> (tokens [N], logp [N])."""
    logits = jnp.broadcast_to(jnp.asarray(logits_row, jnp.float32), (DRAWS, VOCAB))
    keys = jax.random.split(jax.random.key(seed), DRAWS)
    fn = jax.jit(sample_tokens)
    seen = None if presence is None else jnp.broadcast_to(jnp.asarray(presence), (DRAWS, VOCAB))
    tok, logp = fn(logits, keys, jnp.float32(temperature), jnp.float32(top_p),
                   jnp.int32(top_k), jnp.float32(min_p), jnp.float32(penalty), seen)
    return np.asarray(tok), np.asarray(logp)


def _penalised(logits_row, presence, penalty):
    """transformers' RepetitionPenaltyLogitsProcessor on one row (numpy)."""
    z = np.asarray(logits_row, np.float64)
    return np.where(presence, np.where(z < 0, z * penalty, z / penalty), z)


def _exact(logits_row, temperature, top_p, top_k, min_p=0.0):
    """numpy probabilities of the warped distribution, independent of the sampler's code:
    top-k, top-p over the renormalised top-k, then transformers' MinPLogitsWarper (drop
    the tokens whose probability is below min_p x the largest)."""
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
    probs /= probs.sum()
    probs = np.where(probs < min_p * probs.max(), 0.0, probs)
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


@pytest.mark.parametrize("temperature,top_p,top_k,min_p,penalty", [
    (1.0, 1.0, 0, 0.05, 1.0), (0.8, 0.9, 20, 0.2, 1.0), (1.0, 1.0, 0, 0.0, 1.6),
    (0.7, 0.95, 0, 0.02, 0.7)])
def test_min_p_and_repetition_penalty_match_numpy(temperature, top_p, top_k, min_p, penalty):
    """The penalty (before temperature, on the context's tokens, both signs of logit) and
    min-p (after top-k / top-p) against numpy references of transformers' processors."""
    rng = np.random.default_rng(4)
    row = rng.normal(size=VOCAB) * 2.0
    row[[5, DRAW_BLOCK + 1, VOCAB - 1]] += 4.0
    row[7] = -3.0  # a present token with a negative logit
    presence = np.zeros(VOCAB, bool)
    presence[[5, 7, 40, DRAW_BLOCK + 1, 2 * DRAW_BLOCK]] = True
    tok, logp = _draws(row, temperature, top_p, top_k, min_p=min_p, penalty=penalty,
                       presence=presence)
    probs = _exact(_penalised(row, presence, penalty), temperature, top_p, top_k, min_p)
    if min_p > 0:
        assert (probs == 0).sum() > (_exact(_penalised(row, presence, penalty), temperature,
                                            top_p, top_k) == 0).sum()  # min-p cut some
    freq = np.bincount(tok, minlength=VOCAB) / DRAWS
    assert np.all(freq[probs == 0] == 0), "a token outside the min-p set was drawn"
    sigma = np.sqrt(probs * (1 - probs) / DRAWS)
    assert np.all(np.abs(freq - probs) <= 5 * sigma + 1e-4)
    ref = np.asarray(behavior_log_probs(
        jnp.asarray(row, jnp.float32)[None], jnp.float32(temperature), jnp.float32(top_p),
        jnp.int32(top_k), jnp.float32(min_p), jnp.float32(penalty),
        jnp.asarray(presence)[None]))[0]
    np.testing.assert_allclose(np.exp(ref), probs, atol=1e-5)
    assert np.all(logp == ref[tok])


def test_penalty_one_and_min_p_zero_change_no_bit():
    """The defaults are the plain distribution, bit for bit, and greedy decoding takes the
    argmax of the penalised logits."""
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.normal(size=(4, VOCAB)) * 3, jnp.float32)
    presence = jnp.asarray(rng.random((4, VOCAB)) < 0.3)
    knobs = (jnp.float32(0.7), jnp.float32(0.9), jnp.int32(0))
    plain = behavior_log_probs(logits, *knobs)
    same = behavior_log_probs(logits, *knobs, jnp.float32(0.0), jnp.float32(1.0), presence)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(same))
    keys = jax.random.split(jax.random.key(0), 4)
    greedy = (jnp.float32(0.0), jnp.float32(1.0), jnp.int32(0), jnp.float32(0.0))
    tok, _ = sample_tokens(logits, keys, *greedy, jnp.float32(2.0), presence)
    want = np.argmax(_penalised(np.asarray(logits), np.asarray(presence), 2.0), axis=-1)
    np.testing.assert_array_equal(np.asarray(tok), want)


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
