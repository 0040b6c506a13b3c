"""Training on multi-turn episodes, against dense references: the loss and gradient cover
only the tokens the policy sampled (every loss_type, any micro-batch budget), observation
tokens are context only (their log-probs and versions change nothing, in the update or the
audit), every turn is audited under its own version, GRPO groups are the episodes of one
task, and grpo_step trains on episode calls with their own returns."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_cache.rl.audit import AuditGate, audit_attribution
from jaxrl_cache.rl.logprobs import next_token_log_probs
from jaxrl_cache.rl.loop import PolicyHistory, grpo_step
from jaxrl_cache.rl.packing import balanced_parts
from jaxrl_cache.rl.batch import make_batch, pack_batch
from jaxrl_cache.rl.train import TrainState, train_step
from jaxrl_cache.rl.train_config import TrainConfig
from jaxrl_cache.rollout.sampling import SamplingParams
from jaxrl_cache.rollout.types import Episode, EpisodeBatch, RolloutBatch, WeightAck
from tests.helpers import CONFIG, teacher_forced_log_probs, varied_params

SP = SamplingParams(n=4, max_new_tokens=8, temperature=0.9)
PARAMS = {v: varied_params(v) for v in range(3)}
# (sampled, observation) tokens of each turn; a trailing observation (after the last turn)
# is context no sampled token sees
SHAPES = [((3, 4), (5, 2), (2, 0)), ((6, 3), (4, 0)), ((2, 5), (7, 3)), ((8, 0),)]


def _logprobs(params, seq):
    """f32 [len(seq) - 1] by the library's chunked teacher-forced log-probs (one padded
    shape: causal, so the padding is invisible)."""
    padded = np.zeros((1, CONFIG.max_seq_len), np.int32)
    padded[0, :len(seq)] = seq
    return np.asarray(next_token_log_probs(params, CONFIG, padded, SP))[0, :len(seq) - 1]


def episode(rng, shape, *, index=0, group=0, versions=None, prompt_len=5):
    """An Episode of random tokens: turn k sampled by versions[k] (default all 0), its
    behavior log-probs exactly that version's (ratio 1), observation tokens 0 / the version
    of the turn before them."""
    versions = versions or [0] * len(shape)
    prompt = tuple(int(t) for t in rng.integers(1, CONFIG.vocab_size, prompt_len))
    tokens, mask, token_versions, turns = [], [], [], []
    for (sampled, observed), v in zip(shape, versions):
        turns.append((len(tokens), len(tokens) + sampled))
        tokens += [int(t) for t in rng.integers(1, CONFIG.vocab_size, sampled + observed)]
        mask += [True] * sampled + [False] * observed
        token_versions += [v] * (sampled + observed)
    mask, token_versions = np.array(mask), np.array(token_versions, np.int64)
    seq, p = prompt + tuple(tokens), len(prompt)
    logp = np.zeros(len(tokens), np.float32)
    for v in set(versions):
        on = mask & (token_versions == v)
        logp[on] = _logprobs(PARAMS[v], seq)[p - 1:][on]
    return Episode(index=index, group=group, prompt_ids=prompt, token_ids=tuple(tokens),
                   loss_mask=mask, logprobs=logp, token_versions=token_versions,
                   turns=tuple(turns), turn_texts=tuple(f"t{k}" for k in range(len(shape))),
                   rewards=tuple(float(r) for r in rng.integers(0, 3, len(shape))),
                   finish_reason="done", cached_tokens=0)


def episode_batch(episodes, version=0, sampling=SP):
    return EpisodeBatch(episodes=list(episodes), version=version, sampling=sampling,
                        prefill_tokens=0, cached_tokens=0, history_tokens=0, history_cached=0,
                        decode_steps=0, decode_chunks=0, prefill_launches=0,
                        env_steps=sum(len(e.rewards) for e in episodes), env_seconds=0.25,
                        seconds=0.0)


def tasks(seed=0, groups=2, per_group=4):
    """`groups` tasks x `per_group` episodes of varied turn structures."""
    rng = np.random.default_rng(seed)
    return episode_batch([episode(rng, SHAPES[(g + k) % len(SHAPES)], index=g * per_group + k,
                                  group=g)
                          for g in range(groups) for k in range(per_group)])


def _state():
    """SGD at lr 1: the step subtracts the gradient."""
    return TrainState.create(PARAMS[0], optax.identity(), config=CONFIG, lr_schedule=1.0)


def rollout_batch(samples):
    return RolloutBatch(samples=samples, version=0, sampling=SP, prefill_tokens=0,
                        reused_tokens=0, cached_tokens=0, decode_steps=0, decode_chunks=0,
                        prefill_launches=0, seconds=0.0)


@jax.jit
def _dense_padded(params, seq):
    return teacher_forced_log_probs(params, CONFIG, seq[None], **SP.as_arrays())[0]


def _dense(params, seq):
    """f32 [len(seq) - 1] from the full logits, right-padded to 32 tokens (invisible to a
    causal model: one compile, and one gradient compile, for every episode)."""
    padded = jnp.zeros(max(32, len(seq)), jnp.int32).at[:len(seq)].set(seq)
    return _dense_padded(params, padded)[:len(seq) - 1]


def dense_loss(params, episodes, advantages, loss_type):
    """Reference: full-sequence log-probs of each episode, PPO-clip's surrogate at ratio
    exp(logp - behavior), weights only on sampled tokens: dapo 1 / all sampled tokens,
    grpo 1 / (own sampled tokens x N), dr_grpo 1 / (N x max_new_tokens)."""
    n, total = len(episodes), sum(int(e.loss_mask.sum()) for e in episodes)
    loss = 0.0
    for e, adv in zip(episodes, advantages):
        p, mask = len(e.prompt_ids), jnp.asarray(e.loss_mask)
        logp = _dense(params, jnp.asarray(e.prompt_ids + e.token_ids, jnp.int32))[p - 1:]
        ratio = jnp.exp(jnp.where(mask, logp - e.logprobs, 0.0))
        surrogate = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 0.8, 1.2))
        norm = dict(dapo=total, grpo=int(e.loss_mask.sum()) * n,
                    dr_grpo=n * SP.max_new_tokens)[loss_type]
        loss = loss + jnp.where(mask, surrogate, 0.0).sum() / norm
    return loss


@pytest.mark.parametrize("loss_type", ["dapo", pytest.param("grpo", marks=pytest.mark.slow),
                                       pytest.param("dr_grpo", marks=pytest.mark.slow)])
def test_update_equals_the_dense_reference_at_any_budget(loss_type):
    """Loss, gradient norm and the SGD step (lr 1: params - gradient) of train_step equal the
    dense reference's, for the whole batch in one micro-batch and for a quarter of it."""
    batch = tasks()
    rewards = [e.reward for e in batch.episodes]
    train = make_batch(batch, rewards)
    loss, grads = jax.value_and_grad(dense_loss)(PARAMS[0], batch.episodes, train.advantages,
                                                 loss_type)
    norm = float(optax.tree.norm(grads))
    assert norm > 1e-3
    total = pack_batch(train, TrainConfig(token_budget=4096)).tokens.size
    micro = set()
    for budget in (total, total // 4):
        cfg = TrainConfig(token_budget=budget, loss_type=loss_type)
        micro.add(pack_batch(train, cfg).tokens.shape[1])
        state, m = train_step(_state(), train, cfg)
        np.testing.assert_allclose(float(m["loss"]), float(loss), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(m["grad_norm"]), norm, rtol=1e-4)
        assert int(m["tokens"]) == sum(e.sampled_tokens for e in batch.episodes)
        np.testing.assert_allclose(float(m["ratio_mean"]), 1.0, atol=1e-5)
        step = jax.tree.map(lambda p, q, g: p - q - g, PARAMS[0], state.params, grads)
        assert float(optax.tree.norm(step)) <= 1e-4 * norm  # the step is the gradient
    assert len(micro) == 2  # one micro-batch, then several


def test_mini_batches_count_sampled_tokens_only():
    batch = tasks(seed=1)
    train = make_batch(batch, [e.reward for e in batch.episodes])
    _, m = train_step(_state(), train, mini_batches=2)
    parts = balanced_parts(np.array([len(s) for s in train.sequences]), 2)
    assert np.asarray(m["per_update"]["tokens"]).tolist() == [
        sum(int(train.loss_masks[i].sum()) for i in part) for part in parts]


def _corrupt_observations(e: Episode, version: int) -> Episode:
    """Observation log-probs set to junk and versions to `version`, the trailing observation
    (after the last turn) replaced: all context no sampled token's loss reads."""
    obs = ~e.loss_mask
    tokens = list(e.token_ids)
    for t in range(e.turns[-1][1], len(tokens)):
        tokens[t] = (tokens[t] + 7) % CONFIG.vocab_size
    return dataclasses.replace(e, token_ids=tuple(tokens),
                               logprobs=np.where(obs, np.float32(-9.5), e.logprobs),
                               token_versions=np.where(obs, version, e.token_versions))


def test_observation_tokens_change_nothing():
    """Junk log-probs and versions (newer than the trainer) on observation tokens, and new
    tokens after the last turn: the same update and a clean audit; a wrong log-prob on one
    sampled token is flagged at that token."""
    batch = tasks(seed=2)
    rewards = [e.reward for e in batch.episodes]
    corrupted = episode_batch([_corrupt_observations(e, 5) for e in batch.episodes])
    assert corrupted.episodes[2].token_ids != batch.episodes[2].token_ids  # trailing obs
    base, tb = make_batch(batch, rewards), make_batch(corrupted, rewards)
    np.testing.assert_array_equal(tb.behavior_version, base.behavior_version)
    ref_state, ref = train_step(_state(), base)
    state, m = train_step(_state(), tb)  # version-5 observations: no StalenessError
    np.testing.assert_allclose(float(m["loss"]), float(ref["loss"]), rtol=1e-6)
    assert int(m["staleness_max"]) == 0
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)

    sampled = sum(e.sampled_tokens for e in batch.episodes)
    report = audit_attribution(corrupted, {0: PARAMS[0]}, CONFIG, tolerance=1e-4)
    assert report.ok and report.missing_versions == ()  # version 5 only on observations
    assert report.num_checked_tokens == report.num_tokens == sampled
    assert report.num_tokens < sum(len(e.token_ids) for e in batch.episodes)
    episodes = list(corrupted.episodes)
    e = episodes[2]
    bad_at = e.turns[1][0] + 1  # a token of the second turn
    episodes[2] = dataclasses.replace(e, logprobs=e.logprobs + np.float32(0.5) * (
        np.arange(len(e.token_ids)) == bad_at))
    report = audit_attribution(episode_batch(episodes), {0: PARAMS[0]}, CONFIG,
                               tolerance=1e-4)
    assert report.flagged == (2,) and report.first_bad_token == ((2, bad_at),)


def test_every_turn_is_audited_under_its_own_version():
    """Turns of versions 0, 1, 2 in one episode (observations carry the version before
    them): exact with each version's params; without version 1's params, the episodes with
    version-1 tokens are flagged at their first such token; a turn claiming the wrong
    version is flagged at its first token; mixed observation tokens are not counted."""
    rng = np.random.default_rng(3)
    episodes = [episode(rng, SHAPES[0], index=0, versions=[0, 1, 2]),
                episode(rng, SHAPES[1], index=1, versions=[0, 0]),
                episode(rng, SHAPES[2], index=2, versions=[1, 2])]
    batch = episode_batch(episodes, version=2)
    report = audit_attribution(batch, PARAMS, CONFIG, tolerance=1e-4)
    assert report.ok and report.num_checked_tokens == sum(e.sampled_tokens for e in episodes)
    report = audit_attribution(batch, {0: PARAMS[0], 2: PARAMS[2]}, CONFIG, tolerance=1e-4)
    assert report.missing_versions == (1,) and report.flagged == (0, 2)
    assert report.first_bad_token == ((0, episodes[0].turns[1][0]), (2, 0))
    e = episodes[0]
    relabelled = np.where(np.arange(len(e.token_ids)) >= e.turns[2][0], 1, e.token_versions)
    wrong = dataclasses.replace(e, token_versions=relabelled)
    report = audit_attribution(episode_batch([wrong] + episodes[1:], 2), PARAMS, CONFIG,
                               tolerance=1e-4)
    assert report.flagged == (0,) and report.first_bad_token == ((0, e.turns[2][0]),)
    mixed = np.zeros(len(e.token_ids), bool)
    mixed[[e.turns[0][1], e.turns[1][0]]] = True  # an observation token, a sampled one
    report = audit_attribution(episode_batch([dataclasses.replace(e, mixed_tokens=mixed)], 2),
                               PARAMS, CONFIG, tolerance=1e-4)
    assert report.ok and report.num_mixed_tokens == 1
    assert report.num_checked_tokens == e.sampled_tokens - 1 == report.num_tokens - 1


def test_groups_are_the_episodes_of_one_task():
    """Advantages normalised within (call, task); an episode batch mixes with a rollout
    batch of the same sampling; masks, versions and behavior log-probs carried per sample."""
    a, b = tasks(seed=4, groups=2, per_group=3), tasks(seed=5, groups=1, per_group=2)
    rng = np.random.default_rng(6)
    single = episode(rng, SHAPES[3], group=0)
    sample = dataclasses.replace(single.as_sample(), loss_mask=None)
    singles = rollout_batch([sample, sample])
    rewards = np.array([1.0, 2.0, 4.0, 0.0, 0.0, 3.0, 5.0, 1.0, 2.0, 7.0])
    train = make_batch([a, b, singles], rewards)
    keys = [(0, e.group) for e in a.episodes] + [(1, e.group) for e in b.episodes] + [(2, 0)] * 2
    expected = np.zeros(len(rewards))
    for key in set(keys):
        idx = [i for i, k in enumerate(keys) if k == key]
        r = rewards[idx]
        expected[idx] = (r - r.mean()) / (r.std() + 1e-6)
    np.testing.assert_allclose(train.advantages, expected, rtol=1e-5, atol=1e-5)
    episodes = a.episodes + b.episodes
    for i, e in enumerate(episodes):
        np.testing.assert_array_equal(train.loss_masks[i], e.loss_mask)
        np.testing.assert_array_equal(train.behavior_logprobs[i], e.logprobs)
        assert train.prompt_lengths[i] == len(e.prompt_ids)
        assert list(train.sequences[i]) == list(e.prompt_ids + e.token_ids)
    assert train.loss_masks[-1].all() and len(train.loss_masks[-1]) == len(single.token_ids)
    # a single-turn episode trains as the equivalent single-turn sample
    np.testing.assert_array_equal(train.behavior_logprobs[-1], single.logprobs)
    with pytest.raises(ValueError, match="share SamplingParams"):
        make_batch([a, episode_batch(b.episodes, sampling=dataclasses.replace(SP, n=2))],
                   rewards[:8])


@pytest.mark.parametrize("change,match", [
    (lambda m: m[:-1], r"sample 1: loss_mask must be None or bool \[\d+\]"),
    (lambda m: m.astype(np.int8), "sample 1: loss_mask must be None or bool"),
    (lambda m: np.zeros_like(m), "sample 1 has no sampled token"),
])
def test_bad_loss_masks_are_refused(change, match):
    """Misshapen or all-False masks name the sample (make_batch and the audit); NaN
    log-probs on observation tokens are never read."""
    batch = tasks(seed=7, groups=1, per_group=2)
    first, e = (x.as_sample() for x in batch.episodes)
    bad = rollout_batch([first, dataclasses.replace(e, loss_mask=change(e.loss_mask))])
    with pytest.raises(ValueError, match=match):
        make_batch(bad, [1.0, 0.0])
    if "no sampled" not in match:
        with pytest.raises(ValueError, match=match):
            audit_attribution(bad, {0: PARAMS[0]}, CONFIG)
    e = batch.episodes[1]
    nan_obs = dataclasses.replace(e, logprobs=np.where(e.loss_mask, e.logprobs, np.nan))
    make_batch(episode_batch([batch.episodes[0], nan_obs]), [1.0, 0.0])  # obs: not read


class FixedRollouts:
    """The same calls every step of an exact engine; publish acknowledges the version."""

    def __init__(self, parts, gate: AuditGate = AuditGate()):
        self.parts, self.gate = parts, gate

    def get(self, step, state):
        return self.parts

    def publish(self, state):
        return WeightAck(version=int(state.version), previous_version=int(state.version) - 1,
                         invalidated_pages=0, seconds=0.0, cached_versions=())

    def oldest_pending(self, trainer_version):
        return trainer_version

    def close(self):
        return {}


def test_grpo_step_trains_on_episode_returns():
    """reward=None: each episode's return is its reward; every sampled token audited; the
    update equals make_batch + train_step; the record counts episodes, turns, errors and
    environment time; a single-turn record has none of those fields."""
    batch = tasks(seed=8)
    batch = dataclasses.replace(batch, episodes=batch.episodes[:-1] + [dataclasses.replace(
        batch.episodes[-1], finish_reason="error", error="boom")])
    history = PolicyHistory(lag=0)
    history.add(0, PARAMS[0])
    result = grpo_step(0, _state(), FixedRollouts([("m", batch)]), None, decode=str,
                       history=history)
    returns = [e.reward for e in batch.episodes]
    expected, _ = train_step(_state(), make_batch(batch, returns), max_policy_lag=0)
    for a, b in zip(jax.tree.leaves(result.state.params), jax.tree.leaves(expected.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    r = result.record
    assert r["reward"] == pytest.approx(np.mean(returns)) and r["samples"] == 8
    assert r["audit_checked_tokens"] == r["generated_tokens"] == sum(
        e.sampled_tokens for e in batch.episodes) and r["audit_failed"] == 0
    assert r["episodes"] == 8 and r["env_errors"] == 1 and r["env_seconds"] == 0.25
    assert r["turns_mean"] == pytest.approx(np.mean([len(e.turns) for e in batch.episodes]))
    assert [t for _, _, t in result.texts][0] == "t0t1t2"
    assert result.texts[0][1] is batch.episodes[0]

    rng = np.random.default_rng(9)
    singles = rollout_batch([dataclasses.replace(episode(rng, SHAPES[3]).as_sample(),
                                                 loss_mask=None) for _ in range(2)])
    history = PolicyHistory(lag=0)
    history.add(0, PARAMS[0])
    with pytest.raises(ValueError, match="reward=None needs episode calls"):
        grpo_step(0, _state(), FixedRollouts([("m", singles)]), None, decode=str,
                  history=history)
    plain = grpo_step(0, _state(), FixedRollouts([("m", singles)]),
                      lambda meta, s, text: float(len(s.output_ids)), decode=str,
                      history=history).record
    assert not {"episodes", "turns_mean", "env_errors", "env_seconds"} & set(plain)
