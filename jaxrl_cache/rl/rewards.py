"""The rewards of a GRPO step: several functions, weighted, per sample or batched, the slow
ones on threads.

A reward function has one of two shapes, declared (never guessed from its signature):
- per sample (the default; a plain callable is one of weight 1, today's API):
  fn(meta, sample, text) -> float | None, called once per sample (meta: what the prompt
  source returned for the sample's call; sample: a Sample, or an Episode of an episode call;
  text: its decoded completion);
- batched (`batched(fn)`, `RewardFn(fn, batched=True)`): TRL's shape, so a TRL reward
  function ports unchanged: fn(prompts=, completions=, completion_ids=[[int]],
  trainer_state=, **columns) -> [float | None], called once per step with every sample in
  batch order; columns are `Rewards.columns(meta, sample)`'s per-sample dicts as lists (a
  "prompt" column becomes `prompts`; without one, prompts are the decoded prompt ids).
  As in TRL, when the prompts are chat messages (lists of {"role", "content"}, TRL's
  conversational format) each completion is a message list [{"role": "assistant",
  "content": text}], else its text; `trainer_state` has `global_step` (the step) and
  `max_steps` (`Rewards.max_steps`).
- `async def` (either shape; detected as TRL does, through functools.partial and a callable
  object's `__call__`): the step's async calls are awaited together on one event loop on
  the calling thread (asyncio.gather, as TRL), while the concurrent functions' threads run.

Invariants:
- A sample's reward is the sum of weight * value over the functions whose value is not
  None, in the order given; a single weight-1 function gives its value bit for bit. A
  sample no function applies to scores 0.0 (TRL's nansum) and is counted
  (`reward_unscored`).
- Every value is a finite real (bools and numpy scalars count) or None, and a batched
  function returns one per sample. Anything else, a raise (SystemExit included), or a
  concurrent call past its timeout is a one-line `RewardError` naming the step, the
  function and the sample (or the batch), raised before anything is trained. (A
  KeyboardInterrupt on the calling thread is a real Ctrl-C: it propagates as itself.)
- `concurrent=True` functions run their calls on at most `Rewards.workers` daemon threads
  while the others run serially on the calling thread (as in TRL: math-verify's
  signal-based timeout needs the main thread). Values are gathered by position, so the
  rewards never depend on scheduling. `timeout` counts a call from its start (time queued
  excluded) and a call past it fails the step: on threads, at its deadline while the GIL
  is free, or when it returns if it held the GIL (C code, a regex: a thread cannot stop
  it, nor can the calling thread look); the late thread runs on unread and the process
  still exits. `process=True` (implies concurrent) runs each call in a worker process
  (child_calls.py; the function must be a module-level def), killed at its deadline: the
  one hard bound on wall time, for code that may hold the GIL. An async call's `timeout`
  (no `concurrent` needed) cancels it at its deadline at its next await, or fails the step
  when it returns late (wall time from its start on the shared loop).
- The record gains `rewards/<name>/mean` and `rewards/<name>/std` (population std) over
  the samples each function applied to (NaN when none did).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import importlib.util
import itertools
import math
import pathlib
import inspect
import pickle
import queue
import re
import sys
import time
from typing import Callable, Sequence

import numpy as np

from jaxrl_cache.checks import as_bool, as_count, as_real
from jaxrl_cache.child_calls import ChildCalls, ChildError, exception_line, register_file_module
from jaxrl_cache.daemon_threads import DaemonThreads
from jaxrl_cache.errors import RewardError

POLL_S = 0.1  # the calling thread checks timeouts (and Ctrl-C) at least this often
DEFAULT_WORKERS = 8


@dataclasses.dataclass(frozen=True)
class RewardFn:
    """One reward function and how it is called (see the module doc)."""
    fn: Callable
    weight: float = 1.0
    name: str | None = None  # None: fn.__name__ (a callable object: its type's name)
    batched: bool = False  # TRL's shape: one call per step with every sample
    concurrent: bool = False  # calls on the reward threads (the code must be thread-safe)
    timeout: float | None = None  # seconds per call, concurrent or async functions only
    process: bool = False  # concurrent calls in worker processes, killed at the timeout

    @property
    def is_async(self) -> bool:
        """Calling fn returns a coroutine (TRL's `is_async_callable`)."""
        fn = self.fn
        while isinstance(fn, functools.partial):
            fn = fn.func
        return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None))

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"a reward function must be callable, got "
                            f"{type(self.fn).__name__} {self.fn!r:.80}")
        name = self.name if self.name is not None else (
            getattr(self.fn, "__name__", None) or type(self.fn).__name__)
        if not isinstance(name, str) or not name:
            raise ValueError(f"a reward function's name must be a non-empty str, got {name!r}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "weight", as_real(self.weight, f"reward {name!r} weight"))
        as_bool(self.batched, f"reward {name!r} batched")
        as_bool(self.concurrent, f"reward {name!r} concurrent")
        if self.is_async and (self.concurrent or self.process):
            raise ValueError(f"reward {name!r} is async: its calls are awaited together on "
                             f"an event loop, so concurrent/process do not apply")
        if as_bool(self.process, f"reward {name!r} process"):
            object.__setattr__(self, "concurrent", True)
            try:
                pickle.dumps(self.fn)
            except Exception as e:  # noqa: BLE001 -- any pickling failure: one line
                raise ValueError(f"reward {name!r}: process=True sends the function to a "
                                 f"worker process by name, so it must be a module-level def "
                                 f"(not a lambda, a closure or a local function): "
                                 f"{type(e).__name__}: {exception_line(e):.120}") from None
        if self.timeout is not None:
            if not (self.concurrent or self.is_async):
                raise ValueError(f"reward {name!r}: timeout needs concurrent=True or an async "
                                 f"function (a call on the calling thread cannot be stopped)")
            object.__setattr__(self, "timeout", as_real(
                self.timeout, f"reward {name!r} timeout", minimum=0.0, open_min=True))


def batched(fn: Callable, **fields) -> RewardFn:
    """fn as a batched (TRL-shaped) reward function; fields: RewardFn's others."""
    return RewardFn(fn, batched=True, **fields)


@dataclasses.dataclass(frozen=True)
class Scores:
    totals: list  # float [N]: each sample's weighted reward, in batch order
    metrics: dict  # rewards/<name>/mean|std, reward_unscored
    values: dict = dataclasses.field(default_factory=dict)  # {name: [float | None] [N]}: each
    #   function's value of each sample, in batch order (None: it did not apply)


@dataclasses.dataclass(frozen=True)
class Rewards:
    """A step's reward functions (plain callables become per-sample RewardFns)."""
    fns: tuple  # RewardFn, ... (names unique)
    columns: Callable | None = None  # (meta, sample) -> {column: value} for batched ones
    workers: int = DEFAULT_WORKERS  # threads for the concurrent functions' calls
    max_steps: int | None = None  # trainer_state.max_steps (the run's steps), if known

    def __post_init__(self):
        fns = tuple(f if isinstance(f, RewardFn) else RewardFn(f) for f in self.fns)
        if not fns:
            raise ValueError("no reward functions")
        names = [f.name for f in fns]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"two reward functions are named {name!r}: give one another "
                                 f"name (RewardFn(fn, name=...))")
        if self.columns is not None and not callable(self.columns):
            raise TypeError(f"Rewards.columns must be callable, got {self.columns!r:.80}")
        object.__setattr__(self, "fns", fns)
        object.__setattr__(self, "workers", as_count(self.workers, "Rewards.workers",
                                                     minimum=1))
        if self.max_steps is not None:
            as_count(self.max_steps, "Rewards.max_steps", minimum=1)

    @classmethod
    def of(cls, reward) -> Rewards:
        """A Rewards, a RewardFn, a plain callable or a list/tuple of the last two."""
        if isinstance(reward, Rewards):
            return reward
        if isinstance(reward, (list, tuple)):
            return cls(tuple(reward))
        if isinstance(reward, RewardFn) or callable(reward):
            return cls((reward,))
        raise TypeError(f"reward must be a callable, a RewardFn, a list of them or a Rewards, "
                        f"got {type(reward).__name__} {reward!r:.80}")

    def score(self, step: int, items: Sequence[tuple], decode: Callable) -> Scores:
        """items [(meta, sample, text)] of the step, in batch order -> Scores; RewardError
        (see the module doc). decode(token ids) -> str gives prompts without a column."""
        n = len(items)
        kwargs = dict(_batch_kwargs(step, self.columns, items, decode),
                      trainer_state=TrainerState(step, self.max_steps)) \
            if any(f.batched for f in self.fns) else None
        jobs = [(f, i) for f in self.fns for i in ([None] if f.batched else range(n))]
        thunks = [_thunk(f, (items[i],) if i is not None else (),
                         {k: list(v) if isinstance(v, list) else v
                          for k, v in kwargs.items()} if i is None else {})
                  for f, i in jobs]  # own lists each
        values = {}
        pool = _Pool({j: thunks[j] for j, (f, _) in enumerate(jobs) if f.concurrent},
                     self.workers)
        try:
            for j, (f, i) in enumerate(jobs):
                if not f.concurrent and not f.is_async:
                    values[j] = _checked(step, f, i, items,
                                         _outcome(lambda: thunks[j](_nothing, None), main=True))
            awaited = _await_all({j: thunks[j] for j, (f, _) in enumerate(jobs) if f.is_async},
                                 {j: f.timeout for j, (f, _) in enumerate(jobs)})
            for j, outcome in awaited.items():
                values[j] = _checked(step, jobs[j][0], jobs[j][1], items, outcome)
            for j, outcome in pool.outcomes({j: f.timeout for j, (f, _) in enumerate(jobs)}):
                values[j] = _checked(step, jobs[j][0], jobs[j][1], items, outcome)
        finally:
            pool.stop()
        per_fn = {f.name: [] for f in self.fns}
        for j, (f, i) in enumerate(jobs):
            per_fn[f.name] += values[j] if i is None else [values[j]]
        return _combine(step, self.fns, per_fn, n)


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """What TRL's `trainer_state` keyword gives a reward that shapes itself by progress."""
    global_step: int  # the GRPO step being scored (steps done before it)
    max_steps: int | None  # the run's steps (Rewards.max_steps), None if unknown


_CHILDREN = ChildCalls()  # the worker processes of process=True functions, reused


def _thunk(f: RewardFn, args: tuple, kwargs: dict) -> Callable:
    """(started, key) -> f's value on (*args[0], **kwargs): `started()` marks the call's
    start (for a process function: once its worker has loaded it); `key` names the call
    for `_CHILDREN.kill`."""
    args = args[0] if args else ()
    if f.process:
        return lambda started, key: _CHILDREN.call(key, started, f.fn, *args, **kwargs)
    return lambda started, key: (started(), f.fn(*args, **kwargs))[1]


def _nothing() -> None:
    pass


def _await_all(thunks: dict, timeouts: dict) -> dict:
    """{job: outcome} of the async jobs' thunks (each gives a coroutine), awaited together
    on a new event loop on the calling thread; an outcome is `_outcome`'s, with _Timeout()
    for a call past its timeout (cancelled at its deadline, or measured when it returns). A
    real Ctrl-C (KeyboardInterrupt, or the loop's cancellation on SIGINT) propagates."""
    if not thunks:
        return {}

    async def one(j):
        start, limit = time.perf_counter(), asyncio.timeout(timeouts[j])
        try:
            async with limit:
                value = await thunks[j](_nothing, None)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 -- the function's failure, but a real cancel
            if asyncio.current_task().cancelling():
                raise
            return j, (False, _Timeout() if limit.expired() else e)
        late = timeouts[j] is not None and time.perf_counter() - start > timeouts[j]
        return j, (False, _Timeout()) if late else (True, value)

    async def gather():
        return await asyncio.gather(*map(one, thunks))

    return dict(asyncio.run(gather()))


def _outcome(thunk: Callable, main: bool = False) -> tuple:
    """(True, value) or (False, the exception caught). Worker threads never receive
    signals, so there every BaseException is the code's own (SystemExit from a tool, a
    KeyboardInterrupt it raised); on the calling thread (`main`) a KeyboardInterrupt is a
    real Ctrl-C and propagates."""
    try:
        return True, thunk()
    except KeyboardInterrupt as e:
        if main:
            raise
        return False, e
    except BaseException as e:  # noqa: BLE001 -- reported as the function's failure
        return False, e


def _where(f: RewardFn, i: int | None, items) -> str:
    if i is None:
        return f"reward function {f.name!r} on the batch of {len(items)} samples"
    return f"reward function {f.name!r} on sample {i} (group {items[i][1].group})"


def _checked(step: int, f: RewardFn, i: int | None, items, outcome: tuple):
    """The call's value(s) checked: float or None (per sample), [N] of them (batched)."""
    ok, value = outcome
    if not ok:
        if isinstance(value, _Timeout):
            raise RewardError(f"step {step}: {_where(f, i, items)}: took more than "
                              f"{f.timeout:g} s (its timeout)")
        kind = value.type_name if isinstance(value, ChildError) else type(value).__name__
        raise RewardError(f"step {step}: {_where(f, i, items)}: raised "
                          f"{kind}: {exception_line(value):.200}")
    if i is not None:
        return _value(step, f, i, items, value)
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise RewardError(f"step {step}: {_where(f, i, items)}: returned "
                          f"{type(value).__name__}, not a list of values")
    if len(value) != len(items):
        raise RewardError(f"step {step}: {_where(f, i, items)}: returned {len(value)} "
                          f"values for {len(items)} samples")
    return [_value(step, f, k, items, v) for k, v in enumerate(value)]


def _value(step: int, f: RewardFn, i: int, items, value) -> float | None:
    if value is None:
        return None
    try:
        return float(value) if isinstance(value, (bool, np.bool_)) else as_real(value, "its value")
    except (TypeError, ValueError) as e:
        raise RewardError(f"step {step}: {_where(f, i, items)}: {e} (a reward is a finite "
                          f"real or None)") from None


def _batch_kwargs(step: int, columns: Callable | None, items, decode: Callable) -> dict:
    """TRL's keyword arguments of a batched call: prompts, completions, completion_ids and
    each column as a list in batch order (None where a sample's row lacks it)."""
    rows = []
    for i, (meta, sample, _) in enumerate(items):
        ok, row = _outcome(lambda: {} if columns is None else dict(columns(meta, sample)),
                           main=True)
        if not ok or any(not isinstance(k, str) for k in row):
            why = f"raised {type(row).__name__}: {exception_line(row)}" if not ok else \
                "gave a non-str key"
            raise RewardError(f"step {step}: Rewards.columns on sample {i} (group "
                              f"{sample.group}): {why:.200}")
        rows.append(row)
    names = dict.fromkeys(k for r in rows for k in r)  # first-seen order
    out = {k: [r.get(k) for r in rows] for k in names}
    prompts = out.pop("prompt", None)
    prompts = prompts if prompts is not None else [decode(list(s.prompt_ids))
                                                    for _, s, _ in items]
    chat = bool(prompts) and _is_chat(prompts[0])
    out.update(prompts=[[dict(m) for m in p] if chat else p for p in prompts],
               completions=[[{"role": "assistant", "content": text}] if chat else text
                            for _, _, text in items],
               completion_ids=[_completion_ids(s) for _, s, _ in items])
    return out


def _is_chat(prompt) -> bool:
    """TRL's `is_conversational`: a prompt that is a list of role/content messages."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt)


def _completion_ids(sample) -> list:
    """int [T]: a Sample's output ids, an Episode's sampled tokens (observations left out)."""
    if hasattr(sample, "output_ids"):
        return list(sample.output_ids)
    return [t for t, m in zip(sample.token_ids, sample.loss_mask) if m]


def _combine(step: int, fns: tuple, per_fn: dict, n: int) -> Scores:
    """The weighted sums (None left out) and each function's mean and std by name."""
    totals, unscored = [], 0
    for i in range(n):
        total, applied = 0.0, False
        for f in fns:
            if (v := per_fn[f.name][i]) is not None:
                total, applied = total + f.weight * v, True
        if not math.isfinite(total):
            raise RewardError(f"step {step}: the weighted reward of sample {i} overflows "
                              f"({total}): weights x values past the float range")
        totals.append(total)
        unscored += not applied
    metrics = {}
    for f in fns:
        got = [v for v in per_fn[f.name] if v is not None]
        metrics[f"rewards/{f.name}/mean"] = float(np.mean(got)) if got else math.nan
        metrics[f"rewards/{f.name}/std"] = float(np.std(got)) if got else math.nan
    metrics["reward_unscored"] = unscored
    return Scores(totals, metrics, per_fn)


class _Timeout(Exception):
    """A concurrent call past its timeout (reported by the calling thread)."""


_POOL_TAGS = itertools.count()


class _Pool:
    """`thunks` ({job: thunk}) run on `DaemonThreads`, `workers` at a time. The calling
    thread reads their outcomes in the order they finish (`outcomes`) and enforces each
    job's timeout from its start; `stop` lets queued jobs go unrun and kills the worker
    processes of calls still running."""

    def __init__(self, thunks: dict, workers: int):
        self.thunks, self.answers, self.stopped = thunks, queue.SimpleQueue(), False
        self.tag = next(_POOL_TAGS)  # names this pool's calls for _CHILDREN.kill
        self.threads = DaemonThreads(min(workers, len(thunks)), name="reward")
        for j in thunks:
            self.threads.submit(self._run, j, done=self.answers.put)

    def _run(self, j) -> tuple:
        if self.stopped:
            return j, "done", (False, _Timeout())  # never read
        outcome = _outcome(lambda: self.thunks[j](
            lambda: self.answers.put((j, "start", time.perf_counter())), (self.tag, j)))
        return j, "done", (outcome, time.perf_counter())

    def outcomes(self, timeouts: dict):
        """Yields (job, outcome) as jobs finish; (job, (False, _Timeout())) for a job past
        its timeout: seen by the calling thread at its deadline, or measured by the call's
        own thread when it returns (a call holding the GIL keeps the calling thread from
        looking; a calling thread that was descheduled never mistakes a finished call for
        a late one)."""
        started, left = {}, set(self.thunks)
        while left:
            deadlines = {j: started[j] + timeouts[j] for j in left
                         if j in started and timeouts[j] is not None}
            wait = min([POLL_S] + [d - time.perf_counter() for d in deadlines.values()])
            try:
                j, kind, value = self.answers.get(timeout=max(wait, 0.0))
            except queue.Empty:
                late = [j for j, d in deadlines.items() if d <= time.perf_counter()]
                if late:
                    left.discard(min(late))
                    yield min(late), (False, _Timeout())
                continue
            if kind == "start":
                started[j] = value
            elif j in left:
                left.discard(j)
                outcome, ended = value
                over = timeouts[j] is not None and j in started and \
                    ended - started[j] > timeouts[j]
                yield j, (False, _Timeout()) if over else outcome

    def stop(self) -> None:
        self.stopped = True
        self.threads.close()
        for j in self.thunks:
            _CHILDREN.kill((self.tag, j))


def load_reward(spec: str) -> RewardFn:
    """`module:function[=weight]` or `path/file.py:function[=weight]` (the CLI's --reward).
    A RewardFn found there is used as declared (=weight replaces its weight); a plain
    callable is a batched (TRL-shaped) function named after it, on the calling thread (an
    async one awaited with the step's other async calls).
    Errors are one-line ValueErrors naming the spec."""
    target, sep, weight = spec.rpartition("=")
    target = target if sep else spec
    module, _, attr = target.rpartition(":")
    if not module or not attr.isidentifier():
        raise ValueError(f"--reward {spec!r}: expected module:function[=weight] or "
                         f"file.py:function[=weight]")
    try:
        w = as_real(float(weight), "weight") if sep else None
    except ValueError:
        raise ValueError(f"--reward {spec!r}: the weight must be a finite number, got "
                         f"{weight!r}") from None
    mod = _import(spec, module)
    if not hasattr(mod, attr):
        raise ValueError(f"--reward {spec!r}: {module} has no attribute {attr!r}")
    obj = getattr(mod, attr)
    if isinstance(obj, RewardFn):
        return obj if w is None else dataclasses.replace(obj, weight=w)
    if not callable(obj):
        raise ValueError(f"--reward {spec!r}: {module}.{attr} is not callable")
    return RewardFn(obj, weight=1.0 if w is None else w, name=attr, batched=True)


def _import(spec: str, module: str):
    """The module by import name, or a .py file by path (loaded once per resolved path)."""
    path = pathlib.Path(module).resolve()
    by_path = module.endswith(".py") or "/" in module
    if by_path and not path.is_file():
        raise ValueError(f"--reward {spec!r}: no such file {module}")
    key = "_jaxrl_cache_reward_" + re.sub(r"\W", "_", str(path))
    try:
        if not by_path:
            return importlib.import_module(module)
        if key not in sys.modules:
            loader_spec = importlib.util.spec_from_file_location(key, path)
            mod = importlib.util.module_from_spec(loader_spec)
            sys.modules[key] = mod
            try:
                loader_spec.loader.exec_module(mod)
            except BaseException:
                del sys.modules[key]
                raise
            register_file_module(key, str(path))  # process=True functions load it there
        return sys.modules[key]
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 -- the user's module (SystemExit too): one line
        raise ValueError(f"--reward {spec!r}: importing {module} failed: "
                         f"{type(e).__name__}: {exception_line(e):.200}") from None
