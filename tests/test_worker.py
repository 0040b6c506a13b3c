"""RolloutWorker + SampleBuffer: continuous generation at the latest version, bounded
staleness, every call delivered exactly once, failures surfaced to the trainer."""
import threading

import jax
import numpy as np
import pytest

from jaxrl_cache import (CacheConfig, Produced, RolloutBatch, RolloutEngine, RolloutWorker,
                         Sample, SampleBuffer, SamplingParams, SchedulerConfig, StalenessError)
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
