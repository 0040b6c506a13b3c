"""How much memory a train step needs, and refusing one that cannot fit before any work.

Memory is set by a micro-batch, not the batch: samples are packed into micro-batches of at
most `token_budget` tokens, log-probs come chunked (never [N, L, V] logits) and the layer
scan is rematerialised (`remat`), so the estimate is the state plus one micro-batch's
activations, independent of the batch size. With LoRA (`lora`) the state is the frozen
base once plus the adapters' params, gradients and Adam state; the activations are the same.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import os

import jax
import numpy as np

from jaxrl_cache.models.config import ModelConfig
from jaxrl_cache.models.families import family_of
from jaxrl_cache.models.lora import LoraConfig, init_adapters
from jaxrl_cache.rl.packing import MAX_ROW
from jaxrl_cache.rl.train_config import TrainConfig


class TrainMemoryError(ValueError):
    """A train step that cannot fit the device memory (raised before any work)."""


def estimate_step_bytes(config: ModelConfig, cfg: TrainConfig, row_length: int | None = None,
                        lora: LoraConfig | None = None) -> dict:
    """Rough peak bytes of one train step: the state (params, gradients, Adam moments, the
    update's temporaries, and without donation a second params + Adam copy) plus the
    activations of one micro-batch of `token_budget` tokens (each layer's saved input,
    one layer's rematerialised backward, attention scores of rows of `row_length`, one
    LM-head chunk; row_length None: the longest rows packing makes). Independent of the
    batch size: that is the point of the budget.

    Full fine-tuning: state = 4 B x params x (5, or 8 without donation). With `lora`: the
    frozen base once in config.dtype (never donated or copied; + a compute_dtype copy when
    that differs) and the adapters x (5 or 8); keys `frozen` and `trainable` say which."""
    if lora is None:
        frozen, trainable = 0, 4 * _param_count(config)
    else:
        base = np.dtype(config.dtype).itemsize
        frozen = _param_count(config) * base + 4  # + the f32 scale
        if cfg.compute_dtype != "float32" and np.dtype(cfg.compute_dtype).itemsize != base:
            frozen += _param_count(config) * np.dtype(cfg.compute_dtype).itemsize
        trainable = _adapter_count(config, lora) * base
    state = frozen + trainable * {True: 5, "optimizer": 6, False: 8}[cfg.donate]
    act = 2 if cfg.compute_dtype == "bfloat16" else 4
    t, d = cfg.token_budget, config.d_model
    width = min(MAX_ROW if row_length is None else max(row_length, 1), t)
    qkv = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
    per_layer = dict(full=d, dots=d + qkv + 2 * d + 2 * config.d_ff, none=12 * d)
    # "dots" saves each block's input and its weight matmuls' outputs (q, k, v, o, gate,
    # up, down); "auto" is estimated as what it resolves to (`resolve_remat`)
    saved = config.n_layers * t * act * per_layer[
        "full" if cfg.remat == "auto" else cfg.remat]
    layer = 3 * t * (3 * config.d_ff + 8 * d + qkv) * act + 12 * t * config.n_heads * width
    head = 4 * 4 * cfg.logprob_chunk * config.vocab_size
    return dict(state=state, activations=saved + layer + head,
                total=state + saved + layer + head, frozen=frozen, trainable=trainable)


@functools.lru_cache(maxsize=None)
def _param_count(config: ModelConfig) -> int:
    """Parameters of a model (abstract init, once per config: train_step checks every call)."""
    init = family_of(config).decoder.init_params
    shapes = jax.eval_shape(lambda: init(config, jax.random.key(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


@functools.lru_cache(maxsize=None)
def _adapter_count(config: ModelConfig, lora: LoraConfig) -> int:
    """LoRA adapter parameters: n_layers x rank x (in + out) per target (abstract init)."""
    shapes = jax.eval_shape(lambda: init_adapters(config, lora, jax.random.key(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


def available_bytes() -> int | None:
    """Memory a step may use: the device's limit (accelerators), or on CPU this process's
    resident memory plus the machine's available memory. None if unknown."""
    stats = jax.local_devices()[0].memory_stats() or {}  # addressable in multi-process runs
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    try:
        meminfo = dict(line.split(":", 1) for line in open("/proc/meminfo"))
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return int(meminfo["MemAvailable"].split()[0]) * 1024 + rss
    except (OSError, KeyError, ValueError):
        return None



@functools.lru_cache(maxsize=None)
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


def trim_host_memory() -> None:
    """Returns the free pages of this process's heap to the OS (glibc's malloc_trim; a no-op
    elsewhere). What a phase freed (a rollout's KV pool and transposes, a save's buffers)
    otherwise stays resident, and the next phase's peak lands on top of it."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax's, after each XLA compile
TRIM_AFTER_COMPILE_SECONDS = 0.5  # compiles this long leave scratch worth returning


def _trim_after_compile(event: str, seconds: float, **_) -> None:
    if event == COMPILE_EVENT and seconds >= TRIM_AFTER_COMPILE_SECONDS:
        trim_host_memory()


def trim_after_compiles() -> None:
    """From now on (this process), `trim_host_memory` after each XLA compile of at least
    TRIM_AFTER_COMPILE_SECONDS: the compiler's freed scratch (~0.3 GB for SmolLM2's train
    step on CPU) would otherwise stay resident under its program's first run. Idempotent."""
    if not _TRIMMING:
        jax.monitoring.register_event_duration_secs_listener(_trim_after_compile)
        _TRIMMING.append(True)


_TRIMMING: list = []  # [True] once trim_after_compiles registered its listener


# remat "auto": "dots" (no recomputed forward of the weight matmuls) when its estimate takes
# at most this fraction of the memory, else "full". SmolLM2-135M train step: 64 x 160 tokens
# (micro-batches of ~3.4k) 70.8 s with "dots" vs 80.9 "full" (2026-12-04); 2 x 8 x 24
# through the CLI (one micro-batch of 480 distinct tokens) 0.92-0.99x the update time in
# 4 in-process A/Bs and 0.92-1.00x in 3 CLI rounds, +0.2 GiB peak RSS (2026-12-06); "none"
# kept +0.9 GiB for no consistent gain.
AUTO_MEMORY_FRACTION = 0.5


def resolve_remat(config: ModelConfig, cfg: TrainConfig, *, row_length: int | None = None,
                  available: int | None = None, lora: LoraConfig | None = None) -> TrainConfig:
    """`cfg` with remat "auto" resolved: "dots" when the "dots" step estimate (micro-batches
    of token_budget tokens in rows of row_length) is at most AUTO_MEMORY_FRACTION of the
    available memory (default `available_bytes()`; unknown: "full"), else "full". Other
    policies are returned as given."""
    if cfg.remat != "auto":
        return cfg
    dots = dataclasses.replace(cfg, remat="dots")
    have = available_bytes() if available is None else available
    need = estimate_step_bytes(config, dots, row_length, lora)["total"]
    if have is not None and need <= AUTO_MEMORY_FRACTION * have:
        return dots
    return dataclasses.replace(cfg, remat="full")


MEMORY_SLACK = 1.25  # the estimate is rough: refuse only what clearly cannot fit


def check_memory(config: ModelConfig, cfg: TrainConfig, row_length: int | None = None,
                 available: int | None = None, lora: LoraConfig | None = None) -> None:
    """Raises TrainMemoryError (one line, the numbers and the setting to change) if the
    step's estimate (`estimate_step_bytes`, LoRA-aware with `lora`) exceeds MEMORY_SLACK x
    the available memory (default `available_bytes()`; unknown: no check)."""
    have = available_bytes() if available is None else available
    need = estimate_step_bytes(config, cfg, row_length, lora)
    if have is None or need["total"] <= MEMORY_SLACK * have:
        return
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    per_token = max(need["activations"] / cfg.token_budget, 1.0)
    fits = int((MEMORY_SLACK * have - need["state"]) / per_token) // 256 * 256
    hint = (f"lower token_budget (--token-budget) to about {fits}" if fits >= 256 else
            "the state alone does not fit: " + ("a bfloat16 base" if lora else "donate=True")
            + ", a smaller model or more memory")
    raise TrainMemoryError(
        f"train step needs ~{gib(need['total'])} (state {gib(need['state'])} + "
        f"{gib(need['activations'])} for micro-batches of {cfg.token_budget} tokens), "
        f"{gib(have)} available; {hint}")
