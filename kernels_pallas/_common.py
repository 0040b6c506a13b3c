"""Shared helpers for the paged-attention kernels: argument checks and backend choice."""
from __future__ import annotations

import functools
import os
import threading

import jax
import jax.numpy as jnp

BACKENDS = ("auto", "pallas", "interpret", "xla")
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
KERNELS_ENV = "JAXRL_CACHE_KERNELS"
KERNEL_CHOICES = ("xla", "pallas", "interpret")


def invariant_kernels() -> str | None:
    """Where the batch-invariant kernels run: None (XLA's ops, the default: exact on
    XLA:CPU), "pallas" (compiled Triton, GPU) or "interpret" (the same kernels in Pallas
    interpret mode: CPU tests). From the environment variable JAXRL_CACHE_KERNELS, read at
    trace time (programs are cached per value: `kernel_keyed_jit`); the sampler and the
    trainer must run under the same value. It routes the model's projections
    (`models.dense`), the trainer's attention (`models.llama`), the log-softmax normaliser
    of every log-prob (`distribution.log_normaliser`) and the engine's "auto" attention
    backend."""
    choice = os.environ.get(KERNELS_ENV, "xla")
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNELS_ENV} must be one of {KERNEL_CHOICES}, got {choice!r}")
    return None if choice == "xla" else choice


class KernelKeyedJit:
    """`jax.jit(fun, **jit_kwargs)` with one compilation cache per `invariant_kernels()`
    value. The setting is read while a program is traced, so a plain jit's cache would serve
    a program traced under one value to a call made under another (a process that runs the
    demo with `--kernels interpret` after a default run, a test that sets the variable). Every
    jitted entry point whose trace reads the setting (the model's and the attention
    kernels' "auto" backend) is one of these; attributes (`lower`, `trace`, `_cache_size`)
    are those of the jit of the current value. For module-level functions (no `__get__`:
    not a method decorator)."""

    def __init__(self, fun, **jit_kwargs):
        functools.update_wrapper(self, fun)
        self._fun, self._jit_kwargs, self._jits = fun, jit_kwargs, {}
        self._lock = threading.Lock()  # the rollout worker and the trainer may trace at once

    def _current(self):
        kernels = invariant_kernels()
        with self._lock:
            if kernels not in self._jits:
                # a function object of its own: jax keys its trace cache on the function, so
                # a second jax.jit(fun) would reuse the other setting's traces
                @functools.wraps(self._fun)
                def traced(*args, **kwargs):
                    return self._fun(*args, **kwargs)
                self._jits[kernels] = jax.jit(traced, **self._jit_kwargs)
            return self._jits[kernels]

    def __call__(self, *args, **kwargs):
        return self._current()(*args, **kwargs)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_fun", "_jit_kwargs", "_jits", "_lock"):
            raise AttributeError(name)  # not set yet (copy, pickle): never recurse
        return getattr(self._current(), name)


def kernel_keyed_jit(fun=None, **jit_kwargs):
    """Decorator form of `KernelKeyedJit` (with or without jit keyword arguments)."""
    if fun is None:
        return functools.partial(kernel_keyed_jit, **jit_kwargs)
    return KernelKeyedJit(fun, **jit_kwargs)


def resolve_backend(backend: str) -> str:
    """Maps "auto" to JAXRL_CACHE_KERNELS's kernels when set, else "pallas" on GPU and "xla"
    elsewhere; validates the name."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return invariant_kernels() or ("pallas" if jax.default_backend() == "gpu" else "xla")
    return backend


def is_power_of_2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def check_int32(name: str, x) -> None:
    if x.dtype != jnp.int32:
        raise ValueError(f"{name} must be int32, got {x.dtype} with shape {x.shape}")


def check_pages(q_name: str, q, k_pages, v_pages, layer) -> None:
    """Validates a [P, Hkv, page_size, D] pool (layer None) or a stacked [L, P, Hkv, page_size, D]
    pool with an int32 scalar `layer`, against q [..., Hq, D]."""
    if k_pages.ndim not in (4, 5):
        raise ValueError("k_pages must be [P, Hkv, page_size, D] or [L, P, Hkv, page_size, D], "
                         f"got shape {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(
            f"v_pages shape {v_pages.shape} must equal k_pages shape {k_pages.shape}")
    if k_pages.ndim == 5 and layer is None:
        raise ValueError(f"a stacked pool {k_pages.shape} needs layer=<int32 scalar>")
    if k_pages.ndim == 4 and layer is not None:
        raise ValueError(f"layer is only valid with a stacked [L, P, Hkv, page_size, D] pool, "
                         f"got k_pages shape {k_pages.shape}")
    if layer is not None and (jnp.shape(layer) != () or jnp.result_type(layer) != jnp.int32):
        raise ValueError(f"layer must be an int32 scalar, got {jnp.result_type(layer)} with "
                         f"shape {jnp.shape(layer)}")
    *_, num_kv_heads, _, head_dim = k_pages.shape
    num_q_heads, q_dim = q.shape[-2], q.shape[-1]
    if q_dim != head_dim:
        raise ValueError(
            f"{q_name} head_dim {q_dim} (shape {q.shape}) != k_pages head_dim {head_dim} "
            f"(shape {k_pages.shape})")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"Hq={num_q_heads} ({q_name} shape {q.shape}) must be a multiple of "
            f"Hkv={num_kv_heads} (k_pages shape {k_pages.shape})")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"{q_name} must be floating point, got {q.dtype}")


def flatten_pool(pages, layer):
    """[P, Hkv, ps, D] (layer None) or [L, P, Hkv, ps, D] -> ([L*P, Hkv, ps, D], page_offset).

    The merge of the two leading axes is a bitcast (no copy); page p of layer l is row
    page_offset + p with page_offset = l * P (int32 scalar; l is clamped to [0, L) like any
    dynamic index).
    """
    if pages.ndim == 4:
        return pages, jnp.zeros((), jnp.int32)
    num_layers, num_pages = pages.shape[:2]
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1)
    return pages.reshape((num_layers * num_pages,) + pages.shape[2:]), layer * num_pages


def as_bits16(x):
    """A 16-bit float array as its uint16 bits (a bit cast), any other array as it is.

    XLA:CPU has no bf16 scatter, gather or dynamic slice: its float normalisation converts
    the WHOLE operand to fp32 and back around each one (a bf16 decode step of SmolLM2 took
    2 s against 80 ms in fp32, converting the KV pool at every layer's write). So the xla
    paths carry a 16-bit KV pool and stacked layer weights as bits through a jitted call
    (`rollout.core`): the KV writes scatter bits, the attention views the pages it gathers
    as floats again (`gather_kv(dtype=)`), the layer scan each layer's weights, so every
    value is the same bits."""
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x


def from_bits16(x, dtype):
    """Inverse of `as_bits16`: a uint16 array viewed as `dtype`; anything else as it is."""
    if x.dtype == jnp.uint16 and jnp.dtype(dtype) != x.dtype:
        return jax.lax.bitcast_convert_type(x, dtype)
    return x


def gather_kv(k_pages, v_pages, page_table, dtype=None):
    """The pages of each table row, in position order (the xla paths).

    k_pages, v_pages [N, Hkv, ps, D] flat pools (or their `as_bits16`); page_table int32
    [R, W] (already offset) -> k, v [R, Hkv, W * ps, D] in the pool's dtype, or in `dtype`
    when the pool holds its bits.
    """
    rows, width = page_table.shape
    num_pages, num_kv_heads, page_size, head_dim = k_pages.shape

    def pages(pool):  # whole pages as rows of one 2-D gather (XLA:CPU copies rows fastest)
        rows_of = pool.reshape(num_pages, -1)[page_table]  # [R, W, Hkv * ps * D]
        rows_of = rows_of.reshape(rows, width, num_kv_heads, page_size, head_dim)
        return jnp.transpose(rows_of, (0, 2, 1, 3, 4)).reshape(
            rows, num_kv_heads, width * page_size, head_dim)

    return (from_bits16(pages(k_pages), dtype or k_pages.dtype),
            from_bits16(pages(v_pages), dtype or v_pages.dtype))


def check_kernel_shapes(page_size: int, head_dim: int) -> None:
    """The Triton lowering needs power-of-2 blocks: pages are loaded whole, head_dim in
    power-of-two chunks of at least 16 (80 = 64 + 16, 96 = 64 + 32)."""
    if not is_power_of_2(page_size):
        raise ValueError(f"page_size must be a power of two for the Pallas kernel, got {page_size}")
    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 for the Pallas kernel, got {head_dim}")


def default_scale(sm_scale: float | None, head_dim: int) -> float:
    return float(head_dim) ** -0.5 if sm_scale is None else float(sm_scale)
