"""Bad input at every entry point outside the engine: a typed error naming the argument,
raised before any change; then random junk (hypothesis) at all of them."""
import dataclasses
import math
import tempfile

import jax.numpy as jnp
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jaxrl_cache.cache import RadixCache
from jaxrl_cache.errors import (CacheFullError, PinnedPagesError, StalenessError,
                                VersionError)
from jaxrl_cache.rl.audit import audit_attribution
from jaxrl_cache.rl.checkpoint import CheckpointError, restore_checkpoint, save_checkpoint
from jaxrl_cache.rl.batch import make_batch
from jaxrl_cache.rl.train import NonFiniteUpdate, TrainState, optimizer_counts, train_step
from jaxrl_cache.rl.train_config import TrainConfig
from jaxrl_cache.rollout.sampling import SamplingParams
from jaxrl_cache.rollout.types import CacheConfig, RolloutBatch, Sample, SchedulerConfig
from jaxrl_cache.versioning import MAX_VERSION, as_version
from tests.helpers import CONFIG, varied_params

TYPED = (ValueError, TypeError, VersionError, StalenessError, CacheFullError, CheckpointError,
         PinnedPagesError)
NAN, INF = float("nan"), float("inf")


def sample(prompt, output, version=0, group=0, logprobs=None):
    lp = np.full(len(output), -1.0, np.float32) if logprobs is None else logprobs
    return Sample(prompt_ids=tuple(prompt), output_ids=tuple(output),
                  output_logprobs=np.asarray(lp, np.float32), behavior_version=version,
                  token_versions=np.full(len(output), version, np.int64), cached_tokens=0,
                  finish_reason="length", group=group)


def rollout_batch(samples, sp=SamplingParams(n=2, max_new_tokens=4)):
    return RolloutBatch(samples=samples, version=0, sampling=sp, prefill_tokens=0,
                        reused_tokens=0, cached_tokens=0, decode_steps=0, decode_chunks=0,
                        prefill_launches=0, seconds=0.0)


ROLLOUTS = rollout_batch([sample([1, 2, 3], [4, 5]), sample([1, 2, 3], [6, 7, 8])])


@pytest.fixture(scope="module")
def state():
    return TrainState.create(varied_params(0), config=CONFIG, lr_schedule=1e-3)


@pytest.fixture(scope="module")
def batch():
    return make_batch(ROLLOUTS, [1.0, 0.0])


# ------------------------------------------------------------------ numbers


def test_versions_are_bounded_to_int32():
    assert as_version(MAX_VERSION) == MAX_VERSION and as_version(np.int64(7)) == 7
    assert as_version(jnp.int32(3)) == 3
    for bad in (MAX_VERSION + 1, 2**63, -1):
        with pytest.raises(VersionError, match="int32"):
            as_version(bad)
    for bad in (True, 2.0, "3", None, np.array([1])):
        with pytest.raises(TypeError, match="version must be an integer"):
            as_version(bad)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(temperature=NAN), ValueError, "temperature must be finite"),
    (dict(temperature=INF), ValueError, "temperature must be finite"),
    (dict(temperature=-0.5), ValueError, "temperature"),
    (dict(temperature="1"), TypeError, "temperature must be a real number"),
    (dict(top_p=NAN), ValueError, "top_p"), (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_k=2.5), TypeError, "top_k must be an integer"),
    (dict(top_k=NAN), TypeError, "top_k must be an integer"),
    (dict(top_k=-1), ValueError, "top_k"),
    # an int32 on the device: 2**40 used to reach the rollout and raise OverflowError there
    (dict(top_k=2**40), ValueError, r"top_k must be in \[0, 2147483647\]"),
    (dict(top_k=np.int64(2**31)), ValueError, r"top_k must be in \[0, 2147483647\]"),
    (dict(n=True), TypeError, "n must be an integer, got bool"),
    (dict(n=0), ValueError, "n must be >= 1"), (dict(n=2.0), TypeError, "n must be"),
    (dict(max_new_tokens=False), TypeError, "max_new_tokens"),
    (dict(stop_token_ids=3), TypeError, "stop_token_ids must be a sequence"),
    (dict(stop_token_ids="ab"), TypeError, "stop_token_ids must be a sequence"),
    (dict(stop_token_ids=(1, 2.0)), TypeError, r"stop_token_ids\[1\]"),
    (dict(stop_token_ids=(-1,)), ValueError, r"stop_token_ids\[0\]"),
])
def test_sampling_params_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_numpy_numbers():
    sp = SamplingParams(n=np.int64(4), max_new_tokens=np.int32(8), temperature=np.float32(0.5),
                        top_k=np.int16(3), stop_token_ids=np.array([2, 5]))
    assert (sp.n, sp.max_new_tokens, sp.top_k, sp.stop_token_ids) == (4, 8, 3, (2, 5))
    assert all(type(v) is int for v in (sp.n, sp.max_new_tokens, sp.top_k, *sp.stop_token_ids))
    assert type(sp.temperature) is float and sp.temperature == 0.5


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(num_pages=64.0), TypeError, "num_pages must be an integer"),
    (dict(num_pages="64"), TypeError, "num_pages"), (dict(num_pages=1), ValueError, "num_pages"),
    (dict(num_pages=2**40), ValueError, "num_pages"),
    (dict(page_size=16.0), TypeError, "page_size"), (dict(page_size=0), ValueError, "page_size"),
    (dict(page_size=True), TypeError, "page_size"),
    (dict(prefix_cache="yes"), TypeError, "prefix_cache must be a bool"),
])
def test_cache_config_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        CacheConfig(**kwargs)
    assert CacheConfig(num_pages=np.int64(8)).num_pages == 8


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(max_num_seqs=True), TypeError, "max_num_seqs must be an integer"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs must be in"),
    (dict(chunk_steps=2.0), TypeError, "chunk_steps must be an integer"),
    (dict(max_prefill_tokens=-1), ValueError, "max_prefill_tokens"),
])
def test_scheduler_config_refused(kwargs, error, match):
    """The same checks (checks.as_count) and error types as every other config."""
    with pytest.raises(error, match=match):
        SchedulerConfig(**kwargs)
    assert type(SchedulerConfig(max_num_seqs=np.int64(8)).max_num_seqs) is int


@pytest.mark.parametrize("bad", [1, 0, "yes", None, np.int64(1)])
def test_every_flag_takes_bools_only(bad):
    """One check (checks.as_bool) behind every bool argument: numpy bools pass as Python
    bools, anything else is a TypeError naming the argument."""
    makers = {"prefix_cache": lambda v: CacheConfig(prefix_cache=v),
              "include_stop_str_in_output": lambda v: SamplingParams(
                  include_stop_str_in_output=v),
              "donate": lambda v: TrainConfig(donate=v)}
    for name, make in makers.items():
        with pytest.raises(TypeError, match=f"{name} must be a bool"):
            make(bad)
    assert CacheConfig(prefix_cache=np.bool_(False)).prefix_cache is False
    assert TrainConfig(donate=np.bool_(True)).donate is True


# ------------------------------------------------------------------ batches and steps


@pytest.mark.parametrize("rollouts,rewards,error,match", [
    (rollout_batch([]), [], ValueError, "batch 0 has no samples"),
    ([], [], ValueError, "at least one"),
    (None, [1.0], TypeError, "rollouts must be a RolloutBatch"),
    ([ROLLOUTS, "x"], [1.0], TypeError, "rollouts must be"),
    (ROLLOUTS, [1.0, NAN], ValueError, r"rewards must be finite, got rewards\[1\]"),
    (ROLLOUTS, [INF, 0.0], ValueError, r"rewards\[0\]"),
    (ROLLOUTS, [0.0, 1e39], ValueError, r"rewards must fit float32 .*, got rewards\[1\] = 1e\+39"),
    (ROLLOUTS, [1.0], ValueError, r"rewards must be \[N=2\]"),
    (ROLLOUTS, ["a", "b"], TypeError, "rewards must be numbers"),
    (rollout_batch([sample([1, 2], [3, 4], logprobs=[-1.0, NAN])]), [1.0], ValueError,
     "sample 0 has non-finite or misshapen behavior logprobs"),
    (rollout_batch([sample([1, 2], [3, 4]), dataclasses.replace(
        sample([1, 2], [3, 4]), token_versions=np.zeros(3, np.int64))]), [1.0, 0.0], ValueError,
     r"sample 1: token_versions must be integers \[2\]"),
    (rollout_batch([dataclasses.replace(sample([1, 2], [3, 4]), token_versions=np.array(
        [0.0, 1.0]))]), [1.0], ValueError, "sample 0: token_versions must be integers"),
    (rollout_batch([dataclasses.replace(sample([1, 2], [3, 4]), token_versions=np.array(
        [0, -1]))]), [1.0], ValueError, r"sample 0: token_versions must lie in"),
])
def test_make_batch_refused(rollouts, rewards, error, match):
    with pytest.raises(error, match=match):
        make_batch(rollouts, rewards)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(max_policy_lag=-1), ValueError, "max_policy_lag"),
    (dict(max_policy_lag=1.5), TypeError, "max_policy_lag must be an integer"),
    (dict(max_policy_lag=True), TypeError, "max_policy_lag"),
    (dict(clip_eps=NAN), ValueError, "clip_eps must be finite"),
    (dict(clip_eps=0.0), ValueError, "clip_eps"),
    (dict(dual_clip=NAN), ValueError, "dual_clip"), (dict(dual_clip=0.5), ValueError, "dual_clip"),
    (dict(correction="ppo"), ValueError, r"correction must be one of \('none', 'decoupled'\)"),
    (dict(correction=None), TypeError, "correction must be a str"),
    (dict(correction="decoupled", is_cap=0.5), ValueError, "is_cap must be finite and >= 1"),
    (dict(correction="decoupled", is_cap=INF), ValueError, "is_cap must be finite"),
])
def test_train_step_arguments_refused(state, batch, kwargs, error, match):
    with pytest.raises(error, match=match):
        train_step(state, batch, **kwargs)


def test_train_step_refuses_none_nan_lr_overflow_and_nan_results(state, batch):
    with pytest.raises(TypeError, match="state must be a TrainState"):
        train_step(None, batch)
    with pytest.raises(TypeError, match="batch must be a TrainBatch"):
        train_step(state, None)
    with pytest.raises(ValueError, match="lr_schedule must be finite"):
        TrainState.create(state.params, config=CONFIG, lr_schedule=NAN)
    for lr in (NAN, INF):
        bad_lr = TrainState.create(state.params, config=CONFIG, version=2,
                                   lr_schedule=lambda v, lr=lr: jnp.where(v < 2, 1e-3, lr))
        with pytest.raises(ValueError, match=r"lr_schedule\(2\) = (nan|inf)"):
            train_step(bad_lr, batch)
    last = TrainState.create(state.params, config=CONFIG, version=MAX_VERSION)
    with pytest.raises(VersionError, match="would pass the largest int32 version"):
        train_step(last, batch)
    with pytest.raises(ValueError, match="lr_schedule must be finite and >= 0"):
        TrainState.create(state.params, config=CONFIG, lr_schedule=-1e-3)
    with pytest.raises(ValueError, match=r"lr_schedule\(0\) = -0.001 must be finite and >= 0"):
        train_step(TrainState.create(state.params, config=CONFIG,
                                     lr_schedule=lambda v: -1e-3 + 0 * v), batch)
    # a batch whose importance ratios overflow: the step raises instead of returning NaN params
    poisoned = dataclasses.replace(batch, behavior_logprobs=tuple(
        b - 1e38 for b in batch.behavior_logprobs))
    own = TrainState.create(varied_params(0), config=CONFIG, lr_schedule=1e-3)
    for donate, updates in ((False, 1), (True, 1), (True, 2)):  # one update skips itself
        with pytest.raises(NonFiniteUpdate, match="non-finite params") as failed:
            train_step(own, poisoned, donate=donate, mini_batches=updates)
        own = failed.value.state  # the input state, whole even when its buffers were donated
        assert int(own.version) == 0 and optimizer_counts(own.opt_state) == [0]
        for x, y in zip(jax.tree.leaves(own.params), jax.tree.leaves(varied_params(0))):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert int(state.version) == 0 and optimizer_counts(state.opt_state) == [0]
    good, m = train_step(state, batch, max_policy_lag=np.int64(0))
    assert int(good.version) == 1 and math.isfinite(float(m["loss"]))


def test_audit_tolerance_must_be_finite():
    for bad, error in ((NAN, ValueError), (-1.0, ValueError), (INF, ValueError),
                       ("0.1", TypeError)):
        with pytest.raises(error, match="tolerance"):
            audit_attribution(ROLLOUTS, {}, CONFIG, tolerance=bad)
    with pytest.raises(TypeError, match="batch must be a RolloutBatch"):
        audit_attribution(None, {}, CONFIG)
    with pytest.raises(TypeError, match="params_by_version must be a mapping"):
        audit_attribution(ROLLOUTS, [], CONFIG)
    report = audit_attribution(ROLLOUTS, {}, CONFIG)  # no params: every sample flagged
    assert not report.ok and report.missing_versions == (0,)


# ------------------------------------------------------------------ random junk

JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4), st.binary(max_size=3),
    st.lists(st.integers(-3, 40), max_size=5), st.lists(st.floats(), max_size=3),
    st.tuples(st.integers(0, 40), st.text(max_size=2)), st.dictionaries(st.text(max_size=2),
                                                                       st.integers(), max_size=2),
    st.sampled_from([np.float32("nan"), np.int64(3), np.bool_(True), np.array([1, 2]),
                     np.zeros((2, 2)), object(), {1, 2}, (i for i in range(3)), b"\x00"]))

SP_FIELDS = ["n", "max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids"]


def typed_or_valid(fn):
    """Calls fn; returns (True, result) or (False, error) for a typed error; anything else
    (an untyped error from deep inside a library) fails the test."""
    try:
        return True, fn()
    except TYPED as e:
        assert str(e), "an error must say what was wrong"
        return False, e


@settings(max_examples=100, deadline=None)
@given(field=st.sampled_from(SP_FIELDS + ["num_pages", "page_size", "prefix_cache"]),
       value=JUNK)
def test_junk_configs(field, value):
    cls = SamplingParams if field in SP_FIELDS else CacheConfig
    ok, out = typed_or_valid(lambda: cls(**{field: value}))
    if ok:
        got = getattr(out, field)
        if isinstance(got, float):
            assert math.isfinite(got)
        assert not isinstance(got, np.generic)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(["rollouts", "rewards", "budget", "state", "batch", "lag", "clip",
                              "dual", "correction", "is_cap", "audit_batch", "audit_params",
                              "audit_tol", "loss_type", "mini_batches", "kl_beta"]),
       value=JUNK)
def test_junk_training_entry_points(state, batch, which, value):
    calls = {
        "rollouts": lambda: make_batch(value, [1.0, 0.0]),
        "rewards": lambda: make_batch(ROLLOUTS, value),
        "budget": lambda: train_step(state, batch, token_budget=value),
        "loss_type": lambda: train_step(state, batch, loss_type=value),
        "mini_batches": lambda: train_step(state, batch, mini_batches=value),
        "kl_beta": lambda: train_step(state, batch, kl_beta=value, ref_params=state.params),
        "state": lambda: train_step(value, batch),
        "batch": lambda: train_step(state, value),
        "lag": lambda: train_step(state, batch, max_policy_lag=value),
        "clip": lambda: train_step(state, batch, clip_eps=value),
        "dual": lambda: train_step(state, batch, dual_clip=value),
        "correction": lambda: train_step(state, batch, correction=value),
        "is_cap": lambda: train_step(state, batch, correction="decoupled", is_cap=value),
        "audit_batch": lambda: audit_attribution(value, {}, CONFIG),
        "audit_params": lambda: audit_attribution(ROLLOUTS, value, CONFIG),
        "audit_tol": lambda: audit_attribution(ROLLOUTS, {}, CONFIG, tolerance=value),
    }
    typed_or_valid(calls[which])
    assert int(state.version) == 0 and optimizer_counts(state.opt_state) == [0]


@pytest.fixture(scope="module")
def saved(state, tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt") / "run"
    save_checkpoint(d, state)
    return d


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(["dir", "state", "keep", "template", "step"]), value=JUNK)
def test_junk_checkpoint_entry_points(state, saved, which, value):
    before = sorted(p.name for p in saved.rglob("*"))
    with tempfile.TemporaryDirectory() as tmp:
        calls = {
            # a junk directory is never a str/path here: junk text would be a real path
            "dir": lambda: save_checkpoint(value if not isinstance(value, (str, bytes))
                                           else None, state),
            "state": lambda: save_checkpoint(f"{tmp}/c", value),
            "keep": lambda: save_checkpoint(f"{tmp}/c", state, max_to_keep=value),
            "template": lambda: restore_checkpoint(saved, value),
            "step": lambda: restore_checkpoint(saved, state, step=value),
        }
        typed_or_valid(calls[which])
    assert sorted(p.name for p in saved.rglob("*")) == before


def cache_state(cache):
    nodes = cache.page_entries()
    return (cache.pool.refcount.tobytes(), cache.pool.num_free, cache._in_trie.tobytes(),
            nodes, tuple(cache._counters.items()))


@settings(max_examples=200, deadline=None)
@given(which=st.sampled_from(["match_v", "match_t", "insert_v", "insert_t", "insert_p",
                              "alloc", "acquire_p", "acquire_n", "evict", "invalidate",
                              "release"]),
       value=JUNK)
def test_junk_cache_calls(which, value):
    cache = RadixCache(10, 4)
    held = np.concatenate([cache.match(0, [1] * 8).pages, cache.alloc(2)])
    cache.insert(0, [1] * 8, held)
    before = cache_state(cache)
    calls = {
        "match_v": lambda: cache.match(value, [1] * 8),
        "match_t": lambda: cache.match(0, value),
        "insert_v": lambda: cache.insert(value, [2] * 4, held[:1]),
        "insert_t": lambda: cache.insert(0, value, held),
        "insert_p": lambda: cache.insert(0, [3] * 8, value),
        "alloc": lambda: cache.alloc(value),
        "acquire_p": lambda: cache.acquire(0, value, 1),
        "acquire_n": lambda: cache.acquire(0, [[1] * 8], value),
        "evict": lambda: cache.evict(value),
        "invalidate": lambda: cache.invalidate_before(value),
        "release": lambda: cache.release(value),
    }
    ok, _ = typed_or_valid(calls[which])
    if not ok:
        assert cache_state(cache) == before
    cache.check_invariants()


@pytest.mark.parametrize("huge", [10**400, -10**400], ids=["plus", "minus"])
def test_a_huge_integer_for_a_real_is_a_value_error(huge):
    """float(10**400) raises OverflowError: every real argument turns it into the library's
    one-line ValueError (issue 32, defect 7)."""
    from jaxrl_cache.checks import as_real
    from jaxrl_cache.rl.audit import audit_attribution
    with pytest.raises(ValueError, match="must be finite.*integer of 1329 bits"):
        as_real(huge, "audit_tolerance", minimum=0.0)
    with pytest.raises(ValueError, match="temperature must be finite"):
        SamplingParams(temperature=huge)
    with pytest.raises(ValueError, match="tolerance must be finite"):
        audit_attribution(RolloutBatch([], 0, SamplingParams(), 0, 0, 0, 0, 0, 0, 0.0), {},
                          CONFIG, tolerance=huge)


@pytest.mark.parametrize("field", ["rope_theta", "rms_norm_eps", "max_position_embeddings",
                                   "hidden_size"])
def test_a_huge_integer_elsewhere_is_a_typed_error(field):
    """10**400 where a real is read: make_batch rewards, a reward function's value in
    grpo_step (through rl.rewards) and config.json fields are the library's one-line
    errors, never OverflowError (issue 32, defect 7)."""
    import json
    from types import SimpleNamespace
    from jaxrl_cache.models.hf import ConfigError, config_from_hf
    from jaxrl_cache.rl.rewards import RewardFn, Rewards
    with pytest.raises(ValueError, match="rewards must be finite"):
        make_batch(ROLLOUTS, [1.0, 10**400])
    items = [(None, SimpleNamespace(group=0), "")]
    with pytest.raises(ValueError, match="'huge' on sample 0.*must be finite.*1329 bits"):
        Rewards.of(RewardFn(lambda *_: 10**400, name="huge")).score(0, items, str)
    assert [Rewards.of(lambda *_: v).score(0, items, str).totals for v in
            (True, np.float32(0.5))] == [[1.0], [0.5]]
    from tests.hf_fixtures import FIXTURES
    hf = json.loads((FIXTURES / "qwen2" / "config.json").read_text())
    with pytest.raises(ConfigError, match=field):
        config_from_hf(dict(hf, **{field: 10**400}), source="config.json")
