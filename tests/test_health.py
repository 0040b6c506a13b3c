"""GRPO health metrics (rl/health.py and the train step's entropy): reward spread, groups
without spread and the warning after k such steps, completion lengths, truncation, entropy
against a dense reference."""
import types
import warnings

import jax
import numpy as np
import pytest

from jaxrl_cache.rl import loop
from jaxrl_cache.rl.health import NoSpreadWarning, SpreadWatch, step_health
from jaxrl_cache.rl.train import TrainState
from jaxrl_cache.rl.train_config import TrainConfig
from jaxrl_cache.rollout import CacheConfig, RolloutEngine
from jaxrl_cache.rollout.sampling import SamplingParams
from tests.helpers import CONFIG, dense_logits, varied_params

PROMPTS = [list(range(1, 20)), list(range(5, 14)), list(range(2, 9))]
SP = SamplingParams(n=4, max_new_tokens=6, temperature=0.5, stop_token_ids=(3, 7, 11, 19))


def _fake_call(samples):
    return types.SimpleNamespace(samples=[types.SimpleNamespace(
        group=g, output_ids=(0,) * n, finish_reason=why) for g, n, why in samples])


def test_step_health_groups_lengths_and_truncation():
    calls = [_fake_call([(0, 3, "stop"), (0, 5, "length"), (1, 2, "stop"), (1, 2, "stop")]),
             _fake_call([(0, 4, "length"), (0, 1, "stop")])]  # group 0 of call 1: its own
    rewards = [1.0, 0.0, 0.5, 0.5, 2.0, 2.0]
    h = step_health(calls, rewards)
    assert h["groups"] == 3 and h["zero_std_groups"] == pytest.approx(2 / 3)
    assert h["reward_std"] == pytest.approx(np.std(rewards))
    assert (h["completion_length_min"], h["completion_length_max"]) == (1, 5)
    assert h["completion_length_mean"] == pytest.approx(17 / 6)
    assert h["truncated_fraction"] == pytest.approx(2 / 6)
    with pytest.raises(ValueError, match="5 rewards for 6 samples"):
        step_health(calls, rewards[:5])


def test_spread_watch_fires_once_after_k_flat_steps():
    watch = SpreadWatch(3)
    flat, spread = dict(zero_std_groups=1.0), dict(zero_std_groups=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for record in (flat, flat, spread, flat, flat):  # a spread step resets the count
            assert watch.update(dict(record, step=0)) is None
    with pytest.warns(NoSpreadWarning, match="for 3 consecutive steps"):
        assert "step 5" in watch.update(dict(flat, step=5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(watch.update(flat) is None for _ in range(5))  # once per run
    quiet = SpreadWatch(1, warn=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert quiet.update(flat) is not None
    with pytest.raises(ValueError, match="integer >= 1"):
        SpreadWatch(0)


def _dense_entropy(params, sample, temperature: float) -> np.ndarray:
    """Entropy of softmax(logits / T) at each sampled token, from the full dense logits."""
    seq = list(sample.prompt_ids) + list(sample.output_ids)
    logits = np.asarray(dense_logits(params, CONFIG, seq), np.float64)
    z = logits[len(sample.prompt_ids) - 1:len(seq) - 1] / temperature
    logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - z.max(-1, keepdims=True)
    return -(np.exp(logp) * logp).sum(-1)


def test_grpo_step_records_health_metrics_and_entropy():
    params = varied_params(0)
    engine = RolloutEngine(CONFIG, CacheConfig(num_pages=128, page_size=8))
    state = TrainState.create(params, config=CONFIG, lr_schedule=1e-3)

    def reward(meta, sample, text):  # group 2's rewards are all equal
        return 1.0 if sample.group == 2 else float(sample.output_ids[0] % 2)

    rollouts = loop.SyncRollouts(engine, lambda call: (PROMPTS, None), SP, calls=1,
                                 key=jax.random.key(0))
    history = loop.PolicyHistory(0)
    result = loop.grpo_step(0, state, rollouts, reward, decode=str, history=history,
                            train=TrainConfig())
    r, samples = result.record, [s for _, s, _ in result.texts]
    rewards = [reward(None, s, "") for s in samples]
    assert r["reward_std"] == pytest.approx(np.std(rewards))
    spread = {g for g in range(3) if len({x for s, x in zip(samples, rewards)
                                          if s.group == g}) > 1}
    assert r["groups"] == 3 and r["zero_std_groups"] == pytest.approx(1 - len(spread) / 3)
    lengths = [len(s.output_ids) for s in samples]
    assert (r["completion_length_min"], r["completion_length_max"]) == (min(lengths),
                                                                         max(lengths))
    assert r["completion_length_mean"] == pytest.approx(np.mean(lengths))
    cut = [s.finish_reason == "length" for s in samples]
    assert r["truncated_fraction"] == pytest.approx(np.mean(cut)) and 0 < np.mean(cut) < 1
    # entropy: the trainer's (= the sampler's, first update) warped distribution, per token
    expected = np.concatenate([_dense_entropy(params, s, SP.temperature) for s in samples])
    assert r["entropy"] == pytest.approx(expected.mean(), rel=1e-4) and r["entropy"] > 0
    assert r["kl"] == 0.0  # no reference policy (train_step's kl: test_train_scale.py)
