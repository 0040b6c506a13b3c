"""The train step's own attribution audit: its first update scores the tokens of the
trainer's version with the params that sampled them, so grpo_step audits those for free. It
checks exactly what `audit_attribution` checks (the same tokens, the same differences),
applies no update when a token is off, and grpo_step then names the sample; tokens of
older versions are scored by the step with their own params (`audit_params`) on its packed
micro-batches; every token when the step cannot check (several mini-batches) still goes
through the separate audit."""
import dataclasses

import jax
import numpy as np
import pytest

from jaxrl_cache.rl import audit
from jaxrl_cache.rl.audit import audit_attribution
from jaxrl_cache.rl.loop import PolicyHistory, grpo_step
from jaxrl_cache.rl.batch import make_batch
from jaxrl_cache.rl.train import AttributionFailure, TrainState, train_step
from jaxrl_cache.rl.train_config import TrainConfig
from jaxrl_cache.rollout.engine import RolloutEngine
from jaxrl_cache.rollout.sampling import SamplingParams
from jaxrl_cache.rollout.types import CacheConfig
from tests.helpers import CONFIG
from tests.test_episode_training import (PARAMS, SHAPES, FixedRollouts, _state, episode,
                                         episode_batch, tasks)

TOL = audit.AUDIT_TOLERANCE


def _shift(e, token: int, by: float = 0.1):
    """The episode with output token `token`'s recorded log-prob moved by `by`."""
    logp = e.logprobs.copy()
    logp[token] += by
    return dataclasses.replace(e, logprobs=logp)


def _at(version: int) -> TrainState:
    """_state()'s SGD at `version`, with that version's params."""
    return _state().replace(params=PARAMS[version], version=jax.numpy.int32(version))


def _two_versions(seed=3):
    """Episodes whose first turn is version 0 and later turns version 1."""
    rng = np.random.default_rng(seed)
    return episode_batch([episode(rng, SHAPES[k % 3], index=k, group=k // 2,
                                  versions=[0, 1, 1][:len(SHAPES[k % 3])])
                          for k in range(6)], version=0)


def test_the_step_checks_what_the_audit_checks():
    """Synchronous batch: the step checks every sampled token, as many as the audit, and
    its largest difference is the audit's (both exactly 0: the trainer's bits are the
    sampler's). Two versions, trainer at 1: the step
    checks exactly the version-1 tokens (the audit's count with version 0 checked
    elsewhere), and the audit of version 0 with version 1 elsewhere recomputes the rest."""
    batch = tasks(seed=4)
    report = audit_attribution(batch, {0: PARAMS[0]}, CONFIG)
    _, metrics = train_step(_state(), make_batch(batch, [e.reward for e in batch.episodes]),
                            max_policy_lag=0, audit_tolerance=TOL)
    assert int(metrics["audit_checked_tokens"]) == report.num_checked_tokens == sum(
        e.sampled_tokens for e in batch.episodes)
    assert float(metrics["audit_diff_max"]) == report.max_abs_diff == 0.0  # exact numerics
    assert float(metrics["logprob_mismatch_mean"]) == float(metrics["logprob_mismatch_kl"]) == 0

    mixed = _two_versions()
    _, metrics = train_step(_at(1), make_batch(mixed, [e.reward for e in mixed.episodes]),
                            max_policy_lag=1, audit_tolerance=TOL)
    only_new = audit_attribution(mixed, {1: PARAMS[1]}, CONFIG, checked_elsewhere={0})
    only_old = audit_attribution(mixed, {0: PARAMS[0]}, CONFIG, checked_elsewhere={1})
    assert only_new.ok and only_old.ok and only_new.num_checked_tokens > 0
    assert int(metrics["audit_checked_tokens"]) == only_new.num_checked_tokens
    assert only_new.num_checked_tokens + only_old.num_checked_tokens == sum(
        e.sampled_tokens for e in mixed.episodes)


def test_an_off_token_stops_the_update():
    """One current-version token 0.1 off: AttributionFailure, carrying the input state (no
    update, same version); without a tolerance the step applies and reports the 0.1. The
    same shift on an older version's token, a mixed token or an observation token is not
    the step's to check."""
    batch = tasks(seed=5)
    bad = dataclasses.replace(batch, episodes=batch.episodes[:2] + [
        _shift(batch.episodes[2], 1)] + batch.episodes[3:])
    train = make_batch(bad, [e.reward for e in bad.episodes])
    with pytest.raises(AttributionFailure, match="no update applied") as failed:
        train_step(_state(), train, max_policy_lag=0, audit_tolerance=TOL)
    assert int(failed.value.state.version) == 0
    for a, b in zip(jax.tree.leaves(failed.value.state.params), jax.tree.leaves(PARAMS[0])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    state, metrics = train_step(_state(), train, max_policy_lag=0)
    assert int(state.version) == 1
    assert float(metrics["audit_diff_max"]) == pytest.approx(0.1, abs=1e-3)

    mixed = _two_versions()
    e = mixed.episodes[0]
    old = int(np.flatnonzero(e.loss_mask & (e.token_versions == 0))[0])
    observation = int(np.flatnonzero(~e.loss_mask)[0])
    flagged = np.zeros(len(e.token_ids), bool)
    new = int(np.flatnonzero(e.loss_mask & (e.token_versions == 1))[0])
    flagged[new] = True
    shifted = _shift(_shift(dataclasses.replace(_shift(e, old), mixed_tokens=flagged), new),
                     observation)
    other = dataclasses.replace(mixed, episodes=[shifted] + mixed.episodes[1:])
    state, metrics = train_step(_at(1), make_batch(other, [0.0] * 6), max_policy_lag=1,
                                audit_tolerance=TOL)
    assert int(state.version) == 2 and float(metrics["audit_diff_max"]) == TOL == 0.0


def test_the_step_scores_older_versions_before_any_update():
    """Trainer at 1, tokens of 0 and 1, audit_params={0: version 0's params}: the step checks
    every sampled token, each exactly (0), counts them once, and empties the dict (nothing
    keeps those params alive through the update). A version-0 token off its record is an
    AttributionFailure carrying the unchanged state, no update applied (so the dict keeps
    the params, for naming the sample). A version newer than the state, or no dict, is
    refused before any work."""
    mixed = _two_versions()
    batch = make_batch(mixed, [e.reward for e in mixed.episodes])
    older = {0: PARAMS[0]}
    state, metrics = train_step(_at(1), batch, max_policy_lag=1, audit_tolerance=TOL,
                                audit_params=older)
    assert older == {} and int(state.version) == 2
    assert int(metrics["audit_checked_tokens"]) == sum(e.sampled_tokens for e in mixed.episodes)
    assert float(metrics["logprob_mismatch_max"]) == 0.0
    assert float(metrics["logprob_mismatch_kl"]) == 0.0

    first = int(np.flatnonzero(np.asarray(mixed.episodes[1].token_versions) == 0)[0])
    bad = dataclasses.replace(mixed, episodes=[mixed.episodes[0],
                                               _shift(mixed.episodes[1], first, 1e-6),
                                               *mixed.episodes[2:]])
    older = {0: PARAMS[0]}
    with pytest.raises(AttributionFailure, match=r"version\(s\) \[0\] is .* off") as e:
        train_step(_at(1), make_batch(bad, [e.reward for e in bad.episodes]),
                   max_policy_lag=1, audit_tolerance=TOL, audit_params=older)
    assert int(e.value.state.version) == 1 and set(older) == {0}
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(e.value.state.params),
                                                    jax.tree.leaves(PARAMS[1])))
    with pytest.raises(ValueError, match="version 2, newer than the state's"):
        train_step(_at(1), batch, max_policy_lag=1, audit_params={2: PARAMS[1]})
    with pytest.raises(TypeError, match="audit_params must be a dict"):
        train_step(_at(1), batch, max_policy_lag=1, audit_params=[PARAMS[0]])


def test_bf16_compute_reproduces_a_bf16_sampler_exactly():
    """compute_dtype="bfloat16": the step's log-probs are the bits of an engine that sampled
    with the bf16 cast of the params (ModelConfig.dtype "bfloat16"), so the gate holds at
    tolerance 0; the same batch sampled in fp32 is off by bf16 rounding and is refused."""
    bf16 = jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), PARAMS[0])
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 23)]
    sp = SamplingParams(n=3, max_new_tokens=10, temperature=0.9, top_k=12)
    for dtype, params in (("bfloat16", bf16), ("float32", PARAMS[0])):
        engine = RolloutEngine(dataclasses.replace(CONFIG, dtype=dtype),
                               CacheConfig(num_pages=64, page_size=8))
        batch = engine.rollout(params, 0, prompts, sp, rng=jax.random.key(0))
        train = make_batch(batch, [float(i % 2) for i in range(len(batch.samples))])
        if dtype == "float32":
            with pytest.raises(AttributionFailure, match="no update applied"):
                train_step(_state(), train, compute_dtype="bfloat16", audit_tolerance=TOL)
            continue
        state, metrics = train_step(_state(), train, compute_dtype="bfloat16",
                                    audit_tolerance=TOL)
        assert int(state.version) == 1 and float(metrics["logprob_mismatch_max"]) == 0.0
        assert float(metrics["ratio_max"]) == 1.0


def test_a_bf16_step_audits_an_engine_holding_the_bf16_cast_in_the_step(monkeypatch):
    """--compute-dtype bfloat16: an engine whose ModelConfig.dtype is bf16 is handed the
    fp32 master params and holds their cast (bits equal to being handed the cast), so the
    bf16 step reproduces its log-probs: grpo_step checks every token in the step (nothing
    recomputed outside, mismatch 0). With two mini-batches the separate pass casts the fp32
    history params the same way and passes every token; against an fp32 sampler's gate the
    same bf16 samples are refused."""
    calls = _recomputes(monkeypatch)
    engine = RolloutEngine(dataclasses.replace(CONFIG, dtype="bfloat16"),
                           CacheConfig(num_pages=64, page_size=8))
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 23)]
    sp = SamplingParams(n=2, max_new_tokens=10, temperature=0.9, top_k=12)
    ack = engine.sync_weights(PARAMS[0], 0, borrow=True)
    assert ack.copied_bytes == sum(x.size * 2 for x in jax.tree.leaves(PARAMS[0]))
    batch = engine.rollout(PARAMS[0], 0, prompts, sp, rng=jax.random.key(0))
    cast = jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), PARAMS[0])
    again = RolloutEngine(engine.model_config, CacheConfig(num_pages=64, page_size=8))
    same = again.rollout(cast, 0, prompts, sp, rng=jax.random.key(0))
    assert all(a.output_ids == b.output_ids and np.array_equal(a.output_logprobs,
                                                               b.output_logprobs)
               for a, b in zip(batch.samples, same.samples))
    gate = audit.AuditGate.for_engine(engine)
    assert gate.sampler_dtype == "bfloat16"
    rewards = lambda meta, s, text: float(len(s.output_ids) % 2)  # noqa: E731
    one = TrainConfig(compute_dtype="bfloat16")
    r = grpo_step(0, _state(), FixedRollouts([("m", batch)], gate), rewards, decode=str,
                  history=_history(0), train=one).record
    assert calls == [] and r["audit_failed"] == 0 and r["logprob_mismatch_max"] == 0.0
    assert r["audit_checked_tokens"] == r["generated_tokens"] > 0
    two = grpo_step(0, _state(), FixedRollouts([("m", batch)], gate), rewards, decode=str,
                    history=_history(0), train=dataclasses.replace(one, mini_batches=2)).record
    assert calls and two["audit_failed"] == 0
    assert two["audit_checked_tokens"] == r["audit_checked_tokens"]
    with pytest.raises(RuntimeError, match="flagged samples"):
        grpo_step(0, _state(), FixedRollouts([("m", batch)]), rewards, decode=str,
                  history=_history(0), train=dataclasses.replace(one, mini_batches=2))



def test_a_bf16_engine_holds_its_own_layers_as_bits_and_samples_the_same():
    """A bf16 engine holds its own copy of the layers (the fp32 master weights' cast, or a
    copy of bf16 params) as their bits, cast once per sync instead of in every call; lent
    bf16 arrays stay as they are. All three sample the same tokens and log-probs bit for bit;
    the cast offered again at the same version is the same weights (one fingerprint); a NaN
    in the master weights is still refused (checked on the cast's floats, not its bits)."""
    cfg = dataclasses.replace(CONFIG, dtype="bfloat16")
    cast = jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), PARAMS[0])
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 23)]
    sp = SamplingParams(n=2, max_new_tokens=10, temperature=0.9, top_k=12)
    outputs = []
    for params, borrow, held in ((PARAMS[0], False, "uint16"), (cast, False, "uint16"),
                                 (cast, True, "bfloat16")):
        engine = RolloutEngine(cfg, CacheConfig(num_pages=64, page_size=8))
        engine.sync_weights(params, 0, borrow=borrow)
        assert {x.dtype.name for x in jax.tree.leaves(engine._weights.params["layers"])} \
            == {held}
        batch = engine.rollout(params, 0, prompts, sp, rng=jax.random.key(0))
        outputs.append([(s.output_ids, s.output_logprobs.tolist()) for s in batch.samples])
        assert engine.sync_weights(cast, 0).copied_bytes == 0  # the same weights
    assert outputs[0] == outputs[1] == outputs[2]
    bad = jax.tree.map(lambda x: x, PARAMS[0])
    bad["layers"] = {**bad["layers"], "w_up": bad["layers"]["w_up"].at[0, 0, 0].set(np.nan)}
    with pytest.raises(ValueError, match="NaN or Inf"):
        RolloutEngine(cfg, CacheConfig(num_pages=64, page_size=8)).sync_weights(bad, 0)

def _history(*versions):
    history = PolicyHistory(lag=len(versions) - 1)
    for v in versions:
        history.add(v, PARAMS[v])
    return history


def _recomputes(monkeypatch) -> list:
    """The separate audit's teacher-forced passes, counted."""
    calls, real = [], audit.next_token_log_probs

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(audit, "next_token_log_probs", counted)
    return calls


def test_grpo_step_audits_in_the_step(monkeypatch):
    """A synchronous step recomputes nothing outside the train step and still counts every
    sampled token as checked; a bad token raises RuntimeError naming its sample, with no
    update published; with two mini-batches the separate audit checks every token."""
    calls = _recomputes(monkeypatch)
    batch = tasks(seed=7)
    r = grpo_step(0, _state(), FixedRollouts([("m", batch)]), None, decode=str,
                  history=_history(0)).record
    assert calls == [] and r["audit_failed"] == 0 and r["audited_samples"] == 8
    assert r["audit_checked_tokens"] == r["generated_tokens"] == sum(
        e.sampled_tokens for e in batch.episodes)

    k = 5
    bad = dataclasses.replace(batch, episodes=batch.episodes[:k] + [
        _shift(batch.episodes[k], 0)] + batch.episodes[k + 1:])
    rollouts = FixedRollouts([("m", bad)])
    with pytest.raises(RuntimeError, match=rf"flagged samples \[{k}\]"):
        grpo_step(0, _state(), rollouts, None, decode=str, history=_history(0))

    two = grpo_step(0, _state(), FixedRollouts([("m", batch)]), None, decode=str,
                    history=_history(0), train=TrainConfig(mini_batches=2)).record
    assert calls and two["audit_checked_tokens"] == r["audit_checked_tokens"]


def test_grpo_step_audits_older_versions_in_the_step(monkeypatch):
    """Trainer at version 1, tokens of 0 and 1: the train step checks both (version 0 scored
    with its own params on the step's packed micro-batches), nothing is recomputed outside
    it, and together every sampled token is counted; audit_samples=2 bounds only a separate
    audit, so every sample still counts as audited. A version-0 token off its record
    refuses the update (the sample named, nothing published); a version without params is
    left to the separate pass, which flags it. The history lets go of version 0 once no
    pending call can hold it; with two mini-batches the separate pass checks every token."""
    calls = _recomputes(monkeypatch)
    mixed = _two_versions()
    rewards = lambda meta, e, text: float(e.reward)  # noqa: E731
    history = _history(0, 1)
    r = grpo_step(0, _at(1), FixedRollouts([("m", mixed)]), rewards, decode=str,
                  history=history).record
    assert calls == [] and r["audit_failed"] == 0 and r["logprob_mismatch_max"] == 0.0
    assert r["audit_checked_tokens"] == sum(e.sampled_tokens for e in mixed.episodes)
    assert set(history.params) == {1, 2}  # version 0: no pending call holds it
    r = grpo_step(0, _at(1), FixedRollouts([("m", mixed)]), rewards, decode=str,
                  history=_history(0, 1), audit_samples=2).record
    assert r["audited_samples"] == 6 and calls == []

    e = mixed.episodes[2]
    logprobs = np.array(e.logprobs)
    logprobs[np.flatnonzero(np.asarray(e.token_versions) == 0)[0]] += np.float32(1e-3)
    bad = dataclasses.replace(mixed, episodes=mixed.episodes[:2] + [
        dataclasses.replace(e, logprobs=logprobs)] + mixed.episodes[3:])
    rollouts = FixedRollouts([("m", bad)])
    with pytest.raises(RuntimeError, match=r"flagged samples \[2\]"):
        grpo_step(0, _at(1), rollouts, rewards, decode=str, history=_history(0, 1))
    # a version-1 token off (the step's own check refuses after version 0 passed its
    # scoring and the history let it go): that sample alone is named, no version missing
    logprobs = np.array(e.logprobs)
    logprobs[np.flatnonzero(np.asarray(e.token_versions) == 1)[0]] += np.float32(1e-3)
    own = dataclasses.replace(mixed, episodes=mixed.episodes[:2] + [
        dataclasses.replace(e, logprobs=logprobs)] + mixed.episodes[3:])
    with pytest.raises(RuntimeError, match=r"flagged samples \[2\] .*missing versions \[\]"):
        grpo_step(0, _at(1), FixedRollouts([("m", own)]), rewards, decode=str,
                  history=_history(0, 1))
    with pytest.raises(RuntimeError, match=r"missing versions \[0\]"):
        grpo_step(0, _at(1), FixedRollouts([("m", mixed)]), rewards, decode=str,
                  history=_history(1), max_policy_lag=1)

    two = grpo_step(0, _at(1), FixedRollouts([("m", mixed)]), rewards, decode=str,
                    history=_history(0, 1), train=TrainConfig(mini_batches=2)).record
    assert calls and two["audit_checked_tokens"] == sum(e.sampled_tokens
                                                        for e in mixed.episodes)


def _noisy(batch, by: float):
    """The batch with every recorded log-prob moved by `by`: a sampler that is not exact
    (a GPU's, whose log-probs sit ~1e-4 off the trainer's)."""
    return dataclasses.replace(batch, episodes=[
        dataclasses.replace(e, logprobs=e.logprobs + np.float32(by)) for e in batch.episodes])


def inexact(parts, exact_after=audit.EXACT_EVIDENCE_TOKENS):
    """FixedRollouts of an engine `tolerance_for` calls inexact (a GPU, a mesh)."""
    return FixedRollouts(parts, audit.AuditGate.start(audit.CALIBRATED_TOLERANCE, exact_after))


def test_tolerance_for_a_gpu_engine_is_calibrated():
    """Exactness rests on XLA:CPU's dots: an engine on a GPU device (xla or interpret
    backend, one device, a head size the CPU probe passes) is audited at the calibrated
    tolerance, the same engine on a CPU device compares bits."""
    import types
    engine = RolloutEngine(CONFIG, CacheConfig(num_pages=16, page_size=4))
    assert audit.tolerance_for(engine) == 0.0 and audit.exact_platform(engine)
    gpu = types.SimpleNamespace(device=types.SimpleNamespace(platform="gpu"), mesh=None,
                                backend="xla", model_config=CONFIG)
    assert not audit.exact_platform(gpu)
    assert audit.tolerance_for(gpu) == audit.CALIBRATED_TOLERANCE


def test_an_inexact_run_calibrates_its_tolerance_at_the_first_step():
    """The first step of an inexact run gates at the ceiling and measures the floor (its
    samples cannot be stale); later steps gate at 10x that floor: noise under it passes, a
    stale-sized error over it refuses the update. A first step off by more than the ceiling
    is no rounding noise: refused. An exact run stays at 0 with no floor."""
    batch = tasks(seed=11)
    rollouts = inexact([("m", _noisy(batch, 2e-4))])
    r = grpo_step(0, _state(), rollouts, None, decode=str, history=_history(0)).record
    assert r["audit_tolerance"] == audit.CALIBRATION_CEILING
    assert r["audit_floor"] == pytest.approx(2e-4, rel=0.05) == rollouts.gate.floor
    assert rollouts.gate.tolerance == pytest.approx(2e-3, rel=0.05)

    rollouts.parts = [("m", _noisy(batch, 1.5e-3))]
    r = grpo_step(1, _state(), rollouts, None, decode=str, history=_history(0)).record
    assert r["audit_tolerance"] == rollouts.gate.tolerance and r["audit_failed"] == 0
    rollouts.parts = [("m", _noisy(batch, 5e-3))]
    with pytest.raises(RuntimeError, match="flagged samples"):
        grpo_step(2, _state(), rollouts, None, decode=str, history=_history(0))

    with pytest.raises(RuntimeError, match="flagged samples"):
        grpo_step(0, _state(), inexact([("m", _noisy(batch, 0.1))]), None,
                  decode=str, history=_history(0))
    quiet = inexact([("m", batch)])  # a floor of 0 keeps the minimum
    grpo_step(0, _state(), quiet, None, decode=str, history=_history(0))
    assert quiet.gate.floor == 0.0 and quiet.gate.tolerance == audit.CALIBRATED_TOLERANCE
    r = grpo_step(0, _state(), FixedRollouts([("m", batch)]), None, decode=str,
                  history=_history(0)).record
    assert r["audit_tolerance"] == 0.0 and r["audit_floor"] is None


def test_a_calibrated_run_that_keeps_exact_bits_adopts_tolerance_0():
    """A calibrated run (a GPU, a mesh) counts the tokens its steps reproduce bit for bit;
    past rl.audit.EXACT_EVIDENCE_TOKENS with none off it compares bits, so an error far
    under the calibrated tolerance (stale KV after a small update) is then refused, and the
    error says why the tolerance is 0."""
    batch = tasks(seed=11)
    per_step = grpo_step(0, _state(), inexact([("m", batch)]), None, decode=str,
                         history=_history(0)).record["audit_checked_tokens"]
    rollouts = inexact([("m", batch)], exact_after=2 * per_step)
    first = grpo_step(0, _state(), rollouts, None, decode=str, history=_history(0)).record
    assert per_step > 0 and first["audit_exact_tokens"] == per_step
    assert rollouts.gate.tolerance == audit.CALIBRATED_TOLERANCE  # not enough evidence yet
    second = grpo_step(1, _state(), rollouts, None, decode=str, history=_history(0)).record
    assert second["audit_tolerance"] == audit.CALIBRATED_TOLERANCE  # this step's gate
    assert second["audit_exact_tokens"] == 2 * per_step and rollouts.gate.tolerance == 0.0
    rollouts.parts = [("m", _noisy(batch, 1e-6))]  # 500x under the calibrated tolerance
    with pytest.raises(RuntimeError, match="flagged samples") as failure:
        grpo_step(2, _state(), rollouts, None, decode=str, history=_history(0))
    assert "at tolerance 0" in str(failure.value)
    assert any("reproduced all" in note for note in failure.value.__notes__)
    assert rollouts.gate.exact_tokens == -1 and rollouts.gate.tolerance == 0.0  # ended


def test_exact_after_none_keeps_a_calibrated_run_calibrated():
    batch = tasks(seed=11)
    rollouts = inexact([("m", batch)], exact_after=None)  # SyncRollouts(..., exact_after=None)
    for step in range(3):
        r = grpo_step(step, _state(), rollouts, None, decode=str, history=_history(0)).record
    assert r["audit_exact_tokens"] == 3 * r["audit_checked_tokens"] > 0
    assert rollouts.gate.tolerance == audit.CALIBRATED_TOLERANCE


def test_an_exact_engines_audit_failure_is_the_audit_error():
    """An exact engine's rollouts (tolerance 0, no count: audit_exact_tokens None) flag a
    sample off by 1e-6 with the audit's own error, nothing else."""
    from jaxrl_cache.errors import AuditError
    from jaxrl_cache.rl.loop import SyncRollouts
    engine = RolloutEngine(CONFIG, CacheConfig(num_pages=16, page_size=4))
    sync = SyncRollouts(engine, None, SamplingParams(), calls=1, key=jax.random.key(0))
    assert sync.gate == audit.AuditGate()  # tolerance 0, no count: never changes
    with pytest.raises(AuditError, match="flagged samples"):
        grpo_step(0, _state(), FixedRollouts([("m", _noisy(tasks(seed=11), 1e-6))]), None,
                  decode=str, history=_history(0))


def test_one_difference_keeps_a_calibrated_run_calibrated():
    """A difference under the tolerance (rounding noise of an inexact sampler) ends the
    count for the run: later exact steps do not bring tolerance 0 back."""
    batch = tasks(seed=11)
    rollouts = inexact([("m", _noisy(batch, 1e-5))], exact_after=1)
    r = grpo_step(0, _state(), rollouts, None, decode=str, history=_history(0)).record
    assert r["audit_exact_tokens"] == -1 and rollouts.gate.tolerance > 0
    rollouts.parts = [("m", batch)]
    r = grpo_step(1, _state(), rollouts, None, decode=str, history=_history(0)).record
    assert r["audit_exact_tokens"] == -1
    assert rollouts.gate.tolerance == audit.CALIBRATED_TOLERANCE


def test_exact_evidence_counts_until_the_first_difference():
    assert audit.exact_evidence(0, 0.0, 100) == 100
    assert audit.exact_evidence(100, 0.0, 0) == 100
    assert audit.exact_evidence(100, 1e-9, 50) == -1
    assert audit.exact_evidence(-1, 0.0, 50) == -1
    assert audit.exact_evidence(10, float("inf"), 5) == -1


def test_the_gate_is_a_value_the_rollouts_source_holds():
    """grpo_step replaces the source's gate with a new value (never edits one in place); a
    source without one is a one-line TypeError before any rollout."""
    batch = tasks(seed=11)
    start = audit.AuditGate.start(audit.CALIBRATED_TOLERANCE)
    rollouts = FixedRollouts([("m", batch)], start)
    grpo_step(0, _state(), rollouts, None, decode=str, history=_history(0))
    assert start == audit.AuditGate.start(audit.CALIBRATED_TOLERANCE)  # untouched
    assert rollouts.gate.floor == 0.0 and rollouts.gate.exact_tokens > 0

    class NoGate:
        def get(self, step, state):
            raise AssertionError("rolled out without a gate")

    with pytest.raises(TypeError, match="NoGate.gate must be an rl.audit.AuditGate"):
        grpo_step(0, _state(), NoGate(), None, decode=str, history=_history(0))
    with pytest.raises(ValueError, match="AuditGate.tolerance must be"):
        audit.AuditGate(tolerance=float("nan"))


def test_a_donating_step_names_the_refused_sample_with_the_state_it_carries():
    """TrainConfig(donate=True) (the CLI's synchronous loop): the refused step deleted the
    arrays the history held for its version, so grpo_step names the flagged sample with the
    unchanged state the AttributionFailure carries (it raised "Array has been deleted"
    before), and that state is intact."""
    batch = tasks(seed=7)
    k = 2
    bad = dataclasses.replace(batch, episodes=batch.episodes[:k] + [
        _shift(batch.episodes[k], 1)] + batch.episodes[k + 1:])
    state = _state().replace(params=jax.tree.map(jax.numpy.copy, PARAMS[0]))
    history = PolicyHistory(lag=0)
    history.seed(0, state.model_params)  # what the demo does: the state's very arrays
    with pytest.raises(RuntimeError, match=rf"flagged samples \[{k}\]") as failed:
        grpo_step(0, state, FixedRollouts([("m", bad)]), None, decode=str, history=history,
                  train=TrainConfig(donate=True))
    carried = failed.value.__context__.state
    assert isinstance(failed.value.__context__, AttributionFailure)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(carried.params),
                                                    jax.tree.leaves(PARAMS[0])))
