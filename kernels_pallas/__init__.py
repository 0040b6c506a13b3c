"""Pallas paged-attention kernels (decode and prefill) over a functional page table, and
the batch-invariant kernels behind JAXRL_CACHE_KERNELS (matmul.py, normaliser.py).

Pool layout "HND": k_pages, v_pages [P, Hkv, page_size, D], or stacked over layers
[L, P, Hkv, page_size, D] with a `layer` index; page 0 is the null page that pads page
tables. Backends: "pallas" (Triton, GPU), "interpret" (same kernel, Pallas interpret mode),
"xla" (pure-jnp reference, the fast CPU path), "auto".
"""
from kernels_pallas._common import (BACKENDS, KERNEL_CHOICES, KERNELS_ENV, invariant_kernels,
                                    is_power_of_2, kernel_keyed_jit, next_power_of_2,
                                    as_bits16, from_bits16, resolve_backend)
from kernels_pallas.decode import (DecodePlan, paged_decode_attention, paged_decode_reference,
                                   plan_decode)
from kernels_pallas.kv_write import write_kv, write_kv_jit
from kernels_pallas.normaliser import log_sum_exp
from kernels_pallas.prefill import (gathered_prefill_attention, paged_prefill_attention,
                                    paged_prefill_reference)

__all__ = [
    "BACKENDS", "KERNEL_CHOICES", "KERNELS_ENV", "invariant_kernels", "kernel_keyed_jit",
    "is_power_of_2", "next_power_of_2", "as_bits16", "from_bits16", "resolve_backend",
    "DecodePlan", "paged_decode_attention", "paged_decode_reference", "plan_decode",
    "gathered_prefill_attention", "paged_prefill_attention", "paged_prefill_reference",
    "write_kv", "write_kv_jit", "log_sum_exp",
]
