"""Pallas paged-attention kernels (decode and prefill) over a functional page table.

Pool layout "HND": k_pages, v_pages [P, Hkv, page_size, D]; page 0 is the null page that
pads page tables. Backends: "pallas" (Triton, GPU), "interpret" (same kernel, Pallas
interpret mode), "xla" (pure-jnp reference, the fast CPU path), "auto".
"""
from kernels_pallas.decode import paged_decode_attention, paged_decode_reference
from kernels_pallas.kv_write import write_kv, write_kv_jit
from kernels_pallas.prefill import paged_prefill_attention, paged_prefill_reference

__all__ = [
    "paged_decode_attention", "paged_decode_reference",
    "paged_prefill_attention", "paged_prefill_reference",
    "write_kv", "write_kv_jit",
]
