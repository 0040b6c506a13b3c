"""The device side of the engine: owns the KV pool, packs a round's arrays and calls the
jitted core (core.prefill_step, core.decode_chunk).

The pool is donated to every core call and replaced by its result; a call that fails after
donation leaves it deleted (`pool_lost`), and the engine then rebuilds it empty.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_cache import parallel
from jaxrl_cache.models import ModelConfig, init_kv_cache
from jaxrl_cache.rollout import core, scheduler
from jaxrl_cache.rollout.types import CacheConfig, SchedulerConfig
from jaxrl_cache.shapes import page_width_floor
from kernels_pallas._common import next_power_of_2


def _resize_rows(x, rows: int):
    """x [B, V] cut or zero-padded to [rows, V] (decode slots beyond B are empty)."""
    if x.shape[0] >= rows:
        return x[:rows]
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


class Runner:
    """KV pool and device dispatch of one engine (one rollout step at a time: the engine's
    lock). mesh: the pool is sharded tensor-parallel over it, else it lives on `device`."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, backend: str, device, mesh):
        self.model_config, self.cache_config = model_config, cache_config
        self.scheduler_config, self.backend = scheduler_config, backend
        self.device, self.mesh = device, mesh
        self.shared_widths: dict[tuple[int, int], set[int]] = {}  # (rows, width) -> shared
        self._check_pool_fits()
        self.kv = self.fresh_pool()

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

    def fresh_pool(self):
        """An empty KV pool in the engine's layout."""
        cfg = self.cache_config
        if self.mesh is not None:
            return parallel.engine_kv_cache(self.model_config, cfg.num_pages, cfg.page_size,
                                            self.mesh)
        return jax.device_put(init_kv_cache(self.model_config, cfg.num_pages, cfg.page_size),
                              self.device)

    def release_pool(self) -> None:
        """Frees the KV pool (no page may hold anything a reader needs); the next core call
        starts from a fresh empty one."""
        self.kv = None

    def _pool(self):
        if self.kv is None:
            self.kv = self.fresh_pool()
        return self.kv

    def pool_lost(self) -> bool:
        """True iff a failed core call left the (donated) pool deleted."""
        return any(x.is_deleted() for x in jax.tree.leaves(self.kv))

    def prefill(self, run: scheduler.Run, units, keep: list[int] | None = None) -> None:
        """One packed prefill of the round's units ((unit, slots) pairs) with the run's
        params; the run keeps the logits its fresh rows start decoding from. keep: slots an
        earlier prefill of this step filled (their logits are kept)."""
        cfg = self.scheduler_config
        total = sum(u.new_tokens for u, _ in units)
        arrays = scheduler.pack_prefill(units, max(16, next_power_of_2(total)),
                                        next_power_of_2(len(units)), run.width,
                                        cfg.max_num_seqs, run.ps)
        logits, self.kv = core.prefill_step(
            run.weights.params, self._pool(), *dataclasses.astuple(arrays),
            config=self.model_config, backend=self.backend, mesh=self.mesh)
        if keep:
            earlier = np.zeros((cfg.max_num_seqs, 1), bool)
            earlier[list(keep)] = True
            logits = jnp.where(earlier, run.fresh_logits, logits)
        run.fresh_logits = logits
        run.computed += total
        run.prefills += 1

    def _shared_width(self, rows: int, width: int, most: int) -> int:
        """The shared page count to send, at most `most` (any smaller count is correct:
        the rest stay in every row's table): the largest one decoded before at this
        (rows, width), so prompts that happen to share more pages compile nothing new."""
        seen = self.shared_widths.setdefault((rows, width), set())
        known = [k for k in seen if k <= most]
        shared = max(known) if known else most
        seen.add(shared)
        return shared

    def decode(self, run: scheduler.Run) -> tuple[list, tuple]:
        """One decode chunk over the run's first `slot_bucket` slots (every live row is
        there: admission fills the lowest free slots), so empty slots beyond cost nothing.
        Returns (those slots, (tokens int32 [b, k], logprobs f32 [b, k], counts int32 [b],
        stopped bool [b])) on the host."""
        cfg = self.scheduler_config
        width = scheduler.slot_bucket(run.slots)
        slots = run.slots[:width] + [None] * (width - len(run.slots))
        shared = 0  # the kernels read shared pages through every row's table anyway
        if self.backend == "xla":
            # at least one column stays per row (a row may only read shared pages)
            shared = self._shared_width(width, run.width, page_width_floor(
                min(scheduler.shared_prefix(slots, run.ps), run.width - 1)))
        arrays = scheduler.pack_decode(slots, run.width, shared)
        refill_at = cfg.max_num_seqs + 1
        if run.waiting:
            refill_at = max(1, min(len(run.waiting), cfg.max_num_seqs // 4))
        fresh_logits = run.fresh_logits
        if fresh_logits is None or not arrays.fresh.any():
            fresh_logits = jnp.zeros((width, self.model_config.vocab_size), jnp.float32)
        elif fresh_logits.shape[0] != width:
            fresh_logits = _resize_rows(fresh_logits, width)
        out = core.decode_chunk(
            run.weights.params, self._pool(), fresh_logits, arrays.fresh,
            arrays.last_token, arrays.position, arrays.page_table, arrays.shared_pages,
            arrays.budget,
            arrays.sample_index, arrays.emitted, run.stops, np.int32(refill_at),
            **run.knobs, key=run.rng, config=self.model_config, backend=self.backend,
            steps=cfg.chunk_steps, mesh=self.mesh)
        *host, self.kv = out
        tokens, logprobs, counts, stopped, steps = jax.device_get(host)
        run.steps += int(steps)
        run.chunks += 1
        return slots, (tokens, logprobs, counts, stopped)
