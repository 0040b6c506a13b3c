"""Asynchronous RL: a background rollout worker and the trainer-side buffer it fills.

The worker thread calls `engine.rollout` (or `engine.rollout_episodes`, given `episodes`)
back to back at the latest published version; the
trainer draws finished calls from the buffer, trains, and `publish`es the new params, which
syncs the engine between two decode chunks of the call in flight (engine kv_policy
"recompute" or "keep"). Staleness is bounded twice: the buffer is bounded (the worker waits
for a free place before it starts a call) and a drawn call whose oldest token lags the trainer
by more than `max_policy_lag` (<= versioning.MAX_POLICY_LAG) is dropped (counted) or refused
(StalenessError), as configured.

Every call the worker starts is delivered exactly once: drawn, dropped as stale (counted),
or left in the buffer after `stop` (drain it with `drain`). A failure in the worker thread
stops it and is raised to the trainer by the next `get` or by `stop`. Call c uses
prompt_source(c) and the key fold_in(rng, c); c counts from `start(..., first_call=)`.

The worker never spins. It holds the params of its current version and of every version
offered to `publish` since (recorded before the engine sync, so a Ctrl-C delivered right
after the engine committed leaves them held). When the engine refuses its version because the
engine moved past it (a trainer's own `engine.sync_weights`, or such an interrupted publish),
it adopts the engine's version if it holds that version's params, else it waits on a
condition that only `publish` and `stop` signal. So each retry follows a strictly newer
engine version, and a stop ends the wait.

`get` hands out all or nothing, and its timeout bounds the whole call (a deadline). Under the
buffer's lock, with SIGINT/SIGTERM deferred (interrupts.deferred_signals), it drops (counts)
or refuses the stale calls it meets and removes the `count` fresh ones in one step, or
removes none (a refusal, the worker's failure, a closed buffer or the deadline leave every
fresh call buffered; a refused stale call stays at the head). It waits only inside an
allow_signals window, where a Ctrl-C raises at once with nothing taken; a Ctrl-C deferred
during the removal surfaces on the way out, and the calls are put back at the head (counters
undone) before it propagates. Every main-thread use of a lock here is in a deferred section,
so a Ctrl-C can never leave a lock held.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable

import jax

from jaxrl_cache.checks import as_bool, as_count, as_real
from jaxrl_cache.errors import StalenessError, VersionError
from jaxrl_cache.interrupts import allow_signals, deferred_signals
from jaxrl_cache.rollout.sampling import SamplingParams
from jaxrl_cache.rollout.types import EpisodeBatch, RolloutBatch, WeightAck
from jaxrl_cache.versioning import MAX_POLICY_LAG, as_version


@dataclasses.dataclass(frozen=True)
class Produced:
    """One finished rollout call."""
    call: int  # index of the call: prompt_source(call) gave its prompts
    batch: RolloutBatch | EpisodeBatch
    meta: object  # what prompt_source returned with the prompts (e.g. reference answers)

    @property
    def oldest_version(self) -> int:
        return min(s.oldest_version for s in self.batch.samples)


def _as_timeout(timeout) -> float | None:
    return None if timeout is None else as_real(timeout, "timeout", minimum=0)


class SampleBuffer:
    """Finished calls from the worker to the trainer (thread-safe, bounded, FIFO)."""

    def __init__(self, capacity: int, max_policy_lag: int, *, on_stale: str = "drop"):
        """capacity: calls held before the worker waits; on_stale: "drop" (count and skip a
        call whose oldest token lags the trainer by more than max_policy_lag) or "raise"
        (StalenessError, the call left in the buffer)."""
        if on_stale not in ("drop", "raise"):
            raise ValueError(f"on_stale must be 'drop' or 'raise', got {on_stale!r}")
        self.capacity = as_count(capacity, "capacity", minimum=1)
        self.max_policy_lag = as_count(max_policy_lag, "max_policy_lag",
                                       maximum=MAX_POLICY_LAG)
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
        """(The worker's.) Waits for a free place and sets it aside for the call about to be
        generated (so the worker never generates a call nobody will take while it is fresh);
        False once the buffer is closed."""
        with deferred_signals(), self._cond:
            while not self._closed and len(self._items) + self._reserved >= self.capacity:
                self._cond.wait()
            if self._closed:
                return False
            self._reserved += 1
            return True

    def put(self, item: Produced) -> None:
        """(The worker's.) Appends a call generated for a reserved place (or any call once
        closed)."""
        with deferred_signals(), self._cond:
            self._reserved = max(self._reserved - 1, 0)
            self._items.append(item)
            self.produced += 1
            self._cond.notify_all()

    def get(self, count: int, trainer_version: int, *, timeout: float | None = None
            ) -> list[Produced]:
        """The next `count` calls within the lag of `trainer_version` (older ones met on the
        way dropped or refused as configured), all at once, or none: raises StalenessError
        (on_stale="raise"), the worker's error (RuntimeError), RuntimeError if the buffer
        closed with too few calls, TimeoutError once `timeout` seconds in all have passed,
        each leaving every fresh call in the buffer (see the module doc)."""
        count = as_count(count, "count", minimum=1)
        trainer_version = as_version(trainer_version, "trainer_version")
        timeout = _as_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        taken: list[Produced] = []
        try:
            with deferred_signals(), self._cond:
                taken = self._await(count, trainer_version, deadline, timeout)
            return taken
        except BaseException:  # a Ctrl-C deferred while the calls were taken: keep them
            if taken:
                self._restore(taken, trainer_version)
            raise

    def _await(self, count: int, trainer_version: int, deadline: float | None,
               timeout: float | None) -> list[Produced]:
        """(Lock held, signals deferred but while waiting.) get's loop."""
        while True:
            taken = self._take(count, trainer_version)
            if taken is not None:
                return taken
            if self._error is not None:
                raise RuntimeError("the rollout worker failed") from self._error
            if self._closed:
                raise RuntimeError(f"buffer closed with {len(self._items)} of {count} calls")
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"{count} rollout calls did not arrive within {timeout} s "
                                   f"({len(self._items)} buffered, kept)")
            allow_signals(self._cond.wait, remaining)

    def _take(self, count: int, trainer_version: int) -> list[Produced] | None:
        """(Lock held, signals deferred.) Walks the calls in order until `count` fresh ones:
        stale ones met are dropped and counted, or refused (StalenessError, nothing
        changed). Removes and returns the fresh ones if there are `count`, else None, leaving
        them."""
        fresh, stale, rest = [], [], collections.deque(self._items)
        while rest and len(fresh) < count:
            item = rest.popleft()
            lag = trainer_version - item.oldest_version
            if lag <= self.max_policy_lag:
                fresh.append(item)
            elif self.on_stale == "raise":
                raise StalenessError(
                    f"call {item.call}: oldest token version {item.oldest_version} lags the "
                    f"trainer ({trainer_version}) by {lag} > max_policy_lag "
                    f"{self.max_policy_lag}; the call stays in the buffer (drain() returns it)")
            else:
                stale.append(item)
        self.dropped_calls += len(stale)
        self.dropped_samples += sum(len(item.batch.samples) for item in stale)
        if stale:
            self._cond.notify_all()  # places freed
        if len(fresh) < count:
            self._items = collections.deque(fresh)  # `rest` is empty: every call was walked
            return None
        self._items = rest
        self.consumed += count
        self.staleness.update(self._staleness_of(fresh, trainer_version))
        self._cond.notify_all()
        return fresh

    @staticmethod
    def _staleness_of(items: list[Produced], trainer_version: int) -> collections.Counter:
        out = collections.Counter()
        for item in items:
            for s in item.batch.samples:
                out.update((trainer_version - s.token_versions).tolist())
        return out

    def _restore(self, items: list[Produced], trainer_version: int | None) -> None:
        """Puts calls a get (its trainer_version: counters undone) or a drain (None) handed
        out back at the head of the buffer."""
        with deferred_signals(), self._cond:
            self._items.extendleft(reversed(items))
            if trainer_version is not None:
                self.consumed -= len(items)
                self.staleness.subtract(self._staleness_of(items, trainer_version))
            self._cond.notify_all()

    def drain(self) -> list[Produced]:
        """Everything left (after the worker stopped), without staleness filtering; all or
        nothing, as get."""
        items: list[Produced] = []
        try:
            with deferred_signals(), self._cond:
                items, self._items = list(self._items), collections.deque()
                self._cond.notify_all()
            return items
        except BaseException:
            if items:
                self._restore(items, None)
            raise

    def oldest_version(self, default: int) -> int:
        """The oldest token version of the buffered calls (`default` when none is)."""
        with deferred_signals(), self._cond:
            return min([default, *(item.oldest_version for item in self._items)])

    @property
    def error(self) -> BaseException | None:
        """The worker's failure, if it failed."""
        return self._error

    def close(self, error: BaseException | None = None) -> None:
        with deferred_signals(), self._cond:
            self._closed = True
            self._error = self._error or error
            self._cond.notify_all()

    def metrics(self) -> dict:
        with deferred_signals(), self._cond:
            return dict(produced=self.produced, consumed=self.consumed,
                        dropped_calls=self.dropped_calls, dropped_samples=self.dropped_samples,
                        buffered=len(self._items),
                        staleness={k: v for k, v in sorted(self.staleness.items()) if v})


class RolloutWorker:
    """A background thread generating continuously at the latest published version."""

    def __init__(self, engine, prompt_source: Callable[[int], tuple[list, object]],
                 sampling: SamplingParams, buffer: SampleBuffer, *, rng: jax.Array,
                 episodes: dict | None = None, borrow: bool = False):
        """prompt_source(call) -> (prompts, meta) for the call-th rollout call; rng: the key
        that call c folds c into (calls are reproducible by index). episodes: keyword
        arguments of engine.rollout_episodes (env_factory, max_turns, ...): calls are then
        episode calls whose prompts are tasks. borrow: the engine decodes with the published
        params themselves (`sync_weights(borrow=True)`: no copy); the caller must then not
        donate or delete published params before a later publish."""
        if engine.kv_policy == "wait":
            raise ValueError("RolloutWorker needs an engine with kv_policy 'recompute' or "
                             "'keep': with 'wait' a sync waits for the whole call")
        self.engine, self.source, self.sampling, self.buffer = engine, prompt_source, sampling, buffer
        self.rng, self.episodes, self.borrow = rng, episodes, as_bool(borrow, "borrow")
        self._cond = threading.Condition()  # guards _version, _held and _calling
        self._version = -1  # calls start at this version (-1: nothing published yet)
        self._held: dict[int, object] = {}  # version -> params: _version's and newer offers
        self._calling: int | None = None  # the version the call in flight started at
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.calls = 0  # index of the next call

    def start(self, params, version, *, first_call: int = 0) -> WeightAck:
        """Syncs `params` as `version` and starts generating, from call `first_call` (a
        resumed run passes the index its first new call had in the original run)."""
        if self._thread is not None:
            raise RuntimeError("the worker was already started")
        self.calls = as_count(first_call, "first_call")
        ack = self.publish(params, version)
        self._thread = threading.Thread(target=self._run, name="rollout-worker", daemon=True)
        self._thread.start()
        return ack

    def publish(self, params, version) -> WeightAck:
        """Syncs the engine (waits for the decode chunk in flight, not the call) and makes
        `version` the one later calls start at. The params are held before the sync (see the
        module doc), so an interrupt at any point leaves a worker that still proceeds."""
        version = as_version(version)
        with deferred_signals(), self._cond:
            if version > self._version:
                self._held[version] = params
                self._cond.notify_all()
        ack = self.engine.sync_weights(params, version, borrow=self.borrow)
        with deferred_signals(), self._cond:
            self._advance(ack.version)
        return ack

    def _advance(self, version: int) -> None:
        """(Lock held.) Makes the engine's committed `version` current if it is newer and its
        params are held; offers older than it are let go."""
        if version > self._version and version in self._held:
            self._version = version
            self._held = {v: p for v, p in self._held.items() if v >= version}
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and self.buffer.reserve():
                prompts, meta = self.source(self.calls)
                batch = self._rollout(prompts, jax.random.fold_in(self.rng, self.calls))
                if batch is None:
                    return  # stopped while waiting for a publish (the buffer is closed)
                self.buffer.put(Produced(self.calls, batch, meta))
                with self._cond:  # only now: the buffer shows the call's tokens
                    self._calling = None
                self.calls += 1
        except BaseException as e:  # surfaced to the trainer by get() and stop()
            self.buffer.close(e)

    def _rollout(self, prompts, rng) -> RolloutBatch | EpisodeBatch | None:
        """One call at the current version, catching up with the engine (never spinning, see
        the module doc); None if stopped first."""
        while True:
            with self._cond:
                version = self._calling = self._version
                params = self._held[version]
            try:
                if self.episodes is not None:
                    return self.engine.rollout_episodes(params, version, prompts,
                                                        sampling=self.sampling, rng=rng,
                                                        **self.episodes)
                return self.engine.rollout(params, version, prompts, self.sampling, rng=rng)
            except VersionError:
                if self.engine.version <= version:
                    raise  # not an engine that moved on: a real mismatch
            if not self._catch_up():
                return None

    def oldest_version(self) -> int:
        """The oldest version a call not yet buffered may hold tokens of: the version the
        call in flight started at, else the one the next call starts at (versions only
        move forward)."""
        with deferred_signals(), self._cond:
            return self._version if self._calling is None else self._calling

    def _catch_up(self) -> bool:
        """The engine moved past the worker's version: adopts the engine's version once its
        params are held (now, or after a publish); False if stopped first."""
        with self._cond:
            while not self._stop.is_set():
                current = self.engine.version
                if current in self._held:
                    self._advance(current)
                    return True
                self._cond.wait()  # signalled by publish and stop only
            return False

    def stop(self, timeout: float | None = None) -> None:
        """Lets the call in flight finish and land in the buffer, then stops the thread
        (a worker waiting for a publish exits at once); raises TimeoutError if it is still
        running after `timeout` seconds (call stop again to keep waiting), the worker's error
        if it failed."""
        timeout = _as_timeout(timeout)
        with deferred_signals():  # the flag, the wake-up and the close land together
            self._stop.set()
            with self._cond:
                self._cond.notify_all()
            self.buffer.close()  # a worker waiting for a place exits; one generating puts
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"rollout worker still running after {timeout} s")
        if self.buffer.error is not None:
            raise RuntimeError("the rollout worker failed") from self.buffer.error
