"""TRL's loss knobs against numpy references of their formulas: scale_rewards (group / batch /
none), epsilon_high (clip-higher), importance_sampling_level "sequence" (GSPO), entropy_coef
and mask_truncated_completions; the defaults leave the loss as it was."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_cache.rl.batch import advantages_for, group_advantages, make_batch, scaled_advantages
from jaxrl_cache.rl.logprobs import next_token_log_probs
from jaxrl_cache.rl.loss import policy_loss
from jaxrl_cache.rl.train import TrainState, train_step
from jaxrl_cache.rl.train_config import TrainConfig
from jaxrl_cache.rollout import CacheConfig, RolloutEngine
from jaxrl_cache.rollout.sampling import SamplingParams
from tests.helpers import CONFIG, varied_params

PROMPTS = [list(range(1, 20)), list(range(5, 14)), [7, 3, 9]]
SP = SamplingParams(n=3, max_new_tokens=6, temperature=0.9,
                    stop_token_ids=(5, 11, 17, 23, 29, 35))  # some samples stop, some are cut


def np_std(x):
    """Unbiased std as TRL's nanstd (Bessel's correction), 0 for one value."""
    x = np.asarray(x, np.float64)
    return 0.0 if x.size < 2 else float(np.sqrt(((x - x.mean()) ** 2).sum() / (x.size - 1)))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_scaled_advantages_are_trls(scale):
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=12).round(1)
    rewards[8:] = 2.5  # a constant group: its std is 0
    groups = np.repeat([3, 0, 7], 4)
    got = scaled_advantages(rewards, groups, scale)
    want = np.zeros(12)
    for g in np.unique(groups):
        r = rewards[groups == g]
        adv = r - r.mean()
        if scale == "group":
            adv = adv / (np_std(r) + 1e-4)
        want[groups == g] = adv
    if scale == "batch":
        want = want / (np_std(rewards) + 1e-4)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert np.all(got[8:] == 0)


def test_advantages_for_keeps_the_default_and_checks_the_name():
    assert advantages_for(None) is group_advantages
    r, g = np.array([1.0, 3.0, 5.0, 5.0]), np.array([0, 0, 1, 1])
    np.testing.assert_array_equal(advantages_for("batch")(r, g), scaled_advantages(r, g, "batch"))
    with pytest.raises(ValueError, match="scale_rewards must be one of"):
        advantages_for("groups")


def _arrays(seed=0):
    """A micro-batch [2, 12] of two packed rows: segments 1..3, trained tokens, random
    log-probs, behavior, advantages per sequence, weights (dapo: 1 / trained tokens)."""
    rng = np.random.default_rng(seed)
    segments = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0],
                         [1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 0]], np.int32)
    trained = (segments > 0) & (rng.random(segments.shape) < 0.8)
    trained[:, 0] = True
    weights = np.where(trained, 1.0 / trained.sum(), 0.0).astype(np.float32)
    behavior = np.where(trained, -rng.random(segments.shape) * 3, 0).astype(np.float32)
    logp = (behavior + rng.normal(size=segments.shape) * 0.4).astype(np.float32)
    adv_of = rng.normal(size=(2, 4))
    advantages = np.take_along_axis(adv_of, segments, 1).astype(np.float32)
    entropy = rng.random(segments.shape).astype(np.float32) * 2
    return logp, behavior, weights, advantages, segments, trained, entropy


def _nums(eps=0.2, high=None, coef=0.0, norm=1.0):
    return dict(clip_eps=jnp.float32(eps), clip_high=jnp.float32(eps if high is None else high),
                is_cap=jnp.float32(2.0), kl_beta=jnp.float32(0.0), dual_clip=None,
                entropy_coef=jnp.float32(coef), entropy_norm=jnp.float32(norm))


def _np_loss(logp, behavior, weights, advantages, segments, trained, eps_low, eps_high,
             sequence=False):
    """TRL's per-token loss -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), weighted."""
    log_ratio = np.where(trained, logp.astype(np.float64) - behavior, 0.0)
    if sequence:  # GSPO: each sequence's mean log-ratio over its trained tokens
        for b in range(segments.shape[0]):
            for s in np.unique(segments[b]):
                on = (segments[b] == s) & trained[b]
                log_ratio[b, segments[b] == s] = log_ratio[b, on].sum() / max(on.sum(), 1)
    ratio = np.exp(log_ratio)
    per_token = -np.minimum(ratio * advantages,
                            np.clip(ratio, 1 - eps_low, 1 + eps_high) * advantages)
    return float((weights * np.where(trained, per_token, 0.0)).sum()), ratio


def _loss(logp, behavior, weights, advantages, **kw):
    zeros = jnp.zeros(logp.shape, jnp.int32)
    return policy_loss(jnp.asarray(logp), jnp.asarray(behavior), jnp.asarray(weights),
                       jnp.asarray(advantages), zeros, jnp.int32(0), **kw)


@pytest.mark.parametrize("high", [None, 0.28, 0.0, 1.5])
def test_epsilon_high_clips_the_ratio_above_only(high):
    logp, behavior, weights, adv, segments, trained, _ = _arrays()
    loss, sums = _loss(logp, behavior, weights, adv, nums=_nums(0.2, high))
    want, ratio = _np_loss(logp, behavior, weights, adv, segments, trained, 0.2,
                           0.2 if high is None else high)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    clipped = ((ratio > 1 + (0.2 if high is None else high)) | (ratio < 0.8)) & trained
    assert int(sums["clipped"]) == int(clipped.sum())


def test_default_clip_is_the_symmetric_one():
    """clip_high = clip_eps gives the very bits of the symmetric clip (the defaults)."""
    logp, behavior, weights, adv, *_ = _arrays(1)
    got, _ = _loss(logp, behavior, weights, adv, nums=_nums(0.2))
    mask = weights > 0
    ratio = jnp.exp(jnp.where(mask, logp - behavior, 0.0))
    ref = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 0.8, 1.2))
    assert float(got) == float((weights * ref).sum())


def test_sequence_level_importance_sampling_is_gspo():
    logp, behavior, weights, adv, segments, trained, _ = _arrays(2)
    loss, sums = _loss(logp, behavior, weights, adv, nums=_nums(0.2, 0.3),
                       segments=jnp.asarray(segments))
    want, ratio = _np_loss(logp, behavior, weights, adv, segments, trained, 0.2, 0.3,
                           sequence=True)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(sums["ratio"]), ratio[trained].sum(), rtol=1e-5)
    # the gradient reaches every trained token of an unclipped sequence (no stop-gradient):
    # d loss / d logp_t = -A r_s w_t-sum / n_s for each token t of sequence s
    grad = jax.grad(lambda lp: _loss(lp, behavior, weights, adv, nums=_nums(10.0, 10.0),
                                     segments=jnp.asarray(segments))[0])(jnp.asarray(logp))
    for b in range(2):
        for s in np.unique(segments[b][segments[b] > 0]):
            on = (segments[b] == s) & trained[b]
            want_g = -adv[b, on][0] * ratio[b, on][0] * weights[b, on].sum() / on.sum()
            np.testing.assert_allclose(np.asarray(grad)[b, on], want_g, rtol=1e-4)
    assert np.all(np.asarray(grad)[~trained] == 0)


def test_entropy_bonus_is_a_token_mean_over_trained_tokens():
    logp, behavior, weights, adv, segments, trained, entropy = _arrays(3)
    base, _ = _loss(logp, behavior, weights, adv, nums=_nums())
    norm = 1.0 / trained.sum()
    with_bonus, _ = _loss(logp, behavior, weights, adv, nums=_nums(coef=0.05, norm=norm),
                          entropy=jnp.asarray(entropy))
    np.testing.assert_allclose(float(with_bonus),
                               float(base) - 0.05 * entropy[trained].mean(), rtol=1e-5)


# ---- the train step: packed micro-batches, against numpy references ----

@pytest.fixture(scope="module")
def params():
    return varied_params(0)


@pytest.fixture(scope="module")
def rollouts(params):
    engine = RolloutEngine(CONFIG, CacheConfig(num_pages=128, page_size=8))
    return engine.rollout(params, 0, PROMPTS, SP, rng=jax.random.key(4))


def _rewards(batch):
    return [float(sum(t % 3 == 0 for t in s.output_ids)) for s in batch.samples]


SGD = optax.sgd(1.0)  # one object: jit keys the optimizer by identity


def _state(params):
    return TrainState.create(params, SGD, config=CONFIG, lr_schedule=1e-3)


def _current(params, batch):
    """Each sample's teacher-forced log-probs of its output tokens (numpy, f64)."""
    return [np.asarray(next_token_log_probs(params, CONFIG, seq[None], batch.sampling),
                       np.float64)[0, p - 1:] for seq, p in zip(batch.sequences,
                                                                 batch.prompt_lengths)]


def _shifted(batch, seed):
    """The batch with behavior log-probs moved off the current policy's (ratios != 1)."""
    rng = np.random.default_rng(seed)
    return dataclasses.replace(batch, behavior_logprobs=tuple(
        (b + rng.normal(size=b.shape) * 0.3).astype(np.float32)
        for b in batch.behavior_logprobs))


@pytest.mark.parametrize("level,high", [("token", 0.28), ("sequence", None),
                                        ("sequence", 0.35)])
def test_train_step_loss_matches_numpy(params, rollouts, level, high):
    batch = _shifted(make_batch(rollouts, _rewards(rollouts)), 5)
    _, m = train_step(_state(params), batch, importance_sampling_level=level,
                      epsilon_high=high)
    logps = _current(params, batch)
    tokens = sum(len(b) for b in batch.behavior_logprobs)
    want = 0.0
    for lp, beh, a in zip(logps, batch.behavior_logprobs, batch.advantages):
        log_ratio = lp - beh
        if level == "sequence":
            log_ratio = np.full_like(log_ratio, log_ratio.mean())
        r = np.exp(log_ratio)
        hi = 0.2 if high is None else high
        want += (-np.minimum(r * a, np.clip(r, 0.8, 1 + hi) * a)).sum() / tokens
    np.testing.assert_allclose(float(m["loss"]), want, rtol=1e-4, atol=1e-6)


def test_entropy_coef_in_the_train_step(params, rollouts):
    """loss(coef) = loss(0) - coef x the mean entropy of the sampling distribution over the
    trained tokens (numpy softmax of logits / T), and the bonus has a gradient."""
    batch = make_batch(rollouts, _rewards(rollouts))
    plain, m0 = train_step(_state(params), batch)
    bonus, m1 = train_step(_state(params), batch, entropy_coef=0.1)
    from tests.helpers import dense_logits
    ents = []
    for seq, p in zip(batch.sequences, batch.prompt_lengths):
        z = np.asarray(dense_logits(params, CONFIG, seq), np.float64)[p - 1:-1] / 0.9
        q = np.exp(z - z.max(-1, keepdims=True))
        q /= q.sum(-1, keepdims=True)
        ents.extend(-(q * np.log(q)).sum(-1))
    np.testing.assert_allclose(float(m0["entropy"]), np.mean(ents), rtol=1e-4)
    np.testing.assert_allclose(float(m1["loss"]), float(m0["loss"]) - 0.1 * np.mean(ents),
                               rtol=1e-4, atol=1e-6)
    assert any(np.any(np.asarray(a) != np.asarray(b)) for a, b in
               zip(jax.tree.leaves(plain.params), jax.tree.leaves(bonus.params)))


def test_mask_truncated_completions(params, rollouts):
    """Samples cut at max_new_tokens get no loss weight (dapo: they leave the token count),
    yet every token, theirs too, is still audited bit for bit."""
    batch = make_batch(rollouts, _rewards(rollouts))
    truncated = np.array([s.finish_reason == "length" for s in rollouts.samples])
    assert truncated.any() and not truncated.all()
    np.testing.assert_array_equal(batch.truncated, truncated)
    _, m = train_step(_state(params), batch, mask_truncated_completions=True,
                      audit_tolerance=0.0)
    lengths = np.array([len(b) for b in batch.behavior_logprobs])
    kept = ~truncated
    want = -(lengths[kept] * batch.advantages[kept]).sum() / lengths[kept].sum()  # ratio 1
    np.testing.assert_allclose(float(m["loss"]), want, rtol=1e-5, atol=1e-7)
    assert int(m["tokens"]) == lengths[kept].sum()
    assert int(m["audit_checked_tokens"]) == lengths.sum()
    assert float(m["logprob_mismatch_max"]) == 0.0
    # grpo: a masked sample still counts in the number of sequences (TRL's .mean())
    _, g = train_step(_state(params), batch, loss_type="grpo", mask_truncated_completions=True)
    want = -batch.advantages[kept].sum() / len(lengths)
    np.testing.assert_allclose(float(g["loss"]), want, rtol=1e-5, atol=1e-7)


def test_all_truncated_mini_batch_trains_nothing_and_is_audited(params, rollouts):
    batch = make_batch(rollouts, _rewards(rollouts))
    every = dataclasses.replace(batch, truncated=np.ones(batch.num_samples, bool))
    state = _state(params)
    new, m = train_step(state, every, mask_truncated_completions=True, audit_tolerance=0.0)
    assert float(m["loss"]) == 0.0 and int(m["tokens"]) == 0
    assert int(m["audit_checked_tokens"]) == sum(len(b) for b in batch.behavior_logprobs)
    assert int(new.version) == 1


def test_config_checks():
    for bad, match in ((dict(epsilon_high=-0.1), "epsilon_high must be finite and >= 0"),
                       (dict(entropy_coef=float("nan")), "entropy_coef must be finite"),
                       (dict(importance_sampling_level="seq"), "importance_sampling_level"),
                       (dict(mask_truncated_completions=1), "must be a bool")):
        with pytest.raises((ValueError, TypeError), match=match):
            TrainConfig(**bad)
    assert TrainConfig().clip_high == 0.2 and TrainConfig(epsilon_high=0.28).clip_high == 0.28


def test_new_knob_values_compile_nothing(params, rollouts):
    """epsilon_high, entropy_coef (> 0), min_p (> 0) and repetition_penalty (!= 1) are traced:
    new values reuse the compiled step."""
    from jaxrl_cache.rl import train
    batch = make_batch(rollouts, _rewards(rollouts))

    def step(**kw):
        sampling = dataclasses.replace(batch.sampling, min_p=kw.pop("min_p"),
                                       repetition_penalty=kw.pop("penalty"))
        train_step(_state(params), dataclasses.replace(batch, sampling=sampling), **kw)

    step(epsilon_high=0.3, entropy_coef=0.01, min_p=0.05, penalty=1.2)
    size = train._train_jit._cache_size()
    step(epsilon_high=0.25, entropy_coef=0.2, min_p=0.1, penalty=0.9)
    assert train._train_jit._cache_size() == size


def test_demo_flags_are_checked_in_one_line():
    from jaxrl_cache.app import cli
    from jaxrl_cache.app.options import DemoOptions
    for bad, message in ((dict(min_p=1.5), "--min-p: min_p must be finite and >= 0.0 and "
                                           "<= 1.0"),
                         (dict(repetition_penalty=0.0), "--repetition-penalty: "
                                                        "repetition_penalty must be finite"),
                         (dict(epsilon_high=-0.1), "--epsilon-high: epsilon_high must be"),
                         (dict(entropy_coef=-1.0), "--entropy-coef: entropy_coef must be"),
                         (dict(scale_rewards="std"), "--scale-rewards: scale_rewards must be"),
                         (dict(importance_sampling_level="seq"),
                          "--importance-sampling-level: importance_sampling_level must be"),
                         (dict(kl_beta=0.1, min_p=0.1), "--kl-beta with --top-k/--top-p/"
                                                        "--min-p")):
        with pytest.raises(ValueError) as e:
            DemoOptions(**bad)
        assert str(e.value).startswith(message) and "\n" not in str(e.value), e.value
    args = cli.build_parser().parse_args(
        ["demo", "--min-p", "0.1", "--repetition-penalty", "1.2", "--epsilon-high", "0.28",
         "--scale-rewards", "batch", "--mask-truncated-completions",
         "--importance-sampling-level", "sequence", "--entropy-coef", "0.01"])
    assert (args.min_p, args.repetition_penalty, args.epsilon_high, args.scale_rewards,
            args.mask_truncated_completions, args.importance_sampling_level,
            args.entropy_coef) == (0.1, 1.2, 0.28, "batch", True, "sequence", 0.01)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["demo", "--min-p", "1.5"])


def test_demo_runs_every_knob_with_exact_attribution(tmp_path):
    """GRPO end to end with every knob on: every sample's recorded log-probs reproduce
    (the demo's audit compares bits) and the steps train."""
    from jaxrl_cache.app import demo
    opts = demo.DemoOptions(steps=2, sft_steps=2, sft_batch=4, eval_prompts=4, group_size=2,
                            prompts_per_step=4, checkpoint_every=2, out=str(tmp_path / "run"),
                            min_p=0.05, repetition_penalty=1.2, epsilon_high=0.28,
                            scale_rewards="batch", mask_truncated_completions=True,
                            importance_sampling_level="sequence", entropy_coef=0.01)
    summary = demo.run_demo(opts)
    assert summary["steps_run"] == 2 and summary["audit_failures"] == 0
    assert summary["audited_samples"] == 2 * 4 * 2


def test_penalised_episodes_reproduce_bit_for_bit():
    """Multi-turn episodes: a later turn's context is the whole history (observations
    included), in the sampler's presence and in the trainer's packed sequence alike, so the
    audit and the train step reproduce every sampled token's log-prob under min-p and the
    repetition penalty."""
    from jaxrl_cache.rl.audit import audit_attribution
    from jaxrl_cache.rollout import SchedulerConfig
    from tests.test_episodes import TASKS, TokenEnv
    engine = RolloutEngine(CONFIG, CacheConfig(num_pages=128, page_size=4),
                           scheduler_config=SchedulerConfig(max_num_seqs=4, chunk_steps=4,
                                                            max_prefill_tokens=256))
    p0 = varied_params(0)
    sampling = SamplingParams(n=2, max_new_tokens=5, temperature=0.8, min_p=0.05,
                              repetition_penalty=1.4)
    batch = engine.rollout_episodes(p0, 0, TASKS, TokenEnv, sampling, rng=jax.random.key(2))
    assert all(len(e.turns) > 1 for e in batch.episodes)
    report = audit_attribution(batch, {0: p0}, CONFIG)
    assert report.ok and report.max_abs_diff == 0.0, report
    _, m = train_step(_state(p0), make_batch(batch, [e.reward for e in batch.episodes]),
                      token_budget=128, audit_tolerance=0.0)
    assert float(m["logprob_mismatch_max"]) == 0.0
    assert int(m["audit_checked_tokens"]) == sum(e.sampled_tokens for e in batch.episodes)
