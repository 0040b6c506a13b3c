"""SIGINT at executed lines of the asynchronous mode's trainer-side calls: RolloutWorker.publish,
SampleBuffer.get and RolloutWorker.stop (the mechanism of test_engine_interrupts: the
installed SIGINT handler is called at a traced line, as CPython does between bytecodes;
only the calling thread is traced, the worker thread runs untraced).

After each: no lock is left held, the handlers are restored, no call is lost or duplicated
(each is returned, still buffered, or dropped as stale and counted), and the worker still
proceeds: its next call runs at the engine's version (it adopts a version whose publish was
interrupted after the engine committed it), and stop returns.

CI runs a fixed, evenly spaced sample of the executed lines (SAMPLE per operation);
JAXRL_FULL_SWEEP=1 (`make test-full`) runs every line."""
import signal

import pytest

from jaxrl_cache import SampleBuffer, StalenessError, audit_attribution
from jaxrl_cache.rollout import worker as worker_module
from tests.helpers import CONFIG, scale_matrices
from tests.test_engine_interrupts import _points, _run_with_interrupt_at
from tests.test_worker import BASE, PARAMS, fake, started, wait_until


def _run(fn, at):
    """fn with SIGINT at traced line `at` (None: none). Returns (interrupted, fn's result or
    the type of its own exception, lines traced)."""
    box = []

    def call():
        try:
            box.append(fn())
        except Exception as e:  # noqa: BLE001 - the op's own outcome (timeout, refusal)
            box.append(type(e))

    try:
        total = _run_with_interrupt_at(call, at)
    except KeyboardInterrupt:
        return True, None, None
    return False, box[0], total


def _assert_released(*conds):
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert not any(c._is_owned() for c in conds), "a lock is still held"


class TickingClock:
    """worker.time stand-in: each monotonic() call is one second later (so a get with
    timeout 1.001 waits exactly once, whatever the machine's speed)."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        self.now += 1.0
        return self.now


def _buffer(on_stale="drop"):
    """Calls 0 (stale at trainer version 2 with lag 1), 1, 2, 3 (fresh)."""
    buf = SampleBuffer(8, max_policy_lag=1, on_stale=on_stale)
    for call, versions in enumerate(([[0]], [[2]], [[2, 1]], [[1, 2]])):
        buf.put(fake(call, versions))
    return buf


def _closed_buffer():
    buf = _buffer()
    buf.close()
    return buf


GETS = {  # name: (buffer, get call, its uninterrupted outcome)
    "taking": (_buffer, lambda b: [p.call for p in b.get(2, 2)], [1, 2]),
    "refused": (lambda: _buffer("raise"), lambda b: b.get(2, 2), StalenessError),
    "closed": (_closed_buffer, lambda b: b.get(4, 2), RuntimeError),
    "timing_out": (_buffer, lambda b: b.get(4, 2, timeout=1.001), TimeoutError),
}


@pytest.mark.parametrize("op", sorted(GETS))
def test_interrupt_in_get_returns_or_keeps_every_call(op, monkeypatch):
    monkeypatch.setattr(worker_module, "time", TickingClock())
    make, get, expected = GETS[op]
    buf = make()
    _, result, total = _run(lambda: get(buf), None)
    assert result == expected and total > 20
    for at in _points(total):
        buf = make()
        interrupted, result, _ = _run(lambda: get(buf), at)
        _assert_released(buf._cond)
        assert interrupted or result == expected, (at, result)
        m = buf.metrics()
        left = [p.call for p in buf.drain()]
        returned = result if isinstance(result, list) else []
        dropped = [0] * m["dropped_calls"]
        assert sorted(returned + left + dropped) == [0, 1, 2, 3], (at, returned, left)
        assert m["consumed"] == len(returned)
        assert m["staleness"] == ({0: 2, 1: 1} if returned else {}), at


def test_interrupt_in_publish_never_wedges_the_worker():
    eng, buf, worker, _ = started()
    params = dict(enumerate(PARAMS[:1]))

    def publish_next(at):
        """Publishes the engine's next version; checks the worker's next call."""
        version = eng.version + 1
        params[version] = scale_matrices(BASE, 1.0 + 0.01 * version)
        wait_until(lambda: buf.metrics()["buffered"] == 1)  # the worker idles: no call in flight
        interrupted, _, total = _run(lambda: worker.publish(params[version], version), at)
        _assert_released(buf._cond, worker._cond)
        assert not eng._lock.locked()
        assert eng.version in (version - 1, version) and (interrupted or eng.version == version)
        old, = buf.get(1, eng.version, timeout=120)  # generated before the publish
        new, = buf.get(1, eng.version, timeout=120)  # the worker's next call
        assert new.call == old.call + 1
        assert new.batch.version == eng.version, f"interrupt at line {at}"
        assert all((s.token_versions == eng.version).all() for s in new.batch.samples)
        assert audit_attribution(new.batch, params, CONFIG).ok
        return total

    total = publish_next(None)
    assert total > 50
    for at in _points(total):
        publish_next(at)
    worker.stop(timeout=60)
    m = buf.metrics()
    assert m["produced"] == worker.calls == m["consumed"] + m["buffered"], m


@pytest.mark.parametrize("behind", [False, True], ids=["idle", "behind_the_engine"])
def test_interrupt_in_stop_still_stops(behind):
    """idle: the worker waits for a place; behind: the engine was synced directly and the
    worker waits for a publish."""

    def scenario():
        eng, buf, worker, hook = started()
        if behind:
            eng.sync_weights(PARAMS[1], 1)
            buf.get(1, 1, timeout=120)
            assert hook.asked[1].wait(120)
        return buf, worker

    buf, worker = scenario()
    _, result, total = _run(lambda: worker.stop(timeout=60), None)
    assert result is None and total > 10
    for at in _points(total):
        buf, worker = scenario()
        interrupted, result, _ = _run(lambda: worker.stop(timeout=60), at)
        _assert_released(buf._cond, worker._cond)
        assert result is None
        if interrupted:
            worker.stop(timeout=60)  # a second stop completes it
        assert not worker._thread.is_alive()
        m = buf.metrics()
        assert m["produced"] == worker.calls == m["consumed"] + m["buffered"] == 1
