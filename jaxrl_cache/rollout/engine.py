"""RolloutEngine: the host shell around the jitted prefill / decode-chunk core.

One lock serialises `rollout` and `sync_weights`. The policy version is read once, under that
lock, and every sample of a rollout is stamped with it. Prefix KV is looked up and inserted
under that version only; a sync to a newer version drops every older entry before it
acknowledges.

Transactions: engine state (version, resident params) changes in one assignment, after
everything that can fail. A rollout at a newer version (either mode) stages its params
(validated resident copy, nothing committed), generates under the new version's cache
namespace and commits the sync in its cleanup, only once generation succeeded: a failure or
interrupt before that leaves the old version, params and cache (the new namespace's
entries are dropped by the reconcile). Asynchronous mode only: a sync that lands during the
call commits then, as acknowledged, whatever the call's outcome; the call switches to it if
it is newer than the call's version, ignores it otherwise, and its own staged version is
committed at the end only if still newer than the engine's. Prefix pages enter
the radix trie only after the prefill that wrote them was dispatched, so a failure can lose
cache entries but never leave a wrong one. Between calls no request holds a page, so every
call ends (and starts) by reconciling the pool with the trie: an interrupted call cannot
leak pages or leave a stale version's entries behind.
"""
from __future__ import annotations

import collections
import dataclasses
import numbers
import operator
import os
import threading
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_cache.cache import CacheStats, PackedTokens, RadixCache
from jaxrl_cache.checks import as_count
from jaxrl_cache.errors import CacheFullError, VersionError
from jaxrl_cache.interrupts import allow_signals, deferred_signals
from jaxrl_cache.models import ModelConfig, init_kv_cache, init_params
from jaxrl_cache.rollout import core, scheduler, text
from jaxrl_cache.rollout.sampling import SamplingParams
from jaxrl_cache.rollout.types import (CacheConfig, RolloutBatch, Sample, SchedulerConfig,
                                       WeightAck)
from jaxrl_cache.shapes import page_width_bucket
from jaxrl_cache.versioning import as_version
from kernels_pallas._common import next_power_of_2, resolve_backend


class _Weights(NamedTuple):
    """The engine's committed weights: replaced in one assignment."""
    version: int
    params: object  # resident copy on the engine's device (None before the first sync)
    source: tuple  # the caller's leaves they came from (identity checks)
    staged_seconds: float = 0.0  # time spent validating and copying them (sync_ack.seconds)


def _same_leaves(tree, leaves) -> bool:
    """True iff `tree`'s leaves are the very objects in `leaves` (held, so ids stay unique)."""
    mine = jax.tree.leaves(tree)
    return len(mine) == len(leaves) and all(a is b for a, b in zip(mine, leaves))


@jax.jit
def _all_finite(params) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)]))


def _check_rng(rng) -> None:
    if not isinstance(rng, jax.Array):
        raise TypeError(f"rng must be a jax PRNG key (jax.random.key(seed)), got "
                        f"{type(rng).__name__}")
    typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
    if not ((typed and rng.shape == ()) or (rng.dtype == jnp.uint32 and rng.shape == (2,))):
        raise TypeError(f"rng must be a single PRNG key (jax.random.key(seed)), got "
                        f"{rng.dtype}{list(rng.shape)}")


KV_POLICIES = ("wait", "recompute", "keep")
MAX_POLICY_LAG = 1024  # a reconcile walks the window's versions: its cost is O(lag)


def _resize_rows(x, rows: int):
    """x [B, V] cut or zero-padded to [rows, V] (decode slots beyond B are empty)."""
    if x.shape[0] >= rows:
        return x[:rows]
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


class RolloutEngine:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig = CacheConfig(), *,
                 scheduler_config: SchedulerConfig = SchedulerConfig(), backend: str = "auto",
                 version=0, device=None, mesh=None, kv_policy: str = "wait",
                 max_policy_lag: int = 0, tokenizer=None):
        """mesh: a jax Mesh with a "tensor" axis (parallel.make_mesh): params and the KV pool
        are sharded tensor-parallel over it and syncs reshard into that layout; without one
        the engine runs on `device` (default: the first device).

        kv_policy: what a weight sync does to a rollout in flight.
          "wait" (synchronous): the sync waits for the whole rollout call; every sample has
            one version.
          "recompute": the sync waits for the current decode chunk only; running rows drop
            their KV and re-prefill prompt + tokens so far with the new params before their
            next token, so every token's logits and all KV it saw come from one version.
          "keep" (PipelineRL-style): as recompute, but running rows keep their old KV; tokens
            sampled over KV of another version are flagged (`Sample.mixed_tokens`).
        max_policy_lag: prefix entries of the last max_policy_lag versions before the current
        one stay cached (each reused only by requests of its own version; eviction takes the
        oldest version first); a sync drops the versions that leave this window. At most
        MAX_POLICY_LAG (1024): every call reconciles the cache against the window.
        tokenizer: the model's (models.load_tokenizer): prompts may then be text or chat
        messages, samples carry decoded text and SamplingParams.stop works (rollout/text.py).
        """
        if kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy must be one of {KV_POLICIES}, got {kv_policy!r}")
        self.kv_policy = kv_policy
        self.max_policy_lag = as_count(max_policy_lag, "max_policy_lag",
                                       maximum=MAX_POLICY_LAG)
        if not isinstance(model_config, ModelConfig):
            raise TypeError(f"model_config must be a ModelConfig, got "
                            f"{type(model_config).__name__}")
        if not isinstance(cache_config, CacheConfig):
            raise TypeError(f"cache_config must be a CacheConfig, got "
                            f"{type(cache_config).__name__}")
        if not isinstance(scheduler_config, SchedulerConfig):
            raise TypeError(f"scheduler_config must be a SchedulerConfig, got "
                            f"{type(scheduler_config).__name__}")
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.backend = resolve_backend(backend)
        if mesh is not None and device is not None:
            raise ValueError("pass either device or mesh, not both")
        self.device = device or jax.devices()[0]
        self.mesh = mesh
        self.tokenizer = text.check_tokenizer(tokenizer, model_config)  # text
        self._check_pool_fits()
        self.cache = RadixCache(cache_config.num_pages, cache_config.page_size)
        self._weights = _Weights(as_version(version), None, ())
        self._lock = threading.Lock()  # one rollout step or sync at a time
        self._call_lock = threading.Lock()  # asynchronous mode: one rollout call at a time
        self._active: _Run | None = None  # asynchronous mode: the rollout call in flight
        self._param_shapes = jax.eval_shape(lambda k: init_params(model_config, k),
                                            jax.random.key(0))
        self._placement = self.device
        if mesh is not None:
            from jaxrl_cache import parallel
            self._placement = parallel.rollout_shardings(self._param_shapes, model_config, mesh)
        self._kv = self._fresh_pool()

    def _check_pool_fits(self) -> None:
        """Refuses a KV pool larger than the device's memory (host RAM on CPU) up front."""
        shapes = jax.eval_shape(lambda: init_kv_cache(
            self.model_config, self.cache_config.num_pages, self.cache_config.page_size))
        need = sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(shapes))
        stats = self.device.memory_stats() if hasattr(self.device, "memory_stats") else None
        limit = (stats or {}).get("bytes_limit")
        if limit is None and hasattr(os, "sysconf"):
            limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if limit and need > limit:
            raise ValueError(
                f"CacheConfig.num_pages={self.cache_config.num_pages} needs a KV pool of "
                f"{need / 2**30:.1f} GiB but the device has {limit / 2**30:.1f} GiB; use fewer "
                f"pages")

    def _fresh_pool(self):
        cfg = self.cache_config
        if self.mesh is not None:
            from jaxrl_cache import parallel
            return parallel.engine_kv_cache(self.model_config, cfg.num_pages, cfg.page_size,
                                            self.mesh)
        return jax.device_put(init_kv_cache(self.model_config, cfg.num_pages, cfg.page_size),
                              self.device)

    def _cache_key(self, version: int) -> int:
        """The radix namespace of `version`: the version itself (invariant 1). Tests override
        it to reproduce the stale-KV bug of public projects and check the audit catches it."""
        return version

    @property
    def version(self) -> int:
        return self._weights.version

    # ------------------------------------------------------------------ weight sync
    def sync_weights(self, params, version) -> WeightAck:
        """Makes `params` the engine's weights for `version` and acknowledges.

        Waits for any in-flight rollout (same lock). Newer version: params copied onto the
        engine's device (never aliasing the caller's buffers), checked finite, resident; every
        older prefix entry dropped; then the version is committed. Same version: idempotent
        (nothing invalidated). Older: VersionError. If anything fails, the previous version,
        weights and cache stay as they were.
        """
        version = as_version(version)
        return self._serialized(self._sync, params, version)

    def _sync(self, params, version: int) -> WeightAck:
        start = time.perf_counter()
        staged = self._stage(params, version)
        if staged is None:  # same version, same params
            return WeightAck(version, version, 0, time.perf_counter() - start,
                             tuple(self.cache.versions()))
        return self._commit(staged, start)

    def _serialized(self, fn, *args):
        """Runs fn under the engine lock, then reconciles the cache. SIGINT/SIGTERM are
        deferred everywhere but inside fn (interrupts.allow_signals), so an interrupt can
        never land between taking and releasing the lock or inside the reconcile."""
        with deferred_signals():
            with self._lock:
                try:
                    return allow_signals(fn, *args)
                finally:
                    self._reconcile()

    def _stage(self, params, version: int) -> _Weights | None:
        """Validated resident copy of `params` for a newer `version` (nothing committed)."""
        current = self._weights
        if version < current.version:
            raise VersionError(f"version {version} is older than the engine's version "
                               f"{current.version}; versions only move forward")
        if version == current.version and current.params is not None:
            if not _same_leaves(params, current.source):
                raise VersionError(
                    f"version {version} is already synced with different params; a weight "
                    f"change must come with a new version (got {version} again)")
            return None
        begun = time.perf_counter()
        self._check_params(params)
        # copies: the caller may mutate its numpy arrays (device_put of numpy can be
        # zero-copy on CPU, whatever may_alias says) or donate its jax arrays afterwards
        owned = jax.tree.map(lambda x: np.array(x, copy=True) if isinstance(x, np.ndarray)
                             else x, params)
        resident = jax.block_until_ready(
            jax.device_put(owned, self._placement, may_alias=False))
        if not bool(_all_finite(resident)):
            raise ValueError(f"params for version {version} contain NaN or Inf; refusing "
                             f"to sync them")
        return _Weights(version, resident, tuple(jax.tree.leaves(params)),
                        time.perf_counter() - begun)

    def _commit(self, staged: _Weights, start: float | None = None) -> WeightAck:
        """Commits staged weights; the ack's seconds are the sync's own time (staging from
        `start`, or the staged copy's own time, plus this commit), never a rollout's."""
        start = (time.perf_counter() - staged.staged_seconds) if start is None else start
        previous = self._weights.version
        oldest = self._cache_key(max(staged.version - self.max_policy_lag, 0))
        before = set(self.cache.versions())
        with deferred_signals():  # the rollout's reaction, invalidation and commit land together
            recomputed = 0
            if self._active is not None:  # asynchronous mode, between two decode chunks
                recomputed = self._active.on_update(staged)
            invalidated = self.cache.invalidate_before(
                oldest, held=self._active is not None and self.kv_policy == "keep")
            self._weights = staged  # the commit: one assignment
        return WeightAck(staged.version, previous, invalidated, time.perf_counter() - start,
                         tuple(self.cache.versions()),
                         tuple(sorted(before - set(self.cache.versions()))), recomputed)

    def _window(self) -> tuple:
        """Cache namespaces that may hold entries: the versions inside the lag window."""
        v = self._weights.version
        return tuple({self._cache_key(u) for u in range(max(v - self.max_policy_lag, 0), v + 1)})

    def _reconcile(self) -> None:
        """Between calls (no rollout in flight): only the window's entries, refcounts = trie
        references. A call killed between its last step and its cleanup left `_active` set
        with nobody running it: it is cleaned up here."""
        if self._active is not None:
            if self._call_lock.locked():
                return  # a rollout is in flight; its rows hold pages
            self._end_run(self._active)
        self.cache.reconcile(keep_versions=self._window())

    def _check_params(self, params) -> None:
        want = jax.tree.structure(self._param_shapes)
        got = jax.tree.structure(params)
        if got != want:
            raise ValueError(f"params tree does not match the model config: {got} vs {want}")
        for path, a, b in zip(jax.tree_util.tree_leaves_with_path(params),
                              jax.tree.leaves(params), jax.tree.leaves(self._param_shapes)):
            if getattr(a, "shape", None) != b.shape or getattr(a, "dtype", None) != b.dtype:
                raise ValueError(f"param {jax.tree_util.keystr(path[0])} is "
                                 f"{getattr(a, 'dtype', type(a).__name__)}"
                                 f"{list(getattr(a, 'shape', ()))}, the model config needs "
                                 f"{b.dtype}{list(b.shape)}")

    # ------------------------------------------------------------------ rollout
    def rollout(self, params, version, prompts: Sequence[Sequence[int]],
                sampling: SamplingParams, *, rng: jax.Array) -> RolloutBatch:
        """Generates sampling.n samples per prompt with the params of `version`.

        Any number of prompts: the scheduler queues what does not fit the pool or the decode
        slots. A newer version is staged first and committed only once generation succeeded
        (see the module doc for syncs landing during an asynchronous call); the current
        version proceeds (its params must be the ones synced); an older one
        raises VersionError. Bad input, and a single sample that can never fit the pool,
        raise before any work. Samples come back in prompt order, sample j of prompt g at
        g * n + j; the same inputs and rng give the same samples. With a tokenizer a prompt
        may also be a str or a list of chat messages (converted to ids first).
        """
        version = as_version(version)
        prompts = text.encode_prompts(self.tokenizer, prompts, sampling)  # text
        prompts = self._check_request(prompts, sampling, rng)

        if self.kv_policy == "wait":
            return self._serialized(self._rollout, params, version, prompts, sampling, rng)
        return self._rollout_async(params, version, prompts, sampling, rng)

    def _rollout(self, params, version: int, prompts, sampling, rng) -> RolloutBatch:
        """Synchronous mode: the whole call under the lock, committed at the end."""
        start = time.perf_counter()
        staged = self._stage(params, version)
        weights = staged or self._weights
        if staged is None and version != self._weights.version:
            raise VersionError(f"rollout at version {version} but the engine is at "
                               f"{self._weights.version}; versions only move forward")
        run = _Run(self, weights, prompts, sampling, rng)
        try:
            while not run.done:
                run.step()
        finally:
            self._end_run(run)
        ack = None if staged is None else self._commit(staged)
        return run.batch(start, ack)

    def _rollout_async(self, params, version: int, prompts, sampling, rng) -> RolloutBatch:
        """Asynchronous mode: the lock is taken per step (admit, prefill, one decode chunk),
        so a sync lands between chunks; `_commit` tells the run (`_Run.on_update`). A newer
        `version` is staged by `_start_run` and committed by `_finish_run`, which only the
        successful path reaches."""
        start = time.perf_counter()
        with self._call_lock:
            run, staged = self._serialized(self._start_run, params, version, prompts,
                                           sampling, rng)
            try:
                while not run.done:
                    self._between_steps(run)
                    self._serialized(run.step)
            except BaseException:
                self._serialized(self._end_run, run)
                raise
            ack = self._serialized(self._finish_run, run, staged, start)
        return run.batch(start, ack)

    def _start_run(self, params, version: int, prompts, sampling, rng
                   ) -> tuple["_Run", _Weights | None]:
        """The call's run at the committed version, or at a newer one staged for it (returned
        too; nothing committed)."""
        if self._active is not None:  # left by a call killed before its cleanup
            self._end_run(self._active)
        staged = self._stage(params, version)  # None: the committed version and params
        self._active = _Run(self, staged or self._weights, prompts, sampling, rng)
        return self._active, staged

    def _finish_run(self, run: "_Run", staged: _Weights | None, start: float
                    ) -> WeightAck | None:
        """A call that succeeded: its cleanup, then the commit of the version it was staged
        at, unless a sync during the call committed that version or a newer one (None)."""
        self._end_run(run)
        current = self._weights
        if staged is None or (staged.version <= current.version and current.params is not None):
            return None
        return self._commit(staged)

    def _between_steps(self, run: "_Run") -> None:
        """Asynchronous mode: called between steps, outside the lock (tests override it to
        force weight updates at chosen chunk boundaries)."""

    def _end_run(self, run: "_Run") -> None:
        """On the way out of a call (success or failure): the run's rows let go of their
        pages; a pool lost to a failure after donation is rebuilt empty."""
        run.release_all()
        if self._active is run:
            self._active = None
        if any(x.is_deleted() for x in jax.tree.leaves(self._kv)):
            self.cache.clear()
            self._kv = self._fresh_pool()

    def _check_request(self, prompts, sampling: SamplingParams, rng) -> list[tuple]:
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        _check_rng(rng)
        vocab, limit = self.model_config.vocab_size, self.model_config.max_seq_len
        bad_stops = [t for t in sampling.stop_token_ids if not 0 <= t < vocab]
        if bad_stops:
            raise ValueError(f"sampling.stop_token_ids {bad_stops} are outside the vocabulary "
                             f"[0, {vocab})")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a list of token-id sequences, got "
                            f"{type(prompts).__name__}")
        if len(prompts) == 0:
            raise ValueError("prompts must be a non-empty list of token-id sequences")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, (str, bytes)) or not isinstance(p, (Sequence, np.ndarray)):
                raise TypeError(f"prompt {i} must be a sequence of integer token ids, got "
                                f"{type(p).__name__}")
            if any(isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral)
                   for t in p):
                raise TypeError(f"prompt {i} must be a sequence of integer token ids, got "
                                f"{p!r:.80}")
            p = tuple(operator.index(t) for t in p)
            if not p:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
            if len(p) + sampling.max_new_tokens > limit:
                raise ValueError(f"prompt {i}: {len(p)} tokens + max_new_tokens "
                                 f"{sampling.max_new_tokens} exceeds max_seq_len {limit}")
            out.append(p)
        ps, usable = self.cache_config.page_size, self.cache_config.num_pages - 1
        need = max(scheduler.row_pages(len(p), sampling.max_new_tokens, ps) for p in out)
        if need > usable:
            raise CacheFullError(
                f"one sample needs {need} KV pages (longest prompt {max(map(len, out))} + "
                f"max_new_tokens {sampling.max_new_tokens}, page_size {ps}) but the pool has "
                f"only {usable}; use a larger CacheConfig.num_pages or shorter requests")
        return out

    def cache_stats(self) -> CacheStats:
        return self._serialized(self.cache.stats)


class _Run:
    """One rollout call's scheduling loop (host state of the call; the engine owns the rest).

    `step` is one round: admit (re-prefill rows whose KV a weight update dropped first, then
    waiting samples), one packed prefill, one decode chunk. In asynchronous mode the engine
    takes its lock per step and `on_update` may change the weights between two steps.
    """

    def __init__(self, engine: RolloutEngine, weights: _Weights, prompts, sampling, rng):
        self.engine, self.weights, self.sampling, self.rng = engine, weights, sampling, rng
        self.start_version = weights.version
        self.cache = engine.cache
        self.ps = engine.cache_config.page_size
        self.share = engine.cache_config.prefix_cache
        cfg = engine.scheduler_config
        self.slots: list = [None] * cfg.max_num_seqs
        n = sampling.n
        # Without sharing, each sample is a unit of its own (a baseline).
        self.waiting = collections.deque((g, j) for g in range(len(prompts)) for j in range(n))
        self.prompts = prompts
        # each prompt packed once for the cache; a sample's sequences extend it (_packed)
        self.packed = [PackedTokens.of(p) for p in prompts] if self.share else None
        self.width = page_width_bucket(max(
            scheduler.row_pages(len(p), sampling.max_new_tokens, self.ps) for p in prompts))
        self.finished: dict[int, scheduler.Row] = {}
        self.computed = self.steps = self.chunks = self.prefills = 0
        self.recomputed = 0  # context tokens re-prefilled after weight updates
        self.updates = 0  # weight updates that landed while this call ran
        self.stops = np.full(next_power_of_2(max(1, len(sampling.stop_token_ids))), -1,
                             np.int32)
        self.stops[:len(sampling.stop_token_ids)] = sampling.stop_token_ids
        self.knobs = sampling.as_arrays()
        self.fresh_logits = None
        tok = engine.tokenizer  # text: decoded outputs, stop strings
        self.text = None if tok is None else text.RowText(tok, sampling)

    @property
    def key(self) -> int:
        """The radix namespace of the run's current version."""
        return self.engine._cache_key(self.weights.version)

    def _packed(self, group: int, tokens: Sequence[int]) -> PackedTokens:
        """tokens (prompt `group`, then outputs) in the cache's form: only what follows the
        prompt is converted."""
        packed = self.packed[group]
        n = packed.num_tokens
        return packed if len(tokens) == n else packed.extend(tokens[n:])

    @property
    def done(self) -> bool:
        return not self.waiting and all(r is None for r in self.slots)

    def step(self) -> None:
        engine = self.engine
        if engine._active is self and engine._weights.version > self.weights.version:
            self.weights = engine._weights  # a sync during the call moved past its version
        units = self.admit()
        if units:
            self.prefill(units)
        elif all(r is None or r.resume for r in self.slots):
            raise AssertionError("scheduler made no progress")  # the pre-check forbids it
        self.decode()

    def on_update(self, staged: _Weights) -> int:
        """A weight sync landed between two steps (engine lock held). "recompute": every
        running row lets go of its pages and will re-prefill its context with the new params
        before its next token; returns the tokens that will be recomputed. "keep": nothing
        to do, rows continue over their old KV (their next tokens are flagged mixed). A sync
        to a version the run is already at or past (its own staged one) does not concern it."""
        if staged.version <= self.weights.version:
            return 0
        self.updates += 1
        if self.engine.kv_policy != "recompute":
            return 0
        tokens = 0
        for row in self.slots:
            if row is not None and not row.resume:
                self.cache.release(row.pages)
                row.pages, row.resume, row.kv_now = np.zeros(0, np.int32), True, set()
                tokens += len(row.context)
        return tokens

    # ---- admission
    def admit(self) -> list[tuple[scheduler.Unit, list[int]]]:
        """Re-prefills rows whose KV an update dropped, then admits waiting samples in order
        while slots and pages allow (one unit per prompt run). Prompt pages of earlier units
        of this round are shared by later ones."""
        cfg = self.engine.scheduler_config
        units, budget, pending = [], cfg.max_prefill_tokens, {}
        for slot, row in enumerate(self.slots):
            if row is None or not row.resume:
                continue
            unit = self._try_resume(row, pending, budget if units else None)
            if unit is None:
                return units  # what does not fit waits; resumes go before new samples
            units.append((unit, [slot]))
            budget -= unit.new_tokens
            self.recomputed += unit.new_tokens
        free = [i for i, r in enumerate(self.slots) if r is None]
        while self.waiting and free and budget > 0:
            g, j = self.waiting[0]
            prompt = self.prompts[g]
            rows = 1
            if self.share:
                while (rows < len(free) and rows < len(self.waiting)
                       and self.waiting[rows][0] == g):
                    rows += 1
            unit = self._try_unit(g, j, prompt, rows, pending, budget if units else None)
            if unit is None:
                break
            for _ in range(len(unit.rows)):
                self.waiting.popleft()
            taken, free = free[:len(unit.rows)], free[len(unit.rows):]
            for slot, row in zip(taken, unit.rows):
                self.slots[slot] = row
            units.append((unit, taken))
            budget -= unit.new_tokens
        return units

    def _try_unit(self, g, j, prompt, rows, pending, budget):
        """Matches, allocates and lays out a unit of up to `rows` samples (fewer if pages are
        short); None, changing nothing, if not even one fits now or the prefill budget of
        this round is spent (budget None: the round's first unit, always within budget)."""
        n_new = self.sampling.max_new_tokens
        got = self._claim(g, prompt, rows, n_new, pending, budget)
        if got is None:
            return None
        matched, fresh, m = got
        unit = scheduler.layout_unit(g, prompt, g * self.sampling.n + j, matched, fresh, m,
                                     n_new, self.ps)
        prefix = unit.rows[0].pages[:len(prompt) // self.ps]
        if m > 1:  # every row holds one reference to each of its prefix pages
            self.cache.pool.incref(np.tile(prefix, m - 1))
        for row in unit.rows:
            row.kv_now, row.kv_versions = {self.weights.version}, {self.weights.version}
        if self.share:
            self._remember(pending, self.packed[g], prefix)
        return unit

    def _try_resume(self, row: scheduler.Row, pending, budget):
        """A one-row unit re-prefilling `row`'s context with the current params (None,
        changing nothing, if it does not fit now)."""
        context, remaining = row.context, self.sampling.max_new_tokens - len(row.tokens)
        got = self._claim(row.group, context, 1, remaining, pending, budget)
        if got is None:
            return None
        matched, fresh, _ = got
        unit = scheduler.resume_unit(row, matched, fresh, self.sampling.max_new_tokens,
                                     self.ps)
        row.kv_now = {self.weights.version}
        row.kv_versions.add(self.weights.version)
        if self.share:
            self._remember(pending, self._packed(row.group, context),
                           row.pages[:len(context) // self.ps])
        return unit

    def _claim(self, group, context, rows, n_new, pending, budget):
        """Pins the cached prefix of `context` (prompt `group` + outputs; trie, then this
        round's pending prefills) and allocates fresh pages for up to `rows` rows generating
        up to n_new tokens each. Returns (matched int32 [c], fresh int32 [f], rows granted)
        or None, changing nothing."""
        cache, ps = self.cache, self.ps
        # the last token is always computed: its logits start decode
        head = self._packed(group, context).head(len(context) - 1) if self.share else ()
        in_trie = cache.peek(self.key, head) if self.share else 0
        extra = self._pending_pages(head, in_trie, pending)
        cached = (in_trie + extra.size) * ps
        if budget is not None and len(context) - cached > budget:
            return None
        shared, own = scheduler.unit_page_need(len(context), cached, rows, n_new, ps)
        available = cache.pool.num_free  # enough for every row: evictable pages not counted
        if shared + rows * own > available:
            available = cache.available_pages - in_trie  # pinning may take evictable pages
        for m in range(rows, 0, -1):
            shared, own = scheduler.unit_page_need(len(context), cached, m, n_new, ps)
            if shared + m * own <= available:
                break
        else:
            return None
        try:
            matches, fresh = cache.acquire(self.key, [head] if self.share else [],
                                           shared + m * own)
        except CacheFullError:
            return None
        cache.pool.incref(extra)
        matched = np.concatenate([matches[0].pages if matches else np.zeros(0, np.int32),
                                  extra]).astype(np.int32)
        return matched, fresh, m

    def _pending_pages(self, head: PackedTokens, skip: int, pending) -> np.ndarray:
        """Pages of head's full pages beyond the first `skip` that earlier units of this round
        are prefilling (not yet in the trie; their rows hold them)."""
        node, extra = pending, []
        for i, key in enumerate(self.cache.page_keys(head) if self.share else ()):
            entry = node.get(key)
            if entry is None:
                break
            page, node = entry
            if i >= skip:
                extra.append(page)
        return np.asarray(extra, np.int32)

    def _remember(self, pending, prompt: PackedTokens, pages) -> None:
        node = pending
        for key, page in zip(self.cache.page_keys(prompt), pages.tolist()):
            node = node.setdefault(key, (page, {}))[1]

    # ---- device work
    def prefill(self, units) -> None:
        engine = self.engine
        cfg = engine.scheduler_config
        total = sum(u.new_tokens for u, _ in units)
        arrays = scheduler.pack_prefill(units, max(16, next_power_of_2(total)),
                                        next_power_of_2(len(units)), self.width,
                                        cfg.max_num_seqs, self.ps)
        self.fresh_logits, engine._kv = core.prefill_step(
            self.weights.params, engine._kv, *dataclasses.astuple(arrays),
            config=engine.model_config, backend=engine.backend, mesh=engine.mesh)
        self.computed += total
        self.prefills += 1
        if self.share:  # the prefill is dispatched: its prompt pages may be shared
            for unit, _ in units:
                full = len(unit.prompt) // self.ps
                self.cache.insert(self.key, self._packed(unit.group, unit.prompt),
                                  unit.rows[0].pages[:full])

    def decode(self) -> None:
        """One decode chunk over the first `slot_bucket` slots (every live row is there:
        admission fills the lowest free slots), so empty slots beyond cost nothing."""
        engine = self.engine
        cfg = engine.scheduler_config
        width = scheduler.slot_bucket(self.slots)
        slots = self.slots[:width] + [None] * (width - len(self.slots))
        arrays = scheduler.pack_decode(slots, self.width, self.sampling.max_new_tokens)
        refill_at = cfg.max_num_seqs + 1
        if self.waiting:
            refill_at = max(1, min(len(self.waiting), cfg.max_num_seqs // 4))
        fresh_logits = self.fresh_logits
        if fresh_logits is None or not arrays.fresh.any():
            fresh_logits = jnp.zeros((width, engine.model_config.vocab_size), jnp.float32)
        elif fresh_logits.shape[0] != width:
            fresh_logits = _resize_rows(fresh_logits, width)
        out = core.decode_chunk(
            self.weights.params, engine._kv, fresh_logits, arrays.fresh,
            arrays.last_token, arrays.position, arrays.page_table, arrays.budget,
            arrays.sample_index, arrays.emitted, self.stops, np.int32(refill_at),
            **self.knobs, key=self.rng, config=engine.model_config, backend=engine.backend,
            steps=cfg.chunk_steps, mesh=engine.mesh)
        *host, engine._kv = out
        tokens, logprobs, counts, stopped, steps = jax.device_get(host)
        self.steps += int(steps)
        self.chunks += 1
        done = scheduler.apply_chunk(slots, tokens, logprobs, counts, stopped,
                                     self.sampling.max_new_tokens, self.weights.version)
        if self.text is not None:  # text: stop strings cut rows before they retire
            done = self.text.stop_rows(slots, done)
        for i in done:
            self.retire(i)

    def retire(self, slot: int) -> None:
        """Caches the row's full pages under the version that wrote all of their KV (none if
        several did: kv_policy "keep"), then drops its references."""
        row = self.slots[slot]
        single = len(row.kv_now) == 1  # not mixed ("keep" after an update)
        version = next(iter(row.kv_now)) if single else None
        self.slots[slot] = None
        self.finished[row.index] = row
        if self.share and single and \
                version >= self.weights.version - self.engine.max_policy_lag:
            written = self.packed[row.group].extend(scheduler.written_outputs(row))
            self.cache.insert(self.engine._cache_key(version), written,
                              row.pages[:written.num_tokens // self.ps], release=row.pages)
        else:
            self.cache.release(row.pages)

    def samples(self) -> list[Sample]:
        out = []
        for r in (self.finished[i] for i in range(len(self.prompts) * self.sampling.n)):
            versions = np.asarray(r.token_versions, np.int64)
            out.append(Sample(
                prompt_ids=r.prompt, output_ids=tuple(r.tokens),
                output_logprobs=np.asarray(r.logprobs, np.float32),
                behavior_version=int(versions[0]), token_versions=versions,
                cached_tokens=r.cached_tokens, finish_reason=r.finish_reason, group=r.group,
                kv_versions=tuple(sorted(r.kv_versions)),
                mixed_tokens=np.asarray(r.mixed, bool) if any(r.mixed) else None,
                text=None if self.text is None else self.text.sample_text(r)))  # text
        return out

    def batch(self, start: float, ack: WeightAck | None) -> RolloutBatch:
        samples = self.samples()
        prompt_tokens = sum(len(s.prompt_ids) for s in samples)
        fresh = self.computed - self.recomputed  # prompt tokens computed (not re-prefills)
        return RolloutBatch(
            samples=samples, version=self.start_version, sampling=self.sampling,
            prefill_tokens=fresh, reused_tokens=prompt_tokens - fresh,
            cached_tokens=sum(s.cached_tokens for s in samples), decode_steps=self.steps,
            decode_chunks=self.chunks, prefill_launches=self.prefills,
            seconds=time.perf_counter() - start, sync_ack=ack,
            recomputed_tokens=self.recomputed, weight_updates=self.updates)

    def release_all(self) -> None:
        """On the way out (success or failure): drop every reference a running row holds."""
        for i, row in enumerate(self.slots):
            if row is not None:
                self.slots[i] = None
                self.cache.release(row.pages)
