"""Asynchronous RL: a background rollout worker and the trainer-side buffer it fills.

The worker thread calls `engine.rollout` back to back at the latest published version; the
trainer draws finished calls from the buffer, trains, and `publish`es the new params, which
syncs the engine between two decode chunks of the call in flight (engine kv_policy
"recompute" or "keep"). Staleness is bounded twice: the buffer is bounded (the worker waits
for a free place before it starts a call) and a drawn call whose oldest token lags the trainer by more than
`max_policy_lag` is dropped (counted) or refused (StalenessError), as configured.

Every call the worker starts is delivered exactly once: drawn, dropped as stale (counted),
or left in the buffer after `stop` (drain it with `drain`). A failure in the worker thread
stops it and is raised to the trainer by the next `get` or by `stop`.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Callable

import jax

from jaxrl_cache.checks import as_count
from jaxrl_cache.errors import StalenessError, VersionError
from jaxrl_cache.rollout.sampling import SamplingParams
from jaxrl_cache.rollout.types import RolloutBatch, WeightAck
from jaxrl_cache.versioning import as_version


@dataclasses.dataclass(frozen=True)
class Produced:
    """One finished rollout call."""
    call: int  # index of the call: prompt_source(call) gave its prompts
    batch: RolloutBatch
    meta: object  # what prompt_source returned with the prompts (e.g. reference answers)

    @property
    def oldest_version(self) -> int:
        return min(s.oldest_version for s in self.batch.samples)


class SampleBuffer:
    """Finished calls from the worker to the trainer (thread-safe, bounded, FIFO)."""

    def __init__(self, capacity: int, max_policy_lag: int, *, on_stale: str = "drop"):
        """capacity: calls held before the worker waits; on_stale: "drop" (count and skip a
        call whose oldest token lags the trainer by more than max_policy_lag) or "raise"
        (StalenessError)."""
        if on_stale not in ("drop", "raise"):
            raise ValueError(f"on_stale must be 'drop' or 'raise', got {on_stale!r}")
        self.capacity = as_count(capacity, "capacity", minimum=1)
        self.max_policy_lag = as_count(max_policy_lag, "max_policy_lag")
        self.on_stale = on_stale
        self._items: collections.deque[Produced] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._reserved = 0  # calls being generated for a place already set aside
        self._error: BaseException | None = None
        self.produced = self.consumed = 0
        self.dropped_calls = self.dropped_samples = 0
        self.staleness = collections.Counter()  # trainer version - token version, per token

    def reserve(self) -> bool:
        """Waits for a free place and sets it aside for the call about to be generated (so
        the worker never generates a call nobody will take while it is fresh); False once
        the buffer is closed."""
        with self._cond:
            while not self._closed and len(self._items) + self._reserved >= self.capacity:
                self._cond.wait()
            if self._closed:
                return False
            self._reserved += 1
            return True

    def put(self, item: Produced) -> None:
        """Appends a call generated for a reserved place (or any call once closed)."""
        with self._cond:
            self._reserved = max(self._reserved - 1, 0)
            self._items.append(item)
            self.produced += 1
            self._cond.notify_all()

    def get(self, count: int, trainer_version: int, *, timeout: float | None = None
            ) -> list[Produced]:
        """The next `count` calls within the lag of `trainer_version` (older ones dropped or
        refused as configured). Raises the worker's error if it failed, TimeoutError after
        `timeout` seconds, RuntimeError if the buffer closed with too few calls."""
        count = as_count(count, "count", minimum=1)
        trainer_version = as_version(trainer_version, "trainer_version")
        out: list[Produced] = []
        with self._cond:
            while len(out) < count:
                if not self._items:
                    if self._error is not None:
                        raise RuntimeError("the rollout worker failed") from self._error
                    if self._closed:
                        raise RuntimeError(f"buffer closed with {len(out)} of {count} calls")
                    if not self._cond.wait(timeout):
                        raise TimeoutError(f"no rollout arrived within {timeout} s")
                    continue
                item = self._items.popleft()
                self._cond.notify_all()
                lag = trainer_version - item.oldest_version
                if lag > self.max_policy_lag:
                    if self.on_stale == "raise":
                        raise StalenessError(
                            f"call {item.call}: oldest token version {item.oldest_version} "
                            f"lags the trainer ({trainer_version}) by {lag} > max_policy_lag "
                            f"{self.max_policy_lag}")
                    self.dropped_calls += 1
                    self.dropped_samples += len(item.batch.samples)
                    continue
                for s in item.batch.samples:
                    self.staleness.update((trainer_version - s.token_versions).tolist())
                self.consumed += 1
                out.append(item)
        return out

    def drain(self) -> list[Produced]:
        """Everything left (after the worker stopped), without staleness filtering."""
        with self._cond:
            items, self._items = list(self._items), collections.deque()
            self._cond.notify_all()
            return items

    @property
    def error(self) -> BaseException | None:
        """The worker's failure, if it failed."""
        return self._error

    def close(self, error: BaseException | None = None) -> None:
        with self._cond:
            self._closed = True
            self._error = self._error or error
            self._cond.notify_all()

    def metrics(self) -> dict:
        with self._cond:
            return dict(produced=self.produced, consumed=self.consumed,
                        dropped_calls=self.dropped_calls, dropped_samples=self.dropped_samples,
                        buffered=len(self._items), staleness=dict(sorted(self.staleness.items())))


class RolloutWorker:
    """A background thread generating continuously at the latest published version."""

    def __init__(self, engine, prompt_source: Callable[[int], tuple[list, object]],
                 sampling: SamplingParams, buffer: SampleBuffer, *, rng: jax.Array):
        """prompt_source(call) -> (prompts, meta) for the call-th rollout call; rng: the key
        that call c folds c into (calls are reproducible by index)."""
        if engine.kv_policy == "wait":
            raise ValueError("RolloutWorker needs an engine with kv_policy 'recompute' or "
                             "'keep': with 'wait' a sync waits for the whole call")
        self.engine, self.source, self.sampling, self.buffer = engine, prompt_source, sampling, buffer
        self.rng = rng
        self._latest: tuple | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.calls = 0

    def start(self, params, version) -> WeightAck:
        """Syncs `params` as `version` and starts generating."""
        if self._thread is not None:
            raise RuntimeError("the worker was already started")
        ack = self.publish(params, version)
        self._thread = threading.Thread(target=self._run, name="rollout-worker", daemon=True)
        self._thread.start()
        return ack

    def publish(self, params, version) -> WeightAck:
        """Syncs the engine (waits for the decode chunk in flight, not the call) and makes
        `version` the one later calls start at."""
        with self._lock:
            ack = self.engine.sync_weights(params, version)
            self._latest = (params, ack.version)
        return ack

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and self.buffer.reserve():
                prompts, meta = self.source(self.calls)
                batch = self._rollout(prompts)
                self.buffer.put(Produced(self.calls, batch, meta))
                self.calls += 1
        except BaseException as e:  # surfaced to the trainer by get() and stop()
            self.buffer.close(e)

    def _rollout(self, prompts) -> RolloutBatch:
        rng = jax.random.fold_in(self.rng, self.calls)
        while True:
            with self._lock:
                params, version = self._latest
            try:
                return self.engine.rollout(params, version, prompts, self.sampling, rng=rng)
            except VersionError:
                if self.engine.version <= version:
                    raise
                # a publish landed between reading the latest and the call: take the new one

    def stop(self, timeout: float | None = None) -> None:
        """Lets the call in flight finish and land in the buffer, then stops the thread;
        raises the worker's error if it failed."""
        self._stop.set()
        self.buffer.close()  # a worker waiting for a place exits; one generating puts its call
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"rollout worker still running after {timeout} s")
        if self.buffer.error is not None:
            raise RuntimeError("the rollout worker failed") from self.buffer.error
