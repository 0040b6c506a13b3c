"""RolloutWorker + SampleBuffer: continuous generation at the latest version, bounded
staleness, every call delivered exactly once, failures surfaced to the trainer; the worker
never spins behind the engine, `get` takes all or nothing within one deadline, resumed
workers continue the call numbering."""
import collections
import threading
import time
import types

import jax
import numpy as np
import pytest

from jaxrl_cache import (CacheConfig, Produced, RolloutBatch, RolloutEngine, RolloutWorker,
                         Sample, SampleBuffer, SamplingParams, SchedulerConfig, StalenessError,
                         audit_attribution)
from jaxrl_cache.rollout import worker as worker_module
from jaxrl_cache.rollout.engine import MAX_POLICY_LAG
from tests.helpers import CONFIG, scale_matrices, varied_params

SAMPLING = SamplingParams(n=2, max_new_tokens=8, temperature=1.0)
BASE = varied_params(0)


def params_at(version):
    return scale_matrices(BASE, 1.0 + 0.05 * version)


def source(call):
    return [[1, 2, 3, 4, 5, call % 7 + 6], [1, 2, 3, 9, call % 5 + 10]], call


def engine(policy="recompute"):
    return RolloutEngine(CONFIG, CacheConfig(num_pages=64, page_size=4),
                         scheduler_config=SchedulerConfig(max_num_seqs=4, chunk_steps=2),
                         backend="xla", kv_policy=policy, max_policy_lag=1)


def fake(call, versions):
    samples = [Sample(prompt_ids=(1,), output_ids=(2,) * len(v), output_logprobs=np.zeros(len(v), np.float32),
                      behavior_version=v[0], token_versions=np.asarray(v, np.int64),
                      cached_tokens=0, finish_reason="length", group=0) for v in versions]
    batch = RolloutBatch(samples=samples, version=versions[0][0], sampling=SAMPLING,
                         prefill_tokens=0, reused_tokens=0, cached_tokens=0, decode_steps=0,
                         decode_chunks=0, prefill_launches=0, seconds=0.0)
    return Produced(call, batch, None)


def test_buffer_drops_or_refuses_calls_beyond_the_lag():
    buf = SampleBuffer(4, max_policy_lag=1)
    buf.put(fake(0, [[0, 0], [0, 1]]))
    buf.put(fake(1, [[1, 2]]))
    buf.put(fake(2, [[2, 2]]))
    got = buf.get(2, trainer_version=2)
    assert [p.call for p in got] == [1, 2]
    m = buf.metrics()
    assert m["dropped_calls"] == 1 and m["dropped_samples"] == 2 and m["consumed"] == 2
    assert m["staleness"] == {0: 3, 1: 1}
    strict = SampleBuffer(4, max_policy_lag=0, on_stale="raise")
    strict.put(fake(0, [[3, 4]]))
    with pytest.raises(StalenessError, match="lags the trainer"):
        strict.get(1, trainer_version=4)
    assert [p.call for p in strict.drain()] == [0]  # refused, not taken
    with pytest.raises(TimeoutError):
        strict.get(1, trainer_version=4, timeout=0.01)


def test_buffer_is_bounded_and_the_producer_waits_before_generating():
    buf = SampleBuffer(1, max_policy_lag=0)
    assert buf.reserve()
    buf.put(fake(0, [[0]]))
    done = threading.Event()
    producer = threading.Thread(target=lambda: (buf.reserve(), done.set()))
    producer.start()
    assert not done.wait(0.2)  # full: no place for another call yet
    assert [p.call for p in buf.get(1, 0)] == [0]
    assert done.wait(10)
    producer.join()
    buf.close()
    assert not buf.reserve()  # closed: the worker stops


def test_worker_delivers_every_call_once_within_the_lag():
    eng = engine()
    buf = SampleBuffer(2, max_policy_lag=1)
    worker = RolloutWorker(eng, source, SAMPLING, buf, rng=jax.random.key(0))
    worker.start(params_at(0), 0)
    seen, version = [], 0
    for _ in range(4):
        for item in buf.get(1, version, timeout=120):
            assert version - item.oldest_version <= 1
            assert item.meta == item.call
            seen.append(item.call)
        version += 1
        ack = worker.publish(params_at(version), version)
        assert ack.version == version
    worker.stop(timeout=120)
    rest = [p.call for p in buf.drain()]
    m = buf.metrics()
    delivered = sorted(seen + rest)
    assert len(delivered) + m["dropped_calls"] == worker.calls == m["produced"]
    assert len(set(delivered)) == len(delivered)  # no duplicates
    assert eng.version == 4
    eng.cache.check_invariants()


def test_worker_failure_reaches_the_trainer():
    def broken(call):
        if call == 1:
            raise KeyError("prompt source broke")
        return source(call)

    buf = SampleBuffer(4, max_policy_lag=4)
    worker = RolloutWorker(engine(), broken, SAMPLING, buf, rng=jax.random.key(0))
    worker.start(params_at(0), 0)
    assert [p.call for p in buf.get(1, 0, timeout=120)] == [0]
    with pytest.raises(RuntimeError, match="worker failed") as info:
        buf.get(1, 0, timeout=120)
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(RuntimeError, match="worker failed"):
        worker.stop(timeout=60)


def test_worker_needs_an_asynchronous_engine():
    with pytest.raises(ValueError, match="kv_policy"):
        RolloutWorker(engine("wait"), source, SAMPLING, SampleBuffer(1, 0),
                      rng=jax.random.key(0))


class Hooked:
    """A prompt source that reports each call it is asked for (`asked[c]` is set)."""

    def __init__(self):
        self.asked = collections.defaultdict(threading.Event)

    def __call__(self, call):
        self.asked[call].set()
        return source(call)


def wait_until(predicate, seconds=120):
    for _ in range(int(seconds * 100)):
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached")


def started():
    """An engine at version 0 (PARAMS[0]) and a worker that filled its one-call buffer with
    call 0 and now waits for a place (idle)."""
    eng, hook = engine(), Hooked()
    buf = SampleBuffer(1, max_policy_lag=4)
    worker = RolloutWorker(eng, hook, SAMPLING, buf, rng=jax.random.key(0))
    worker.start(PARAMS[0], 0)
    wait_until(lambda: buf.metrics()["produced"] == 1)
    return eng, buf, worker, hook


PARAMS = [params_at(v) for v in range(4)]


def assert_own_version(item, version):
    """Every token of the call is of `version` and reproduces under its params."""
    assert item.batch.version == version
    assert all((s.token_versions == version).all() for s in item.batch.samples)
    assert audit_attribution(item.batch, dict(enumerate(PARAMS)), CONFIG).ok


def test_a_worker_behind_a_directly_synced_engine_waits_and_stops():
    """The trainer syncs the engine itself: the worker's version is refused and it holds no
    params for the engine's; it must wait (not retry forever) and honour stop."""
    eng, buf, worker, hook = started()
    eng.sync_weights(PARAMS[1], 1)  # not through the worker
    assert [p.call for p in buf.get(1, 1, timeout=120)] == [0]  # frees the place
    assert hook.asked[1].wait(120)  # call 1 starts at version 0: refused
    worker.stop(timeout=60)  # old code: retried forever and never looked at the flag
    assert worker.calls == 1 and buf.metrics()["produced"] == 1


def test_a_worker_behind_the_engine_resumes_at_the_next_publish():
    eng, buf, worker, hook = started()
    eng.sync_weights(PARAMS[1], 1)
    buf.get(1, 1, timeout=120)
    assert hook.asked[1].wait(120)
    worker.publish(PARAMS[2], 2)
    item, = buf.get(1, 2, timeout=120)
    assert item.call == 1
    assert_own_version(item, 2)
    worker.stop(timeout=60)


def test_ctrl_c_after_the_engine_committed_a_publish_does_not_wedge_the_worker(monkeypatch):
    """The deferred SIGINT surfaces right after the engine's sync committed, before the
    worker records the version: the worker adopts the engine's version (it holds its
    params) for its next call."""
    eng, buf, worker, hook = started()
    real = eng.sync_weights

    def committed_then_interrupted(params, version, **options):
        real(params, version, **options)
        raise KeyboardInterrupt

    monkeypatch.setattr(eng, "sync_weights", committed_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        worker.publish(PARAMS[1], 1)
    assert eng.version == 1
    assert [p.call for p in buf.get(1, 1, timeout=120)] == [0]
    item, = buf.get(1, 1, timeout=120)  # old code: call 1 retried version 0 forever
    assert item.call == 1
    assert_own_version(item, 1)
    worker.stop(timeout=60)


def test_a_resumed_worker_continues_the_call_numbering():
    eng = engine()
    buf = SampleBuffer(1, max_policy_lag=0)
    worker = RolloutWorker(eng, source, SAMPLING, buf, rng=jax.random.key(5))
    worker.start(PARAMS[0], 0, first_call=6)
    item, = buf.get(1, 0, timeout=120)
    worker.stop(timeout=60)
    # reference: call 6 of a run from call 0 (its prompts and its key)
    prompts, meta = source(6)
    alone = engine()
    ref = alone.rollout(PARAMS[0], 0, prompts, SAMPLING,
                        rng=jax.random.fold_in(jax.random.key(5), 6))
    assert item.call == 6 and item.meta == meta
    assert [s.output_ids for s in item.batch.samples] == [s.output_ids for s in ref.samples]
    with pytest.raises(ValueError, match="first_call"):
        RolloutWorker(engine(), source, SAMPLING, SampleBuffer(1, 0),
                      rng=jax.random.key(0)).start(PARAMS[0], 0, first_call=-1)


def test_async_rollouts_resume_at_the_call_the_run_reached():
    """demo --async --resume at step 3 (2 calls per step): the worker's first call is 6, the
    prompts and keys the original run used there (the demo passes start_step * calls)."""
    from jaxrl_cache.rl.loop import AsyncRollouts
    asked = []

    def prompts_of(call):
        asked.append(call)
        return source(call)

    state = types.SimpleNamespace(model_params=PARAMS[0], version=3)
    eng = RolloutEngine(CONFIG, CacheConfig(num_pages=64, page_size=4),
                        scheduler_config=SchedulerConfig(max_num_seqs=4, chunk_steps=2),
                        backend="xla", kv_policy="recompute", max_policy_lag=1, version=3)
    rollouts = AsyncRollouts(eng, prompts_of, SAMPLING, calls=2, max_policy_lag=1,
                             key=jax.random.key(0), state=state, first_call=6)
    got = rollouts.get(3, state)
    rollouts.close()
    assert [meta for meta, _ in got] == [6, 7] and asked[:2] == [6, 7]


def test_get_keeps_every_call_when_it_raises():
    for close in (lambda b: None, lambda b: b.close(), lambda b: b.close(KeyError("broke"))):
        buf = SampleBuffer(4, max_policy_lag=1)
        buf.put(fake(0, [[2, 2]]))
        close(buf)
        with pytest.raises((TimeoutError, RuntimeError)):
            buf.get(2, trainer_version=2, timeout=0.01)
        assert buf.metrics()["consumed"] == 0 and buf.metrics()["staleness"] == {}
        assert [p.call for p in buf.drain()] == [0]  # old code: popped, then lost
    strict = SampleBuffer(4, max_policy_lag=0, on_stale="raise")
    strict.put(fake(0, [[4]]))
    strict.put(fake(1, [[3]]))
    with pytest.raises(StalenessError, match="call 1"):
        strict.get(2, trainer_version=4)
    assert [p.call for p in strict.drain()] == [0, 1]


def test_get_drops_stale_calls_while_it_waits():
    """Stale calls free their places (the worker can refill) even if get then times out."""
    buf = SampleBuffer(2, max_policy_lag=0)
    buf.put(fake(0, [[0]]))
    buf.put(fake(1, [[3]]))
    with pytest.raises(TimeoutError):
        buf.get(2, trainer_version=3, timeout=0.01)
    m = buf.metrics()
    assert m["dropped_calls"] == 1 and m["buffered"] == 1 and buf.reserve()


class FakeClock:
    """worker.time stand-in: monotonic() is advanced by hand."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now


def test_get_timeout_bounds_the_whole_call(monkeypatch):
    """A stale call arrives each (fake) second; timeout 2.5 s: get gives up at the third,
    however often it was woken (old code restarted the timeout on every wake-up)."""
    clock = FakeClock()
    monkeypatch.setattr(worker_module, "time", clock)
    buf = SampleBuffer(4, max_policy_lag=0)
    outcome = []
    getter = threading.Thread(target=lambda: outcome.append(
        _raised(lambda: buf.get(1, trainer_version=9, timeout=2.5))))
    getter.start()
    for i in range(20):
        clock.now += 1.0
        buf.put(fake(i, [[0]]))  # stale: dropped by the waiting get
        for _ in range(5000):  # until get has looked at it, or gave up
            if buf.metrics()["buffered"] == 0 or not getter.is_alive():
                break
            time.sleep(0.001)
        if not getter.is_alive():
            break
    getter.join(30)
    assert outcome == [TimeoutError] and i == 2


def _raised(fn):
    try:
        fn()
    except Exception as e:
        return type(e)
    return None


def test_the_policy_lag_is_bounded():
    with pytest.raises(ValueError, match="max_policy_lag"):
        SampleBuffer(1, max_policy_lag=MAX_POLICY_LAG + 1)
    assert SampleBuffer(1, max_policy_lag=MAX_POLICY_LAG).max_policy_lag == MAX_POLICY_LAG


def _async_steps(borrow: bool) -> tuple[list, list]:
    """Five get / publish steps of AsyncRollouts (publishes landing mid-call or between
    calls): (oldest_pending asked before and after each get, each get's calls)."""
    from jaxrl_cache.rl.loop import AsyncRollouts
    state = types.SimpleNamespace(model_params=params_at(0), version=0)
    rollouts = AsyncRollouts(engine(), source, SAMPLING, calls=1, max_policy_lag=1,
                             key=jax.random.key(0), state=state, borrow=borrow)
    bounds, got = [], []
    try:
        for version in range(5):
            bounds.append(rollouts.oldest_pending(version))
            state = types.SimpleNamespace(model_params=params_at(version), version=version)
            got.append(rollouts.get(version, state))
            bounds.append(rollouts.oldest_pending(version))
            time.sleep(0.05 * (version % 2))
            ack = rollouts.publish(types.SimpleNamespace(model_params=params_at(version + 1),
                                                         version=version + 1))
            assert (ack.copied_bytes == 0) == borrow
    finally:
        rollouts.close()
    return bounds, got


@pytest.mark.parametrize("borrow", [False, True])
def test_oldest_pending_bounds_every_later_token(borrow):
    """AsyncRollouts.oldest_pending(v), asked at any moment, is <= every token version of
    every call handed out after it (the policy history lets go of older params then), and
    moves forward. borrow=True: the engine decodes with the published arrays themselves
    (each ack copies 0 bytes)."""
    bounds, got = _async_steps(borrow)
    for k, calls in enumerate(got):
        oldest = min(int(s.token_versions.min()) for _, b in calls for s in b.samples)
        assert all(bound <= oldest for bound in bounds[:2 * k + 1]), (k, bounds, oldest)
    assert max(bounds) >= 3


def test_borrowed_and_copied_weights_sample_the_same_bits():
    """A call with the same token versions samples the same tokens and log-probs whether
    the engine borrowed the trainer's arrays or copied them (the first call always does)."""
    (_, copied), (_, lent) = _async_steps(False), _async_steps(True)
    compared = 0
    for a, b in zip(copied, lent):
        for (_, x), (_, y) in zip(a, b):
            if [s.token_versions.tolist() for s in x.samples] == \
                    [s.token_versions.tolist() for s in y.samples]:
                compared += 1
                assert [s.output_ids for s in x.samples] == [s.output_ids for s in y.samples]
                assert all(np.array_equal(s.output_logprobs, t.output_logprobs)
                           for s, t in zip(x.samples, y.samples))
    assert compared >= 1
