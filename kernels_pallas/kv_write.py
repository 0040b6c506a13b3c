"""Functional scatter of new tokens' K/V into their pages."""
from __future__ import annotations


import jax
import jax.numpy as jnp

from kernels_pallas import _common as c


def write_kv(k_pages, v_pages, k_new, v_new, page_table, token_seq, token_pos, *, layer=None):
    """Writes token t's K/V at page page_table[token_seq[t], token_pos[t] // ps], slot pos % ps.

    k_pages, v_pages [P, Hkv, page_size, D] (or a 16-bit pool's `as_bits16`), or stacked
    [L, P, Hkv, page_size, D] with `layer`
    an int32 scalar (may be traced; only [layer, page, :, slot] is written);
    k_new, v_new [T, Hkv, D];
    page_table int32 [B, W]; token_seq int32 [T]; token_pos int32 [T] (negative = padding,
    dropped). Returns the updated (k_pages, v_pages); pure, so under jit with the pools
    donated the update happens in place.
    """
    if k_new.shape != v_new.shape or k_new.ndim != 3:
        raise ValueError(f"k_new {k_new.shape} and v_new {v_new.shape} must both be [T, Hkv, D]")
    c.check_pages("k_new", k_new, k_pages, v_pages, layer)
    if k_new.shape[1:] != k_pages.shape[-3::2]:
        raise ValueError(
            f"k_new [T, Hkv, D] = {k_new.shape} does not match k_pages {k_pages.shape}")
    for name, x in (("page_table", page_table), ("token_seq", token_seq),
                    ("token_pos", token_pos)):
        c.check_int32(name, x)
    if token_seq.shape != (k_new.shape[0],) or token_pos.shape != (k_new.shape[0],):
        raise ValueError(f"token_seq {token_seq.shape} and token_pos {token_pos.shape} must be "
                         f"[T={k_new.shape[0]}]")
    shape, page_size = k_pages.shape, k_pages.shape[-2]
    k_flat, page_offset = c.flatten_pool(k_pages, layer)
    v_flat, _ = c.flatten_pool(v_pages, layer)
    real = token_pos >= 0
    safe_pos = jnp.where(real, token_pos, 0)
    page = jnp.where(real, page_table[token_seq, safe_pos // page_size] + page_offset,
                     k_flat.shape[0])
    slot = safe_pos % page_size
    # Out-of-range page index + mode="drop" discards padding tokens.
    k_flat = k_flat.at[page, :, slot].set(_as_pool(k_new, k_flat.dtype), mode="drop")
    v_flat = v_flat.at[page, :, slot].set(_as_pool(v_new, v_flat.dtype), mode="drop")
    return k_flat.reshape(shape), v_flat.reshape(shape)


def _as_pool(new, dtype):
    """New K/V in the pool's dtype; for a pool of bits (`_common.as_bits16`) the bits of the
    new values, which must then be 16-bit floats (the model's own dtype)."""
    if dtype == jnp.uint16 and new.dtype != dtype:
        if new.dtype.itemsize != 2 or not jnp.issubdtype(new.dtype, jnp.floating):
            raise ValueError(f"a pool of 16-bit float bits takes 16-bit float K/V, got "
                             f"{new.dtype}")
        return jax.lax.bitcast_convert_type(new, dtype)
    return new.astype(dtype)


write_kv_jit = jax.jit(write_kv, donate_argnums=(0, 1))
