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

A call's parts: its queue, slots and admission (scheduler.Run), page claims
(page_claims.py), device work and the KV pool (runner.py), retirement and the batch
(retire.py); this module keeps the locks, versions, syncs, reconcile and request checks.
"""
from __future__ import annotations

import functools
import numbers
import operator
import threading
import time
from collections.abc import Mapping
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_cache import parallel
from jaxrl_cache.cache import CacheStats, RadixCache
from jaxrl_cache.checks import as_bool, as_count
from jaxrl_cache.errors import CacheFullError, VersionError
from jaxrl_cache.interrupts import allow_signals, deferred_signals
from jaxrl_cache.models import ModelConfig, lora
from jaxrl_cache.models.families import family_of
from jaxrl_cache.rollout import episodes, page_claims, retire, scheduler, text
from jaxrl_cache.rollout.core import layers_as_bits, on_bits_path
from jaxrl_cache.rollout.runner import Runner
from jaxrl_cache.rollout.sampling import SamplingParams
from jaxrl_cache.rollout.types import (CacheConfig, EpisodeBatch, RolloutBatch,
                                       SchedulerConfig, WeightAck)
from jaxrl_cache.versioning import MAX_POLICY_LAG, as_version
from kernels_pallas import from_bits16, resolve_backend


class _Weights(NamedTuple):
    """The engine's committed weights: replaced in one assignment."""
    version: int
    params: object  # resident on the engine's device (None before the first sync): a copy,
    # or the caller's own arrays when borrowed (sync_weights(borrow=True))
    source: tuple  # the caller's leaves they came from (identity checks)
    staged_seconds: float = 0.0  # time spent validating and copying them (sync_ack.seconds)
    copied_bytes: int = 0  # bytes the staging copied (0: borrowed where they already were)
    borrowed: bool = False  # params are (partly) the caller's arrays: they must stay alive
    lent_bytes: int = 0  # bytes held as the caller's own arrays (borrow)
    copied_leaves: tuple = ()  # borrow: the leaves that could not be lent (host arrays,
    #                            another placement), by path
    fingerprint: np.ndarray | None = None  # of the params synced under `version`: kept when
    #   they are released, so other params are never accepted under it (`_same_version`)
    lora_base: "_LoraBase | None" = None  # LoRA: the one base every adapter state runs on
    transposed_bytes: int = 0  # the decode transposes staging wrote (`sampler_layout`)


class _LoraBase(NamedTuple):
    """The frozen base of LoRA syncs: held once (lent, never copied per version); adapters
    over another base (fingerprint) are refused."""
    source: tuple  # the caller's base leaves (identity: no fingerprint pass when the same)
    params: object  # resident base tree (None once released)
    fingerprint: np.ndarray


class _Call(NamedTuple):
    """What one rollout call generates: its first requests, and (episodes) the checked
    spec of the Driver whose environments add the next turns."""
    sampling: SamplingParams
    rng: jax.Array
    requests: list  # scheduler.Request, in order
    max_tokens: int  # the longest context + output a row may reach
    finish: Callable  # (run, start, ack) -> the call's batch
    episodes: episodes.EpisodeSpec | None = None  # a Driver per run (None: single-turn)


def _same_leaves(tree, leaves) -> bool:
    """True iff `tree` (a param dict) has the very objects in `leaves` as its leaves (held,
    so ids stay unique) and every one is a jax.Array (immutable: a numpy array may have
    been edited in place since, so it is fingerprinted again); anything but a mapping is not
    flattened and gives False."""
    if not isinstance(tree, Mapping):
        return False
    mine = jax.tree.leaves(tree)
    return len(mine) == len(leaves) and all(a is b and isinstance(a, jax.Array)
                                            for a, b in zip(mine, leaves))


_GOLDEN = 2654435761  # the position weight's multiplier (Knuth's multiplicative hash)


def _leaf_check(x, bits_of=None):
    """(every value of x finite, sum of x's bits, position-weighted sum of its bits), the
    sums mod 2**32, in ONE variadic reduce: XLA fuses the bit casts, the position iota and
    the product into it, so the pass over the leaf allocates nothing (three separate
    reductions materialised [N] temporaries: +1 GiB and 0.43 s on SmolLM2). bits_of: a
    uint16 x holds the bits of that 16-bit float dtype (`core.layers_as_bits`): its values are
    checked as those floats; the sums are of the same bits either way."""
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))
    bits = bits.reshape(-1).astype(jnp.uint32)
    index = jax.lax.iota(jnp.uint32, bits.shape[0])
    weighted = bits * (index * jnp.uint32(_GOLDEN) + 1)
    values = x if bits_of is None else from_bits16(x, bits_of)
    bad = jnp.logical_not(jnp.isfinite(values.reshape(-1))).astype(jnp.uint32)
    zero = jnp.uint32(0)
    bad, total, weighted = jax.lax.reduce(
        (bad, bits, weighted), (zero, zero, zero),
        lambda a, b: (a[0] | b[0], a[1] + b[1], a[2] + b[2]), (0,))
    return bad == 0, total, weighted


def _check_leaves(params, bits_of=None):
    """(bool []: every value of every leaf is finite, uint32 [2 * leaves]: two
    position-weighted sums (mod 2**32) of each leaf's bits). Equal weights give equal
    fingerprints, held as floats or as their bits (bits_of: `_leaf_check`); an edited
    weight changes them (not a defence against an adversary: a guard against another param
    tree under a synced version)."""
    checks = [_leaf_check(x, bits_of) for x in jax.tree.leaves(params)]
    finite = jnp.all(jnp.stack([c[0] for c in checks])) if checks else jnp.bool_(True)
    sums = [s for c in checks for s in c[1:]]
    return finite, jnp.stack(sums) if sums else jnp.zeros((0,), jnp.uint32)


_checked = jax.jit(_check_leaves, static_argnums=1)  # (every value finite, fingerprint): one pass


@functools.partial(jax.jit, static_argnums=1)
def _resident_copy(params, bits: bool = False):
    """(fresh copies of params, whether every value is finite, fingerprint): one program,
    one pass over the weights. Fresh buffers: the caller may donate or mutate its own arrays
    afterwards. bits: the copy's 16-bit float layers as their bits (`core.layers_as_bits`)."""
    copy = jax.tree.map(jnp.copy, params)
    return (layers_as_bits(copy) if bits else copy, *_check_leaves(params))


def _narrows(given, dtype) -> bool:
    """Whether a `given` leaf dtype is a wider float than the engine's `dtype` (fp32 master
    weights to a bf16 engine): such a leaf is synced as its cast."""
    try:
        given = np.dtype(given)
    except TypeError:
        return False
    return (jnp.issubdtype(given, jnp.floating) and jnp.issubdtype(dtype, jnp.floating)
            and given.itemsize > np.dtype(dtype).itemsize)


def _narrowed_dtypes(params, like) -> tuple | None:
    """`like`'s leaf dtypes when a leaf of params `_narrows` to its own, else None."""
    dtypes = tuple(np.dtype(y.dtype) for y in jax.tree.leaves(like))
    if not any(_narrows(getattr(x, "dtype", None), d)
               for x, d in zip(jax.tree.leaves(params), dtypes)):
        return None
    return dtypes


@functools.partial(jax.jit, static_argnums=(1, 2))
def _cast_copy(params, dtypes: tuple, bits: bool = False):
    """params with each leaf cast to `dtypes` (one program); bits: the cast's 16-bit float
    layers as their bits (`core.layers_as_bits`). Checked apart, on the 16-bit result: checked in
    this program, XLA re-read the fp32 weights to recompute the cast (+0.05 s a sync)."""
    leaves, tree = jax.tree.flatten(params)
    cast = jax.tree.unflatten(tree, [x.astype(d) for x, d in zip(leaves, dtypes)])
    return layers_as_bits(cast) if bits else cast


def _buffers(x) -> set:
    """Addresses of an array's local shards (empty for a host array)."""
    if not isinstance(x, jax.Array):
        return set()
    return {shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards}


def _check_rng(rng) -> None:
    if not isinstance(rng, jax.Array):
        raise TypeError(f"rng must be a jax PRNG key (jax.random.key(seed)), got "
                        f"{type(rng).__name__}")
    typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
    if not ((typed and rng.shape == ()) or (rng.dtype == jnp.uint32 and rng.shape == (2,))):
        raise TypeError(f"rng must be a single PRNG key (jax.random.key(seed)), got "
                        f"{rng.dtype}{list(rng.shape)}")


KV_POLICIES = ("wait", "recompute", "keep")


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
        self._runner = Runner(model_config, cache_config, scheduler_config, self.backend,
                              self.device, mesh)  # the KV pool and the jitted core
        self.cache = RadixCache(cache_config.num_pages, cache_config.page_size)
        self._weights = _Weights(as_version(version), None, ())
        self._lock = threading.Lock()  # one rollout step or sync at a time
        self._call_lock = threading.Lock()  # asynchronous mode: one rollout call at a time
        self._active: scheduler.Run | None = None  # asynchronous mode: the call in flight
        init = family_of(model_config).decoder.init_params
        self._param_shapes = jax.eval_shape(lambda k: init(model_config, k), jax.random.key(0))
        self._placement = self.device
        if mesh is not None:
            self._placement = parallel.rollout_shardings(self._param_shapes, model_config, mesh)

    def _cache_key(self, version: int) -> int:
        """The radix namespace of `version`: the version itself (invariant 1). Tests override
        it to reproduce the stale-KV bug of public projects and check the audit catches it."""
        return version

    @property
    def version(self) -> int:
        return self._weights.version

    # ------------------------------------------------------------------ weight sync
    def sync_weights(self, params, version, *, borrow: bool = False,
                     replace: bool = False) -> WeightAck:
        """Makes `params` the engine's weights for `version` and acknowledges.

        Waits for any in-flight rollout (same lock). Newer version: params copied onto the
        engine's device (never aliasing the caller's buffers unless borrowed, below), checked
        finite, resident; every
        older prefix entry dropped; then the version is committed. Same version: idempotent
        (nothing invalidated) for the same weights (the very arrays, or equal ones: a
        fingerprint of the synced weights outlives `release_weights`); other weights are a
        VersionError, unless replace=True, the cache holds nothing of that version and no
        asynchronous call is in flight. The version an asynchronous call in flight was
        staged at is fixed the same way (its rows hold KV of those weights).
        Older: VersionError. If anything fails, the previous version,
        weights and cache stay as they were. The ack reports the bytes copied and the sync's
        own seconds.

        Single-device and without LoRA, the engine also writes the [out, in] transpose of
        each projection whose small-row dot then needs no padding for the trainer's bits
        (the decoder's `sampler_layout`; `transposed_bytes` in the ack, freed with the rest).

        borrow=True (a synchronous loop): jax arrays already where the engine runs are held
        as they are, not copied, until `release_weights()` or the next sync; the caller must
        not donate or delete them before that (a rollout on deleted weights raises). Leaves
        it cannot alias safely are copied: host (numpy) arrays, which device_put could alias
        on CPU, and arrays on another placement; the ack names them (`copied_leaves`) and
        splits the bytes (`copied_bytes`, `lent_bytes`).

        Floating leaves wider than the model config's dtype (fp32 master weights to a bf16
        engine) are held as their cast, the engine's own copy (`copied_bytes`; borrowing
        lends nothing then); the fingerprint is the cast's. Not with LoRA adapters.

        LoRA params (`models.lora.attach`: a base plus adapters): the engine holds one base
        for its life, lent (never copied per version; a host array is copied once), and a
        sync copies only the adapters and the scale (`copied_bytes`; the base counts as
        lent). Adapters over another base (fingerprint) are refused with a ValueError.
        """
        version = as_version(version)
        return self._serialized(self._sync, params, version, as_bool(borrow, "borrow"),
                                as_bool(replace, "replace"))

    def release_weights(self, *, drop_kv: bool = False) -> None:
        """Frees the resident params until the next sync or rollout; the version stays. For
        a synchronous loop: the trainer then holds the only copy while it updates (peak
        memory: params, grads and optimizer state, no engine copy). A rollout at the same
        version copies the caller's params again (they must be that version's weights, as
        for any rollout call). drop_kv: also drop every prefix-cache entry and free the KV
        pool (rebuilt empty by the next call), for a loop whose next call runs at a newer
        version, which could reuse none of it. Refused while an asynchronous call is in
        flight (its decode chunks read these weights). A LoRA engine keeps its base (held
        once, lent by the trainer); the adapters are released."""
        drop_kv = as_bool(drop_kv, "drop_kv")

        def release():
            if self._call_lock.locked():
                raise RuntimeError("release_weights while an asynchronous rollout call is in "
                                   "flight: its decode chunks use the resident weights")
            if drop_kv:
                self.cache.clear()  # raises, changing nothing, if a live request holds pages
                self._runner.release_pool()
            self._weights = self._weights._replace(params=None, source=())
        self._serialized(release)

    def _sync(self, params, version: int, borrow: bool = False,
              replace: bool = False) -> WeightAck:
        start = time.perf_counter()
        staged = self._stage(params, version, borrow, replace)
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

    def _pinned(self, version: int) -> _Weights | None:
        """The weights that fixed `version`, if any: the committed ones, or those an
        asynchronous call in flight was staged at (its rows hold their KV, its commit is
        pending)."""
        active = self._active
        if active is not None and active.weights.version == version and \
                active.weights.fingerprint is not None:
            return active.weights
        current = self._weights
        return current if current.version == version and current.fingerprint is not None \
            else None

    def _same_version(self, params, version: int, pinned: _Weights, replace: bool) -> bool:
        """Params offered again at `version`, fixed by `pinned`: True when they are its
        weights (fingerprint), False when they differ and `replace` allows them (nothing of
        that version cached, no call in flight); otherwise VersionError. A version's weights
        are fixed once synced, lent or copied, released or not: KV cached under it was
        computed by them."""
        if np.array_equal(self._fingerprint(params), pinned.fingerprint):
            return True
        if not replace:
            raise VersionError(
                f"version {version} is already synced with different params; a weight "
                f"change must come with a new version (or, with nothing of version {version} "
                f"cached, sync_weights(..., replace=True))")
        if self._active is not None:
            raise VersionError(f"sync_weights(replace=True) at version {version} while an "
                               f"asynchronous call is in flight: its rows hold KV computed "
                               f"by the params synced before")
        if self._cache_key(version) in self.cache.versions():
            raise VersionError(f"sync_weights(replace=True) at version {version}: the prefix "
                               f"cache holds KV of version {version}, computed by the params "
                               f"synced before; release_weights(drop_kv=True) first")
        return False

    def _stage(self, params, version: int, borrow: bool = False,
               replace: bool = False) -> _Weights | None:
        """Validated resident copy (borrow: the arrays themselves where they already are on
        the engine's placement) of `params` for `version` (nothing committed); None when
        they are the resident weights of the committed version. A version already fixed
        (`_pinned`) accepts only its own weights (`_same_version`)."""
        current = self._weights
        if version < current.version:
            raise VersionError(f"version {version} is older than the engine's version "
                               f"{current.version}; versions only move forward")
        pinned = self._pinned(version)
        if pinned is not None:
            resident = pinned is current and current.params is not None
            if resident and _same_leaves(params, current.source):
                return None
            self._check_params(params)
            if self._same_version(params, version, pinned, replace) and resident:
                return None  # equal weights, still resident
        begun = time.perf_counter()
        self._check_params(params)
        # fresh copies where the caller's arrays live (numpy: the default device), then
        # moved to the engine's placement if that is elsewhere (a no-op when it is not)
        given, (base, adapters, scale) = params, lora.split(params)
        lora_base = None
        if adapters is not None:  # LoRA: the base held once; only the adapters move
            lora_base = self._lora_base(base, version)
            params = {"adapters": adapters, "scale": scale}
        dtypes = None if lora_base is not None else _narrowed_dtypes(params, self._param_shapes)
        narrowed = dtypes is not None  # the cast is the engine's own copy: held as it is
        resident, finite, fingerprint = self._owned(params, borrow, dtypes, bits=(
            lora_base is None and on_bits_path(self.backend, self.mesh)))
        if not bool(finite):
            raise ValueError(f"params for version {version} contain NaN or Inf; refusing "
                             f"to sync them")
        source = tuple(jax.tree.leaves(given if narrowed else params))
        lent = [not narrowed and isinstance(y, jax.Array) and _buffers(x) == _buffers(y)
                for x, y in zip(jax.tree.leaves(resident), source)]
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
        sizes = [x.nbytes for x in jax.tree.leaves(resident)]
        copied = sum(n for n, l in zip(sizes, lent) if not l)
        lent_bytes = sum(n for n, l in zip(sizes, lent) if l)
        if lora_base is not None:
            lent_bytes += sum(x.nbytes for x in jax.tree.leaves(lora_base.params))
            fingerprint = np.concatenate([lora_base.fingerprint, np.asarray(fingerprint)])
            resident = lora.attach({**lora_base.params, lora.SCALE: resident["scale"]},
                                   resident["adapters"])
            source = tuple(jax.tree.leaves(given))
        transposed = 0
        if lora_base is None and self.mesh is None:  # (a LoRA base stays lent as it is)
            before = sum(x.nbytes for x in jax.tree.leaves(resident))
            resident = family_of(self.model_config).decoder.sampler_layout(
                resident, self.model_config.dtype)
            transposed = sum(x.nbytes for x in jax.tree.leaves(resident)) - before
        return _Weights(version, resident, source, time.perf_counter() - begun, copied,
                        any(lent) or lora_base is not None, lent_bytes,
                        tuple(p for p, l in zip(paths, lent) if not l) if borrow else (),
                        np.asarray(fingerprint), lora_base, transposed)

    def _owned(self, params, borrow: bool, dtypes: tuple | None = None, bits: bool = False):
        """(params resident at the engine's placement, finite, fingerprint): fresh copies
        (cast to `dtypes` when given, the engine's own), or with borrow the jax arrays
        themselves (a host numpy array is copied, since device_put may alias it on CPU and
        the caller could then edit "resident" weights). bits: copies held with their layers as
        bits (`core.layers_as_bits`: the calls then cast nothing); lent arrays stay as they
        are."""
        if dtypes is not None:
            owned = _cast_copy(params, dtypes, bits)
            finite, fingerprint = _checked(owned, jnp.dtype(self.model_config.dtype).name)
        elif borrow:
            owned = jax.tree.map(lambda x: x if isinstance(x, jax.Array)
                                 else jnp.asarray(np.array(x, copy=True)), params)
            finite, fingerprint = _checked(owned)
        else:
            owned, finite, fingerprint = _resident_copy(params, bits)
        return jax.block_until_ready(jax.device_put(owned, self._placement)), finite, fingerprint

    def _lora_base(self, base, version: int) -> _LoraBase:
        """The base of a LoRA sync: the one already held when it is the same arrays or equal
        weights (fingerprint), else the first base of this engine, lent (a jax array where
        the engine runs is held as it is; the trainer never changes it). Adapters over
        another base are refused: every version of this engine runs on one base."""
        held = self._weights.lora_base
        if held is not None and held.params is not None and _same_leaves(base, held.source):
            return held
        finite, fingerprint = _checked(base)
        fingerprint = np.asarray(fingerprint)
        if held is not None and not np.array_equal(fingerprint, held.fingerprint):
            raise ValueError(f"version {version}: LoRA adapters over a different base model "
                             f"than the one this engine serves (base fingerprints differ); "
                             f"one engine runs one frozen base")
        if held is not None and held.params is not None:
            return held
        if not bool(finite):
            raise ValueError(f"the LoRA base for version {version} contains NaN or Inf; "
                             f"refusing to sync it")
        resident = self._owned(base, borrow=True)[0]
        return _LoraBase(tuple(jax.tree.leaves(base)), resident, fingerprint)

    def _fingerprint(self, params) -> np.ndarray:
        """The fingerprint `_stage` records for params (LoRA: the base's, then the
        adapters')."""
        base, adapters, scale = lora.split(params)
        if adapters is None:
            dtypes = _narrowed_dtypes(params, self._param_shapes)
            if dtypes is None:
                return np.asarray(_checked(params)[1])
            return np.asarray(_checked(_cast_copy(params, dtypes))[1])
        held = self._weights.lora_base
        base_print = held.fingerprint if held is not None and held.params is not None and \
            _same_leaves(base, held.source) else np.asarray(_checked(base)[1])
        return np.concatenate([base_print, np.asarray(_checked(
            {"adapters": adapters, "scale": scale})[1])])

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
                recomputed = self._active.on_update(staged,
                                                    drop_kv=self.kv_policy == "recompute")
            invalidated = self.cache.invalidate_before(
                oldest, held=self._active is not None and self.kv_policy == "keep")
            self._weights = staged  # the commit: one assignment
        return WeightAck(staged.version, previous, invalidated, time.perf_counter() - start,
                         tuple(self.cache.versions()),
                         tuple(sorted(before - set(self.cache.versions()))), recomputed,
                         staged.copied_bytes, staged.lent_bytes, staged.copied_leaves,
                         staged.transposed_bytes)

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
        """Raises ValueError (one line) unless params fit the model config: the base tree,
        optionally with LoRA adapters (`models.lora`)."""
        if not isinstance(params, Mapping):  # before any flatten (a generator is a leaf)
            raise ValueError(f"params must be the model's param dict, got "
                             f"{type(params).__name__}")
        params, adapters, scale = lora.split(params) if isinstance(params, dict) \
            else (params, None, None)
        if adapters is not None:
            if self.mesh is not None:
                raise ValueError("LoRA adapters with a tensor-parallel engine mesh are not "
                                 "supported; merge them (models.lora.merged) or run unsharded")
            lora.check_adapters(self.model_config, adapters)
            if getattr(scale, "shape", None) != () or getattr(scale, "dtype", None) != \
                    jnp.float32:
                raise ValueError(f"params[{lora.SCALE!r}] must be a float32 scalar")
        want = jax.tree.structure(self._param_shapes)
        got = jax.tree.structure(params)
        if got != want:
            raise ValueError(f"params tree does not match the model config: {got} vs {want}")
        for path, a, b in zip(jax.tree_util.tree_leaves_with_path(params),
                              jax.tree.leaves(params), jax.tree.leaves(self._param_shapes)):
            if adapters is None and getattr(a, "shape", None) == b.shape and \
                    _narrows(getattr(a, "dtype", None), b.dtype):
                continue  # fp32 master weights to a bf16 engine: synced as their cast
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
        n, max_new = sampling.n, sampling.max_new_tokens
        requests = [scheduler.Request(g, g * n + j, p, max_new)
                    for g, p in enumerate(prompts) for j in range(n)]
        return self._run_call(params, version, _Call(sampling, rng, requests,
                                                     max(map(len, prompts)) + max_new,
                                                     retire.batch))

    def rollout_episodes(self, params, version, tasks: Sequence, env_factory: Callable,
                         sampling: SamplingParams, *, rng: jax.Array, max_turns: int = 4,
                         max_episode_tokens: int | None = None,
                         env_workers: int | None = None,
                         env_timeout: float | None = None) -> EpisodeBatch:
        """sampling.n multi-turn episodes per task with the params of `version`
        (rollout/episodes.py; the environment protocol is rollout/env.py).

        env_factory(task) makes episode j of a task its environment. Each assistant turn
        stops as a single-turn sample does (stop ids or strings, sampling.max_new_tokens);
        its environment then answers on one of `env_workers` threads (default: one per
        episode, at most 64) while the other rows decode, and the next turn is admitted with
        the whole history as its context, served
        from this version's prefix cache up to the new observation. An episode ends when its
        environment says done, after max_turns turns, when its history would pass
        max_episode_tokens (default: the model's max_seq_len), or with "error" when its
        environment raised, gave an invalid observation or took more than env_timeout
        seconds on one call (None: no limit; its late answer is dropped). Versions and
        syncs as `rollout`;
        a next turn after a weight update re-prefills its history under the new version
        ("recompute"; "keep" while the history's version has left the cache), or continues
        over its older KV ("keep", while that version is in the `max_policy_lag` window;
        its tokens flagged mixed). Episodes come back in task order, episode j of task g at
        g * n + j.
        """
        version = as_version(version)
        self._check_sampling(sampling, rng)
        text.encode_prompts(self.tokenizer, [], sampling)  # stop strings need a tokenizer
        spec = episodes.prepare(
            tasks, env_factory, sampling, tokenizer=self.tokenizer, config=self.model_config,
            cache_config=self.cache_config, max_turns=max_turns,
            max_episode_tokens=max_episode_tokens, env_workers=env_workers,
            keep=self.kv_policy == "keep", env_timeout=env_timeout)
        return self._run_call(params, version, _Call(sampling, rng, [], spec.max_tokens,
                                                     episodes.batch, spec))

    def _run_call(self, params, version: int, call: _Call):
        if self.kv_policy == "wait":
            return self._serialized(self._rollout, params, version, call)
        return self._rollout_async(params, version, call)

    def _rollout(self, params, version: int, call: _Call):
        """Synchronous mode: the whole call under the lock, committed at the end."""
        start = time.perf_counter()
        staged = self._stage(params, version)
        weights = staged or self._weights
        if staged is None and version != self._weights.version:
            raise VersionError(f"rollout at version {version} but the engine is at "
                               f"{self._weights.version}; versions only move forward")
        run = self._new_run(weights, call)
        try:
            while not run.done:
                self._step(run)
        finally:
            self._end_run(run)
        ack = None if staged is None else self._commit(staged)
        return call.finish(run, start, ack)

    def _rollout_async(self, params, version: int, call: _Call):
        """Asynchronous mode: the lock is taken per step (admit, prefill, one decode chunk),
        so a sync lands between chunks; `_commit` tells the run (`scheduler.Run.on_update`).
        A newer `version` is staged by `_start_run` and committed by `_finish_run`, which only the
        successful path reaches."""
        start = time.perf_counter()
        with self._call_lock:
            run, staged = self._serialized(self._start_run, params, version, call)
            try:
                while not run.done:
                    self._between_steps(run)
                    run.await_work()  # environments think outside the lock
                    self._serialized(self._step, run)
            except BaseException:
                self._serialized(self._end_run, run)
                raise
            ack = self._serialized(self._finish_run, run, staged, start)
        return call.finish(run, start, ack)

    def _start_run(self, params, version: int, call: _Call
                   ) -> tuple[scheduler.Run, _Weights | None]:
        """The call's run at the committed version, or at a newer one staged for it (returned
        too; nothing committed)."""
        if self._active is not None:  # left by a call killed before its cleanup
            self._end_run(self._active)
        staged = self._stage(params, version)  # None: the committed version and params
        self._active = self._new_run(staged or self._weights, call)
        return self._active, staged

    def _new_run(self, weights: _Weights, call: _Call) -> scheduler.Run:
        if weights.borrowed and any(isinstance(x, jax.Array) and x.is_deleted()
                                    for x in weights.source):
            raise RuntimeError(f"the weights of version {weights.version} that the engine "
                               f"borrowed (sync_weights(borrow=True)) were deleted, e.g. "
                               f"donated by a train step: release_weights() before donating")
        cfg, sched = self.cache_config, self.scheduler_config
        return scheduler.Run(
            weights, call.requests, call.sampling, call.rng, cache=self.cache,
            page_size=cfg.page_size, share=cfg.prefix_cache, num_slots=sched.max_num_seqs,
            max_prefill_tokens=sched.max_prefill_tokens, max_policy_lag=self.max_policy_lag,
            key_of=self._cache_key, max_tokens=call.max_tokens,
            text=None if self.tokenizer is None else text.RowText(self.tokenizer,
                                                                  call.sampling),
            episodes=None if call.episodes is None else call.episodes.driver())

    def _step(self, run: scheduler.Run) -> None:
        """One round of a call (engine lock held): admit (re-prefills of rows whose KV an
        update dropped first, then waiting samples) by packed prefills, one decode chunk."""
        weights = run.weights  # read once: this step runs and stamps this version alone
        run.await_work()
        if not self._admit(run, weights):
            if run.idle:
                return  # episodes: every episode left is with its environment, or ended
            if all(r is None or r.resume for r in run.slots):
                raise AssertionError("scheduler made no progress")  # the pre-check forbids it
        slots, chunk, steps = self._runner.decode(weights.params, run)
        retire.finish_rows(run, slots, run.record_chunk(slots, chunk, steps, weights.version),
                           weights.version)

    def _admit(self, run: scheduler.Run, weights: _Weights) -> bool:
        """Admission rounds, each one packed prefill of at most max_prefill_tokens (soft),
        until no waiting sample fits: every row admitted before a decode chunk decodes in it
        (a prompt batch over the budget no longer leaves a tail that decodes alone in extra
        chunks). Returns whether any row was admitted."""
        earlier: list[int] = []  # slots prefilled by an earlier round of this step
        while True:  # run.admit stops on its own when no slot, page or sample is left
            claims = page_claims.Round(run, weights.version)
            units = run.admit(claims)
            if not units:
                return bool(earlier)
            run.record_prefill(*self._runner.prefill(weights.params, run, units,
                                                      claims.trie_tokens,
                                                      keep=earlier))
            claims.publish(units)
            earlier += [slot for _, slots in units for slot in slots]

    def _finish_run(self, run: scheduler.Run, staged: _Weights | None, start: float
                    ) -> WeightAck | None:
        """A call that succeeded: its cleanup, then the commit of the version it was staged
        at, unless a sync during the call committed that version or a newer one (None)."""
        self._end_run(run)
        current = self._weights
        if staged is None or (staged.version <= current.version and current.params is not None):
            return None
        return self._commit(staged)

    def _between_steps(self, run: scheduler.Run) -> None:
        """Asynchronous mode: called between steps, outside the lock (tests override it to
        force weight updates at chosen chunk boundaries)."""

    def _end_run(self, run: scheduler.Run) -> None:
        """On the way out of a call (success or failure): the run's rows let go of their
        pages; a pool lost to a failure after donation is rebuilt empty."""
        run.release_all()
        if self._active is run:
            self._active = None
        if self._runner.pool_lost():
            self.cache.clear()
            self._runner.kv = self._runner.fresh_pool()

    def _check_sampling(self, sampling: SamplingParams, rng) -> None:
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        _check_rng(rng)
        vocab = self.model_config.vocab_size
        bad_stops = [t for t in sampling.stop_token_ids if not 0 <= t < vocab]
        if bad_stops:
            raise ValueError(f"sampling.stop_token_ids {bad_stops} are outside the vocabulary "
                             f"[0, {vocab})")

    def _check_request(self, prompts, sampling: SamplingParams, rng) -> list[tuple]:
        self._check_sampling(sampling, rng)
        vocab, limit = self.model_config.vocab_size, self.model_config.max_seq_len
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
