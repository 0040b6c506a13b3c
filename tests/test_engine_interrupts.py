"""SIGINT at executed lines of the engine (rollout at the current and at a newer version,
sync_weights), simulated by calling the installed SIGINT handler at that line, as CPython
does between bytecodes (deferred sections record it; the default handler raises
KeyboardInterrupt). Afterwards the lock is free, pages balance with none held, the
version and weights are the old ones or fully the new ones, only the current version has
prefix entries, and the next rollout passes the attribution audit.

CI runs a fixed, evenly spaced sample of the executed lines (SAMPLE per operation);
JAXRL_FULL_SWEEP=1 (`make test-full`) runs every line."""
import os
import signal
import sys

import jax
import pytest

from jaxrl_cache.rl.audit import audit_attribution
from jaxrl_cache.rollout import CacheConfig, RolloutEngine, SamplingParams, SchedulerConfig
from tests.helpers import CONFIG, varied_params

ENGINE_FILES = ("jaxrl_cache/rollout/", "jaxrl_cache/cache/", "jaxrl_cache/interrupts.py")
SAMPLE = 24
PROMPTS = [list(range(1, 20)), list(range(1, 14)), [7, 3, 9]]
SP = SamplingParams(n=2, max_new_tokens=5, temperature=1.0)
P0, P1 = varied_params(0), varied_params(1)


def _ours(frame) -> bool:
    path = frame.f_code.co_filename.replace(os.sep, "/")
    return any(f in path for f in ENGINE_FILES)


def _run_with_interrupt_at(fn, at: int | None) -> int:
    """Runs fn with a tracer counting line events in the engine's files; delivers SIGINT to
    the installed handler at event number `at` (None: count only). Returns the count."""
    seen = [0]

    def tracer(frame, event, arg):
        if not _ours(frame):
            return None
        if event == "line":
            seen[0] += 1
            if seen[0] == at:
                signal.getsignal(signal.SIGINT)(signal.SIGINT, frame)
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return seen[0]


def _engine():
    engine = RolloutEngine(CONFIG, CacheConfig(num_pages=12, page_size=8),
                           scheduler_config=SchedulerConfig(max_num_seqs=3, chunk_steps=2))
    engine.rollout(P0, 0, PROMPTS, SP, rng=jax.random.key(0))  # warm: compiled, cache filled
    return engine


OPS = {
    "rollout_current": lambda e: e.rollout(P0, 0, PROMPTS, SP, rng=jax.random.key(1)),
    "rollout_newer": lambda e: e.rollout(P1, 1, PROMPTS, SP, rng=jax.random.key(1)),
    "sync_newer": lambda e: e.sync_weights(P1, 1),
}


def _points(total: int) -> list[int]:
    if os.environ.get("JAXRL_FULL_SWEEP") == "1" or total <= SAMPLE:
        return list(range(1, total + 1))
    return sorted({1 + round(i * (total - 1) / (SAMPLE - 1)) for i in range(SAMPLE)})


@pytest.mark.parametrize("op", sorted(OPS))
def test_interrupt_at_any_line_leaves_a_consistent_engine(op):
    counted = _engine()
    total = _run_with_interrupt_at(lambda: OPS[op](counted), None)
    assert total > 50
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    for at in _points(total):
        engine = _engine()
        try:
            _run_with_interrupt_at(lambda: OPS[op](engine), at)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        assert not engine._lock.locked(), f"lock held after an interrupt at line {at}"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        stats = engine.cache_stats()
        engine.cache.check_invariants()
        assert stats.in_use_pages == 0, f"pages held after an interrupt at line {at}"
        assert engine.cache.versions() in ([], [engine.version])
        params = {0: P0, 1: P1}[engine.version]
        assert all(a is b for a, b in zip(engine._weights.source, jax.tree.leaves(params)))
        assert not interrupted or engine.version in (0, 1)
        batch = engine.rollout(params, engine.version, PROMPTS, SP, rng=jax.random.key(2))
        report = audit_attribution(batch, {engine.version: params}, CONFIG)
        assert report.ok, f"audit failed after an interrupt at line {at}: {report}"
        if engine.version == 1:
            assert all(s.behavior_version == 1 for s in batch.samples)
