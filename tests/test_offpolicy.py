"""Asynchronous samples on the training side: per-token versions in batches, the decoupled
PPO correction (against plain PPO on fresh samples, and on a stale-sample bandit where it
matters) and the per-token attribution audit of samples sampled under two param sets."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_cache.errors import StalenessError
from jaxrl_cache.models.llama import ModelConfig, forward, init_params
from jaxrl_cache.rl.audit import audit_attribution
from jaxrl_cache.rl.batch import make_batch
from jaxrl_cache.rl.train import TrainState, train_step
from jaxrl_cache.distribution import behavior_log_probs
from jaxrl_cache.rollout.sampling import SamplingParams
from jaxrl_cache.rollout.types import RolloutBatch, Sample
from tests.helpers import CONFIG, teacher_forced_log_probs, varied_params

SP = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, top_k=16)
PROMPTS = [[3, 1, 4, 1], [5, 9, 2, 6], [5, 3, 5, 8], [9, 7, 9, 3]]
_forward = jax.jit(forward, static_argnums=1)
_teacher_forced = jax.jit(teacher_forced_log_probs, static_argnums=1)


def rollout(samples, sp=SP):
    return RolloutBatch(samples=samples, version=max(s.behavior_version for s in samples),
                        sampling=sp, prefill_tokens=0, reused_tokens=0, cached_tokens=0,
                        decode_steps=0, decode_chunks=0, prefill_launches=0, seconds=0.0)


def dense_samples(schedule, prompts=PROMPTS, sp=SP, seed=0, config=CONFIG):
    """Samples drawn with the dense model, output token t by the params of schedule[t] =
    (version, params), logprobs from the sampler's own `behavior_log_probs` (an asynchronous
    rollout under kv_policy="recompute": every token sees KV of its own version only)."""
    width = len(prompts[0]) + len(schedule)
    seq = np.zeros((len(prompts), width), np.int32)
    seq[:, :len(prompts[0])] = prompts
    logps = np.zeros((len(prompts), len(schedule)), np.float32)
    key = jax.random.key(seed)
    for t, (_, params) in enumerate(schedule):
        pos = len(prompts[0]) + t
        logits = _forward(params, config, jnp.asarray(seq))[:, pos - 1]
        logp = behavior_log_probs(logits, **sp.as_arrays())
        tok = np.asarray(jax.random.categorical(jax.random.fold_in(key, t), logp))
        seq[:, pos] = tok
        logps[:, t] = np.asarray(logp)[np.arange(len(prompts)), tok]
    versions = np.array([v for v, _ in schedule], np.int64)
    return [Sample(prompt_ids=tuple(p), output_ids=tuple(int(x) for x in seq[i, len(p):]),
                   output_logprobs=logps[i], behavior_version=int(versions[0]),
                   token_versions=versions, cached_tokens=0, finish_reason="length",
                   group=i // sp.n, kv_versions=tuple(sorted(set(versions.tolist()))))
            for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def two_versions():
    """Tokens 0..2 sampled with params A (version 0), tokens 3..5 with params B (version 1)."""
    a, b = varied_params(0), varied_params(1)
    return {0: a, 1: b}, dense_samples([(0, a)] * 3 + [(1, b)] * 3)


# ------------------------------------------------------------------ audit per token


class TestAuditPerToken:
    def test_two_param_sets_pass(self, two_versions):
        params, samples = two_versions
        report = audit_attribution(rollout(samples), params, CONFIG)
        assert report.ok and report.flagged == () and report.first_bad_token == ()
        assert report.num_tokens == report.num_checked_tokens == 24
        assert report.num_mixed_tokens == 0 and report.max_abs_diff == 0.0

    def test_sample_level_claim_fails_at_the_first_token_of_the_second_version(
            self, two_versions):
        params, samples = two_versions
        claimed = [dataclasses.replace(s, token_versions=np.zeros(6, np.int64)) for s in samples]
        report = audit_attribution(rollout(claimed), params, CONFIG)
        assert report.flagged == (0, 1, 2, 3)
        assert report.first_bad_token == tuple((i, 3) for i in range(4))

    def test_one_mislabeled_token_is_flagged(self, two_versions):
        params, samples = two_versions
        versions = samples[1].token_versions.copy()
        versions[4] = 0  # sampled by version 1, claimed by version 0
        bad = samples[:1] + [dataclasses.replace(samples[1], token_versions=versions)] + \
            samples[2:]
        report = audit_attribution(rollout(bad), params, CONFIG)
        assert not report.ok and report.flagged == (1,)
        assert report.first_bad_token == ((1, 4),) and report.num_checked_tokens == 24
        assert report.max_abs_diff > 1e-2

    def test_mixed_tokens_are_counted_not_checked(self, two_versions):
        params, samples = two_versions
        mixed = np.zeros(6, bool)
        mixed[[3, 5]] = True  # kv_policy="keep": these attended version-0 KV
        logps = samples[2].output_logprobs.copy()
        logps[[3, 5]] -= 1.0  # what a mixed history would record: not comparable
        s2 = dataclasses.replace(samples[2], mixed_tokens=mixed, output_logprobs=logps)
        report = audit_attribution(rollout(samples[:2] + [s2] + samples[3:]), params, CONFIG)
        assert report.ok and report.num_mixed_tokens == 2 and report.num_checked_tokens == 22
        assert report.mixed_tokens == ((2, (3, 5)),) and report.num_tokens == 24
        logps[4] -= 1.0  # a non-mixed token of the same sample is still checked
        s2 = dataclasses.replace(s2, output_logprobs=logps)
        report = audit_attribution(rollout(samples[:2] + [s2] + samples[3:]), params, CONFIG)
        assert report.flagged == (2,) and report.first_bad_token == ((2, 4),)

    def test_missing_version_reported(self, two_versions):
        params, samples = two_versions
        report = audit_attribution(rollout(samples), {0: params[0]}, CONFIG)
        assert not report.ok and report.missing_versions == (1,)
        assert report.flagged == (0, 1, 2, 3) and report.num_checked_tokens == 12
        assert report.first_bad_token == tuple((i, 3) for i in range(4))

    def test_malformed_mixed_tokens_refused(self, two_versions):
        params, samples = two_versions
        bad = dataclasses.replace(samples[0], mixed_tokens=np.zeros(5, bool))
        with pytest.raises(ValueError, match=r"sample 0: mixed_tokens must be None or bool \[6\]"):
            audit_attribution(rollout([bad]), params, CONFIG)


# ------------------------------------------------------------------ per-token versions

SGD = optax.identity()  # train steps here apply lr * gradient: exact comparisons, one compile


def test_batch_carries_token_versions_and_staleness_is_per_token(two_versions):
    """Trainer at version 3; sample 0 sampled by versions 0, 1, 1, sample 1 by 2, 2, 2."""
    params = varied_params(0)
    state = TrainState.create(params, SGD, config=CONFIG, lr_schedule=1e-3, version=3)
    samples = [dataclasses.replace(s, token_versions=np.array(v), behavior_version=v[0])
               for s, v in zip(two_versions[1], ([0, 1, 1, 1, 1, 1], [2] * 6, [2] * 6,
                                                  [3] * 6))]
    plain = SamplingParams(n=2)  # no top-k: every token has a finite logprob under params
    batch = make_batch(rollout(samples, plain), [1.0, 0.0, 0.0, 1.0])
    assert batch.behavior_version.tolist() == [0, 2, 2, 3]  # each sample's oldest version
    assert [v.tolist() for v in batch.token_versions[:2]] == [[0, 1, 1, 1, 1, 1], [2] * 6]
    # behavior logprobs: exact for all tokens but one, recorded 5 nats too low (weight e^5)
    behavior = []
    for seq, p in zip(batch.sequences, batch.prompt_lengths):
        exact = np.asarray(_teacher_forced(params, CONFIG, jnp.asarray(seq[None]),
                                           **plain.as_arrays()))[0, p - 1:]
        behavior.append(exact.copy())
    behavior[1][2] -= 5.0
    batch = dataclasses.replace(batch, behavior_logprobs=tuple(behavior))
    _, m = train_step(state, batch, correction="decoupled", is_cap=2.0)
    assert int(m["staleness_max"]) == 3 and int(m["tokens"]) == 24
    np.testing.assert_allclose(float(m["staleness_mean"]), (3 + 2 * 5 + 1 * 12) / 24)
    np.testing.assert_allclose(float(m["is_weight_max"]), np.exp(5.0), rtol=1e-3)
    np.testing.assert_allclose(float(m["is_weight_mean"]), (23 + np.exp(5.0)) / 24, rtol=1e-3)
    np.testing.assert_allclose(float(m["is_truncated_fraction"]), 1 / 24)
    assert float(m["ratio_mean"]) == 1.0 and float(m["clip_fraction"]) == 0.0
    with pytest.raises(StalenessError, match="sample 0 has a token of version 0, 3 updates"):
        train_step(state, batch, max_policy_lag=2)
    newer = samples[:3] + [dataclasses.replace(samples[3], token_versions=np.array(
        [3, 3, 3, 4, 4, 4]))]
    batch = make_batch(rollout(newer, plain), [1.0, 0.0, 0.0, 1.0])
    with pytest.raises(StalenessError, match="token of version 4, newer than the trainer"):
        train_step(state, batch, correction="decoupled")
    assert int(state.version) == 3


# ------------------------------------------------------------------ the toy problem

BANDIT = ModelConfig.tiny(vocab_size=32, n_layers=1, d_model=32, n_heads=2, n_kv_heads=1,
                          head_dim=16, d_ff=64, max_seq_len=8)
ARMS = np.array([1, 2, 3, 4])  # one-token prompts; the answer is one token
GOOD = (np.arange(BANDIT.vocab_size) % 8 == 5).astype(np.float32)  # reward 1 on 4 of 32
BANDIT_SP = SamplingParams(n=16, max_new_tokens=1)


@jax.jit
def _arm_log_probs(params):
    """[4, V] log-probs of the answer token for each prompt (temperature 1)."""
    return jax.nn.log_softmax(forward(params, BANDIT, jnp.asarray(ARMS)[:, None])[:, 0], -1)


def expected_reward(params) -> float:
    return float((jnp.exp(_arm_log_probs(params)) @ GOOD).mean())


def bandit_batch(behavior_params, behavior: int, rng):
    """16 answers per prompt drawn by `behavior_params` (version `behavior`), GRPO batch."""
    logp = np.asarray(_arm_log_probs(behavior_params), np.float64)
    probs = np.exp(logp) / np.exp(logp).sum(axis=1, keepdims=True)
    samples = [Sample((int(arm),), (int(tok),), np.float32([logp[g, tok]]), behavior,
                      np.array([behavior]), 0, "length", g)
               for g, arm in enumerate(ARMS)
               for tok in rng.choice(BANDIT.vocab_size, BANDIT_SP.n, p=probs[g])]
    return make_batch(rollout(samples, BANDIT_SP), [GOOD[s.output_ids[0]] for s in samples])


def stale_bandit(correction: str, *, stale: int, steps: int, seed: int):
    """GRPO (SGD, lr 3) on a contextual bandit where every batch is drawn by the policy
    `stale` updates behind the trainer (version max(0, v - stale)). Returns (expected reward
    after each update, metrics of each step)."""
    params = init_params(BANDIT, jax.random.key(seed))
    state = TrainState.create(params, SGD, config=BANDIT, lr_schedule=3.0)
    history, rng, curve, metrics = [params], np.random.default_rng(seed), [], []
    for v in range(steps):
        behavior = max(0, v - stale)
        batch = bandit_batch(history[behavior], behavior, rng)
        state, m = train_step(state, batch, correction=correction, is_cap=2.0)
        history.append(state.params)
        curve.append(expected_reward(state.params))
        metrics.append(jax.device_get(m))
    return np.array(curve), metrics


def test_decoupled_equals_plain_on_fresh_samples():
    """behavior == proximal (samples of the trainer's own params): the same loss and the
    same update."""
    params = init_params(BANDIT, jax.random.key(0))
    batch = bandit_batch(params, 0, np.random.default_rng(0))
    out = {}
    for correction in ("none", "decoupled"):
        state = TrainState.create(params, SGD, config=BANDIT, lr_schedule=3.0)
        out[correction] = train_step(state, batch, correction=correction, is_cap=2.0)
    (plain, mp), (dec, md) = out["none"], out["decoupled"]
    np.testing.assert_allclose(float(md["loss"]), float(mp["loss"]), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(md["is_weight_mean"]), 1.0, atol=1e-5)
    np.testing.assert_allclose(float(mp["ratio_mean"]), 1.0, atol=1e-5)
    assert float(md["is_truncated_fraction"]) == 0.0 == float(mp["clip_fraction"])
    assert expected_reward(plain.params) != expected_reward(params)  # the step moved
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(dec.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_correction_matters_on_stale_samples(seed):
    """Samples 8 versions stale: plain PPO clips against the stale behavior policy (almost
    every token clipped once the policy moved), the decoupled correction clips against the
    proximal policy and reweights by min(proximal/behavior, 2). Measured (seeds 0, 1, 2):
    expected reward after 12 updates 1.000/1.000/1.000 corrected vs 0.693/0.997/0.750 plain;
    mean over the 12 updates 0.827/0.802/0.792 vs 0.524/0.505/0.548 (from 0.12)."""
    plain, m_plain = stale_bandit("none", stale=8, steps=12, seed=seed)
    fixed, m_fixed = stale_bandit("decoupled", stale=8, steps=12, seed=seed)
    np.testing.assert_allclose(fixed[0], plain[0], atol=1e-6)  # step 0: fresh samples
    assert fixed[-1] > 0.99 and fixed.mean() - plain.mean() > 0.15
    assert [int(m["staleness_max"]) for m in m_fixed] == [min(v, 8) for v in range(12)]
    assert max(float(m["clip_fraction"]) for m in m_plain[8:]) > 0.5
    assert max(float(m["is_truncated_fraction"]) for m in m_fixed) > 0.01
    assert all(float(m["clip_fraction"]) == 0.0 for m in m_fixed)
