"""Multi-turn episodes inside one rollout call: environments on worker threads, turns as
scheduler requests, and the Episode records.

Each episode is scheduler group e (its own prefix chain). Its environment is made and
reset on a worker thread; the first observation becomes turn 0's request. When a turn's row
retires (retire.py) the row's KV is already in the version's trie, and `turn_done` hands
the turn's text to the environment on a worker thread; the decode loop goes on with the
other rows. `ready` (the engine's host thread, between steps) turns the answers into the
next turns' requests: context = the whole history (first observation, turns,
observations), so only the new observation and the partial last page are prefilled when
the version did not change. Turn t of episode e is Row.index e * max_turns + t (its PRNG
stream).

Token records: turn tokens carry their row's log-probs, versions and mixed flags;
observation tokens are masked out (loss_mask False, log-prob 0) and carry the version of
the last sampled token before them. Which environment answers first decides the order in
which turns are admitted, so batching (not the distributions sampled) may differ between
runs with slow environments.

`env_timeout` bounds each environment call (factory + reset, or one step): past it the
episode ends with "error" (a TimeoutError message) and its late answer, if any, is
dropped. Python cannot stop a thread, so the stuck call keeps its worker thread until it
returns; worker threads are daemons (`DaemonThreads`), so a call that never returns never
holds the process at exit: a hung environment costs one parked thread, nothing more.

A fault in environment code ends only its episode ("error", with the exception's type and
message): a missing method, any exception, an invalid answer, and BaseExceptions raised by
it (SystemExit from a tool, a KeyboardInterrupt raised by the code itself). Environment
code runs only on worker threads: the factory, reset and step, and everything done with
what they return (the EnvStep's fields read, observations iterated and tokenized), so the
engine's thread receives token ids and floats only. Worker threads never receive signals,
so a KeyboardInterrupt on the engine's thread is a real Ctrl-C, and it stops the call.
"""
from __future__ import annotations

import dataclasses
import numbers
import queue
import time
from typing import Callable, Sequence

import numpy as np

from jaxrl_cache.checks import as_count, as_real
from jaxrl_cache.daemon_threads import DaemonThreads
from jaxrl_cache.errors import CacheFullError
from jaxrl_cache.rollout import scheduler, text
from jaxrl_cache.rollout.env import EnvStep
from jaxrl_cache.rollout.types import Episode, EpisodeBatch, WeightAck


GATHER_S = 0.005  # an idle engine waits this long after an answer for the next one


@dataclasses.dataclass
class _State:
    """One episode's host record while it runs."""
    index: int
    group: int
    task: object
    env: object = None
    prompt: tuple = ()
    history: list = dataclasses.field(default_factory=list)  # every token so far
    tokens: list = dataclasses.field(default_factory=list)  # history after the prompt
    mask: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)
    mixed: list = dataclasses.field(default_factory=list)
    turns: list = dataclasses.field(default_factory=list)
    texts: list = dataclasses.field(default_factory=list)
    rewards: list = dataclasses.field(default_factory=list)
    kv_versions: set = dataclasses.field(default_factory=set)
    cached: int = 0
    seen: int = 0  # history tokens the last turn's row had seen (its context + output)
    kv_version: int | None = None  # the one version that wrote all of that KV (else None)
    finish_reason: str | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class _Fault:
    """An environment call that raised: what ends its episode."""
    kind: str
    message: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"[:500]


class Driver:
    """The episodes of one rollout call (scheduler.Run.episodes). `pending` counts
    environment calls not yet collected by `ready`."""

    def __init__(self, tasks: list, env_factory, sampling, *, tokenizer, vocab_size: int,
                 max_turns: int, max_tokens: int, workers: int, keep: bool = False,
                 timeout: float | None = None):
        """keep (kv_policy "keep"): a next turn may continue over its history's KV of an
        older version while that version's entries are cached (its tokens are flagged).
        timeout: seconds per environment call (None: unbounded)."""
        self.env_factory, self.tokenizer, self.vocab = env_factory, tokenizer, vocab_size
        self.timeout = timeout
        self._deadlines: dict[int, float] = {}  # episode -> deadline of its call in flight
        self._tickets: list[int] = []  # per episode: the number of its current call
        self.keep = keep
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self.max_new = sampling.max_new_tokens
        self.states = [_State(g * sampling.n + j, g, task) for g, task in enumerate(tasks)
                       for j in range(sampling.n)]
        self.history_tokens = self.history_cached = self.recomputed = 0
        self.env_steps, self.env_seconds = 0, 0.0
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._pool = DaemonThreads(workers, name="env")
        self.pending = 0
        self._tickets = [0] * len(self.states)
        for e in range(len(self.states)):
            self._submit(e, self._reset, e, self.states[e].task)

    # ------------------------------------------------------------ worker threads
    def _submit(self, e: int, fn, *args) -> None:
        self.pending += 1
        self._tickets[e] += 1
        ticket = self._tickets[e]
        if self.timeout is not None:
            self._deadlines[e] = time.perf_counter() + self.timeout
        self._pool.submit(_timed, fn, *args, done=lambda answer: self._answers.put(
            (e, ticket, answer, time.perf_counter())))  # when it answered: vs its deadline

    def _expire(self) -> None:
        """Ends the episodes whose environment call passed its deadline; their answers, if
        they ever come, are dropped (the ticket moved on)."""
        now = time.perf_counter()
        for e, deadline in list(self._deadlines.items()):
            if deadline <= now:
                del self._deadlines[e]
                self._tickets[e] += 1
                self.pending -= 1
                st = self.states[e]
                what = "reset" if st.env is None else f"step after turn {len(st.turns)}"
                st.finish_reason = "error"
                st.error = (f"TimeoutError: the environment's {what} took more than "
                            f"{self.timeout:g} s (env_timeout)")

    def _reset(self, e: int, task) -> tuple:
        """Worker thread: (episode e's environment, its first observation's ids)."""
        env = self.env_factory(task)
        observation = env.reset()
        if text.is_messages(observation):
            if self.tokenizer is None:
                raise TypeError("the first observation is chat messages: the engine needs "
                                "a tokenizer")
            ids = text.render_chat(self.tokenizer, e, observation)
        else:
            ids = self._encode(observation, first=True)
        if not ids:
            raise ValueError("the first observation is empty")
        return env, tuple(ids)

    def _step(self, env, turn_text) -> tuple:
        """Worker thread: env.step's answer as (observation ids or None when the episode
        ends, reward, done)."""
        answer = env.step(turn_text)
        if not isinstance(answer, EnvStep):
            raise TypeError(f"step() must return an EnvStep, got {type(answer).__name__}")
        reward = _reward(answer.reward)
        done = bool(answer.done) or answer.observation is None
        return None if done else self._encode(answer.observation, first=False), reward, done

    def _encode(self, observation, *, first: bool) -> list[int]:
        """Worker thread: a text or token-id observation as checked token ids."""
        if isinstance(observation, str):
            if self.tokenizer is None:
                raise TypeError("a text observation needs an engine with a tokenizer")
            return self.tokenizer.encode(str(observation), add_special_tokens=first)
        if isinstance(observation, (bytes, dict)) or not hasattr(observation, "__len__"):
            raise TypeError(f"an observation must be text or token ids, got "
                            f"{type(observation).__name__}")
        items = list(observation)
        if any(isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral)
               for t in items) or any(not 0 <= t < self.vocab for t in items):
            raise ValueError(f"observation token ids must be integers in [0, {self.vocab})")
        return [int(t) for t in items]

    # ------------------------------------------------------------ host thread
    def wait(self) -> None:
        """Blocks until an environment answered, then while more answers keep coming (a
        quiet GATHER_S ends it): turns that ended together come back as one admission round
        instead of a decode chunk each. Short sleeps, so signals still land."""
        while self._answers.empty():
            if self._deadlines and min(self._deadlines.values()) <= time.perf_counter():
                return  # `ready` ends the episode that timed out
            time.sleep(0.001)
        seen, quiet = self._answers.qsize(), time.perf_counter() + GATHER_S
        while seen < self.pending and time.perf_counter() < quiet:
            time.sleep(0.001)
            if self._answers.qsize() > seen:
                seen, quiet = self._answers.qsize(), time.perf_counter() + GATHER_S

    def ready(self) -> list[scheduler.Request]:
        """Collects every answer so far; the next turns' requests, in arrival order. A call
        is judged by when it answered, not by when this thread got to its answer (a long
        decode chunk or compile in between times out nothing), then the calls still out
        past their deadline are ended."""
        out = []
        while True:
            try:
                e, ticket, answer, answered = self._answers.get_nowait()
            except queue.Empty:
                break
            if ticket != self._tickets[e]:
                continue  # the call timed out before it answered: already ended
            if answered > self._deadlines.get(e, answered):
                continue  # answered too late: `_expire` ends it below
            self.pending -= 1
            self._deadlines.pop(e, None)
            st = self.states[e]
            if isinstance(answer, _Fault):
                st.finish_reason, st.error = "error", str(answer)
                continue
            value, seconds = answer
            self.env_seconds += seconds
            request = self._first(e, st, *value) if st.env is None else \
                self._next(e, st, *value)
            if request is not None:
                out.append(request)
        self._expire()
        return out

    def _first(self, e: int, st: _State, env, ids: tuple) -> scheduler.Request | None:
        st.env, st.prompt, st.history = env, ids, list(ids)
        return self._request(e, st)

    def _next(self, e: int, st: _State, ids: list | None, reward: float, done: bool
              ) -> scheduler.Request | None:
        self.env_steps += 1
        st.rewards.append(reward)
        if done:
            st.finish_reason = "done"
            return None
        if len(st.turns) >= self.max_turns:
            st.finish_reason = "max_turns"
            return None
        if len(st.history) + len(ids) + 1 > self.max_tokens:
            st.finish_reason = "token_budget"
            return None
        version = st.versions[-1]
        st.history += ids
        st.tokens += ids
        st.mask += [False] * len(ids)
        st.logprobs += [0.0] * len(ids)
        st.versions += [version] * len(ids)
        st.mixed += [False] * len(ids)
        return self._request(e, st)

    def _request(self, e: int, st: _State) -> scheduler.Request | None:
        room = self.max_tokens - len(st.history)
        if room < 1:
            st.finish_reason = "token_budget"
            return None
        return scheduler.Request(e, e * self.max_turns + len(st.turns), tuple(st.history),
                                 min(self.max_new, room),
                                 st.kv_version if self.keep else None)

    def turn_done(self, row: scheduler.Row, turn_text) -> None:
        """A turn's row retired (its KV is cached): record it, ask its environment."""
        st = self.states[row.group]
        if st.turns:  # what the previous turn had seen came from the cache, or not
            served = min(row.cached_tokens, st.seen)
            self.history_tokens += st.seen
            self.history_cached += served
            if row.token_versions and row.token_versions[0] != st.versions[-1] and \
                    row.kv_now == {row.token_versions[0]}:
                self.recomputed += st.seen - served  # re-prefilled after an update
        start = len(st.tokens)
        st.tokens += row.tokens
        st.history += row.tokens
        st.mask += [True] * len(row.tokens)
        st.logprobs += row.logprobs
        st.versions += row.token_versions
        st.mixed += row.mixed
        st.turns.append((start, len(st.tokens)))
        st.texts.append(turn_text if isinstance(turn_text, str) else "")
        st.kv_versions |= row.kv_versions
        st.cached += row.cached_tokens
        st.seen = len(st.history)
        st.kv_version = next(iter(row.kv_now)) if len(row.kv_now) == 1 else None
        self._submit(row.group, self._step, st.env, turn_text)

    def close(self) -> None:
        """Lets worker threads finish on their own; queued environment calls are dropped."""
        self._pool.close()

    def episodes(self) -> list[Episode]:
        out = []
        for st in self.states:
            mixed = np.asarray(st.mixed, bool)
            out.append(Episode(
                index=st.index, group=st.group, prompt_ids=st.prompt,
                token_ids=tuple(st.tokens), loss_mask=np.asarray(st.mask, bool),
                logprobs=np.asarray(st.logprobs, np.float32),
                token_versions=np.asarray(st.versions, np.int64), turns=tuple(st.turns),
                turn_texts=tuple(st.texts), rewards=tuple(st.rewards),
                finish_reason=st.finish_reason, cached_tokens=st.cached,
                kv_versions=tuple(sorted(st.kv_versions)),
                mixed_tokens=mixed if mixed.any() else None, error=st.error))
        return out


@dataclasses.dataclass(frozen=True)
class EpisodeSpec:
    """An episode call's settings, checked (`prepare`): what each run's Driver is built
    from."""
    tasks: tuple
    env_factory: Callable  # task -> environment
    sampling: object  # SamplingParams
    tokenizer: object
    vocab_size: int
    max_turns: int
    max_tokens: int  # of an episode: context + output
    workers: int  # environment threads
    keep: bool  # kv_policy "keep"
    timeout: float | None  # seconds per environment call

    def driver(self) -> "Driver":
        """A fresh Driver for one run of the call."""
        return Driver(list(self.tasks), self.env_factory, self.sampling,
                      tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                      max_turns=self.max_turns, max_tokens=self.max_tokens,
                      workers=self.workers, keep=self.keep, timeout=self.timeout)


def prepare(tasks, env_factory, sampling, *, tokenizer, config, cache_config, max_turns,
            max_episode_tokens, env_workers, keep, env_timeout=None) -> EpisodeSpec:
    """rollout_episodes' arguments checked before any work. Raises TypeError/ValueError, or
    CacheFullError when one episode at its token budget could not fit the KV pool."""
    if isinstance(tasks, (str, bytes)) or not isinstance(tasks, Sequence) or not tasks:
        raise TypeError(f"tasks must be a non-empty sequence, got {type(tasks).__name__}")
    if not callable(env_factory):
        raise TypeError(f"env_factory must be callable (task -> environment), got "
                        f"{type(env_factory).__name__}")
    limit = config.max_seq_len
    max_turns = as_count(max_turns, "max_turns", minimum=1, maximum=2**16)
    env_workers = as_count(min(len(tasks) * sampling.n, 64) if env_workers is None
                           else env_workers, "env_workers", minimum=1, maximum=1024)
    max_tokens = as_count(limit if max_episode_tokens is None else max_episode_tokens,
                          "max_episode_tokens", minimum=2, maximum=limit)
    if env_timeout is not None:
        env_timeout = as_real(env_timeout, "env_timeout", minimum=0.0, open_min=True)
    ps, usable = cache_config.page_size, cache_config.num_pages - 1
    need = scheduler.pages_for(max_tokens - 1, ps)
    if need > usable:
        raise CacheFullError(
            f"one episode may need {need} KV pages (max_episode_tokens {max_tokens}, "
            f"page_size {ps}) but the pool has only {usable}; use a larger "
            f"CacheConfig.num_pages or a smaller max_episode_tokens")
    return EpisodeSpec(tuple(tasks), env_factory, sampling, tokenizer, config.vocab_size,
                       max_turns, max_tokens, env_workers, bool(keep), env_timeout)


def _reward(value) -> float:
    """An EnvStep's reward as a finite float (a Fraction or another numbers.Real too)."""
    if isinstance(value, numbers.Real) and not isinstance(
            value, (bool, int, float, np.integer, np.floating)):
        value = float(value)
    return as_real(value, "reward")


def _timed(fn, *args):
    """(fn(*args), seconds), or the _Fault of whatever it raised (BaseException included:
    on a worker thread nothing is a real Ctrl-C, and a SystemExit must not end the
    training script)."""
    start = time.perf_counter()
    try:
        return fn(*args), time.perf_counter() - start
    except BaseException as exc:  # noqa: BLE001 - the environment's fault, recorded
        return _Fault(type(exc).__name__, str(exc))


def batch(run: scheduler.Run, start: float, ack: WeightAck | None) -> EpisodeBatch:
    """The finished call's episodes; start: its perf_counter start; ack: the sync it
    committed."""
    d = run.episodes
    return EpisodeBatch(
        episodes=d.episodes(), version=run.start_version, sampling=run.sampling,
        prefill_tokens=run.computed, cached_tokens=sum(st.cached for st in d.states),
        history_tokens=d.history_tokens, history_cached=d.history_cached,
        decode_steps=run.steps, decode_chunks=run.chunks, prefill_launches=run.prefills,
        env_steps=d.env_steps, env_seconds=d.env_seconds,
        seconds=time.perf_counter() - start, sync_ack=ack,
        recomputed_tokens=run.recomputed + d.recomputed, weight_updates=run.updates)
