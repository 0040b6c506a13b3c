"""The pre-norm decoder LM every registered family runs (`models.families`: Llama, Mistral,
Qwen2, Qwen3, Gemma): an nnx Module holds the weights, pure functions compute.

RMSNorm (optionally by 1 + w), rotary embeddings (Llama "rotate half" layout, optional
linear/llama3 scaling), GQA, a gated MLP (SwiGLU or GeGLU), optional q/k/v and
output-projection biases, optional per-head q/k RMSNorm, optionally scaled embeddings, tied
or untied head: each a `ModelConfig` field. Weights are stored [in, out] so x @ w, blocks
stacked on a leading [n_layers] axis and run by one lax.scan (`models.hf` maps Hugging Face
checkpoints on). The same params and functions serve the dense `forward` (training, audit)
and the paged `prefill_forward` / `decode_forward` (rollout), so a family's math is the
sampler's and the trainer's alike. Params are always arguments, never closed over, so new
weights never recompile.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_cache.models.config import ModelConfig
from jaxrl_cache.models.dense import Transposed, dense, transpose_pays
from jaxrl_cache.models.lora import SCALE as LORA_SCALE, linear
from jaxrl_cache.spmd import per_batch_shard, split_batch
from kernels_pallas import (from_bits16, gathered_prefill_attention, invariant_kernels,
                            paged_decode_attention, paged_prefill_attention, write_kv)
from kernels_pallas.blocked import (KEY_BLOCK, TILE, all_items, blocked_attention,
                                    gathered_attention, tree_sum)


class DecoderLayers(nnx.Module):
    """All pre-norm blocks, stacked: every weight has a leading [n_layers] axis so the
    forwards run the blocks with one `lax.scan` (compile time independent of depth)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        n, d, hq, hkv, hd = (config.n_layers, config.d_model, config.n_heads, config.n_kv_heads,
                             config.head_dim)
        normal = nnx.initializers.normal(0.02)
        out = nnx.initializers.normal(0.02 / (2 * n) ** 0.5)  # residual scaling

        def param(init, *shape):
            return nnx.Param(init(rngs.params(), (n, *shape), dtype))

        def const(value, *shape):
            return nnx.Param(jnp.full((n, *shape), value, dtype))

        unit = 0 if config.norm_plus_one else 1  # norms start as the identity
        self.attn_norm = const(unit, d)
        self.wq, self.wk, self.wv = param(normal, d, hq * hd), param(normal, d, hkv * hd), \
            param(normal, d, hkv * hd)
        if config.qkv_bias:
            self.bq, self.bk, self.bv = const(0, hq * hd), const(0, hkv * hd), const(0, hkv * hd)
        if config.qk_norm:
            self.q_norm, self.k_norm = const(unit, hd), const(unit, hd)
        self.wo = param(out, hq * hd, d)
        if config.out_bias:
            self.bo = const(0, d)
        self.mlp_norm = const(unit, d)
        self.w_gate, self.w_up = param(normal, d, config.d_ff), param(normal, d, config.d_ff)
        self.w_down = param(out, config.d_ff, d)


class DecoderLM(nnx.Module):
    """The model as a flax nnx Module: it defines and initialises the weights.

    Compute goes through the pure functions below on `params()`, a plain pytree, so the
    trainer and the rollout engine pass weights as jit arguments (a new version never
    recompiles). `model(tokens)` is the dense forward.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtype = jnp.dtype(config.dtype)
        normal = nnx.initializers.normal(0.02)
        self.embed = nnx.Param(normal(rngs.params(), (config.vocab_size, config.d_model), dtype))
        self.layers = DecoderLayers(config, rngs=rngs)
        self.final_norm = nnx.Param(jnp.full((config.d_model,), 0 if config.norm_plus_one
                                             else 1, dtype))
        if not config.tie_embeddings:
            self.lm_head = nnx.Param(normal(rngs.params(), (config.d_model, config.vocab_size),
                                            dtype))

    def params(self) -> dict:
        """The weights as a plain pytree; params["layers"] is a dict of [n_layers, ...] arrays."""
        state = nnx.state(self, nnx.Param)
        # nnx.to_pure_dict is the newer spelling (State.to_pure_dict is deprecated)
        return nnx.to_pure_dict(state) if hasattr(nnx, "to_pure_dict") else state.to_pure_dict()

    def __call__(self, tokens):  # tokens int32 [B, T] -> logits f32 [B, T, V]
        return forward(self.params(), self.config, tokens)


PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # [L, in, out] each


def sampler_layout(params: dict, dtype) -> dict:
    """The rollout engine's weights: each layer projection for which
    `models.dense.transpose_pays` held with a fresh [L, out, in] transpose beside it
    (`Transposed`), so a decode of a few rows runs unpadded with the very bits the trainer's
    [in, out] dot gives (models/dense.py). Every array of params is kept as it is. dtype:
    the model's (uint16 layers are its bits, `_layer_weight`)."""
    layers = dict(params["layers"])

    def computed(w):  # the dtype the block computes the weight in
        return jnp.dtype(dtype if w.dtype == jnp.uint16 else w.dtype).name

    pays = [name for name in PROJECTIONS if isinstance(layers.get(name), jax.Array)
            and transpose_pays(layers[name].shape[-2], layers[name].shape[-1],
                               computed(layers[name]))]
    transposes = _transposed([layers[name] for name in pays])
    layers.update({name: Transposed(layers[name], t) for name, t in zip(pays, transposes)})
    return {**params, "layers": layers}


_transposed = jax.jit(lambda ws: [jnp.swapaxes(w, -1, -2) for w in ws])  # fresh buffers


def init_params(config: ModelConfig, key: jax.Array) -> dict:
    """Random params (normal(0.02) matrices, identity norms, zero biases) as a plain pytree."""
    return DecoderLM(config, rngs=nnx.Rngs(params=key)).params()


def rms_norm(x, weight, eps, plus_one: bool = False):
    """RMSNorm over the last axis, computed in fp32 (the mean by a fixed tree, `tree_sum`),
    scaled by weight (by 1 + weight when plus_one, Gemma's), returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = (tree_sum(x32 * x32, -1) / x.shape[-1])[..., None]
    x32 = x32 * jax.lax.rsqrt(mean + eps)
    scale = weight.astype(jnp.float32)
    return (x32 * (1 + scale if plus_one else scale)).astype(x.dtype)


def _norm(config: ModelConfig, x, weight):
    """The model's RMSNorm of x [..., n] by weight [n]."""
    return rms_norm(x, weight, config.norm_eps, config.norm_plus_one)


def embed(params, config: ModelConfig, tokens):
    """tokens int32 [...] -> embeddings [..., d_model] in the params' dtype (times
    sqrt(d_model) rounded to that dtype under config.embed_scale, as transformers' Gemma)."""
    x = params["embed"][tokens]
    if config.embed_scale:
        x = x * jnp.asarray(np.float32(np.sqrt(config.d_model)), x.dtype)
    return x


def rotary_tables(positions, inv_freq):
    """positions int32 [..., T]; inv_freq f32 [D/2] -> (cos, sin) f32 [..., T, 1, D/2].
    Computed once per forward, outside the layer scan: every layer reads the same tables,
    and no fusion recomputes sin and cos for each copy of a key it gathers."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., T, D/2]
    return jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]


def rotary(x, tables):
    """x [..., T, H, D]; tables: `rotary_tables` of its positions. Llama rotate-half."""
    cos, sin = tables
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _qkv(layer, config, h, tables, scale):
    """h [..., T, d_model] -> q [..., T, Hq, D], k/v [..., T, Hkv, D] with rotary applied
    (tables: `rotary_tables` of the positions). `layer` holds one block's weights (no layer
    axis); scale: the LoRA scale (or None)."""
    q, k, v = (linear(layer, name, h, scale) for name in ("wq", "wk", "wv"))
    if config.qkv_bias:
        q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
    lead = h.shape[:-1]
    q = q.reshape(*lead, config.n_heads, config.head_dim)
    k = k.reshape(*lead, config.n_kv_heads, config.head_dim)
    v = v.reshape(*lead, config.n_kv_heads, config.head_dim)
    if config.qk_norm:
        q, k = _norm(config, q, layer["q_norm"]), _norm(config, k, layer["k_norm"])
    return rotary(q, tables), rotary(k, tables), v


def _mlp(layer, config, h, scale):
    """The gated MLP: h [..., d_model] -> [..., d_model] (act(h Wg) * h Wu) Wd."""
    gate, up = linear(layer, "w_gate", h, scale), linear(layer, "w_up", h, scale)
    act = jax.nn.silu(gate) if config.mlp_act == "silu" else jax.nn.gelu(gate, approximate=True)
    return linear(layer, "w_down", act * up, scale)


def lm_logits(params, config, x):
    """Final norm + LM head: hidden x [..., d_model] -> logits f32 [..., V]."""
    x = _norm(config, x, params["final_norm"])
    if config.tie_embeddings:
        return dense(x, params["embed"], jnp.float32, w_rows_out=True)
    return dense(x, params["lm_head"], jnp.float32)


REMAT_POLICIES = {  # what the backward pass keeps of each block (the rest is recomputed)
    "full": jax.checkpoint_policies.nothing_saveable,  # only the block's input
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # + weight matmuls
}


def _layer_weight(w, dtype):
    """One layer's weight as the block computes it in `dtype`: fp32 master weights cast (a
    bf16 train step), a 16-bit weight held as its bits viewed as floats again
    (`rollout.core` hands the engine's layers over that way)."""
    if w.dtype == jnp.uint16:
        return from_bits16(w, dtype)
    if jnp.issubdtype(w.dtype, jnp.floating) and jnp.dtype(dtype).itemsize < w.dtype.itemsize:
        return w.astype(dtype)
    return w


def _decoder(params, config, x, positions, attend: Callable, kv_cache, remat: str = "none"):
    """Runs the stacked blocks with one lax.scan; kv_cache (any pytree, or None) is carried.

    attend(layer int32 [], q, k, v, kv_cache) -> (out [..., T, Hq, D], kv_cache').
    remat: "none", or a REMAT_POLICIES key (each block rematerialised in the backward pass).
    LoRA adapters in params (`models.lora`) are applied in every projection they target.
    Layer weights wider than x (fp32 master weights in a bf16 train step) are cast one
    layer at a time inside the scan: the same values as a cast of the whole stack, and the
    backward then adds each layer's gradient into the fp32 stack in place (a cast stack
    made XLA convert the whole stack at every layer). uint16 layer weights are bf16 bits
    (`_layer_weight`).
    """
    scale = params.get(LORA_SCALE)
    tables = rotary_tables(positions, jnp.asarray(config.inv_freq()))

    def block(carry, layer):
        x, kv_cache, index = carry
        layer = jax.tree.map(lambda w: _layer_weight(w, x.dtype), layer)
        x = split_batch(x)  # under a data/fsdp mesh only (jaxrl_cache.spmd)
        h = _norm(config, x, layer["attn_norm"])
        q, k, v = _qkv(layer, config, h, tables, scale)
        attn, kv_cache = attend(index, q, k, v, kv_cache)
        attn = linear(layer, "wo", attn.reshape(*attn.shape[:-2], -1), scale)
        x = x + (attn + layer["bo"] if config.out_bias else attn)
        x = x + _mlp(layer, config, _norm(config, x, layer["mlp_norm"]), scale)
        return (x, kv_cache, index + 1), None

    if remat != "none":
        block = jax.checkpoint(block, policy=REMAT_POLICIES[remat])
    (x, kv_cache, _), _ = jax.lax.scan(block, (x, kv_cache, jnp.int32(0)), params["layers"])
    return x, kv_cache


def hidden_states(params, config: ModelConfig, tokens, positions=None, segments=None,
                  parents=None, kv_blocks=None, items=None, columns=None, sources=None, *,
                  remat: str = "none"):
    """Dense causal forward to the last block's output (before the final norm).

    tokens int32 [B, T] (T <= max_seq_len); positions int32 [B, T] (default 0..T-1);
    segments int32 [B, T] (default: one segment per row): packed rows hold several
    sequences, a token attends only to earlier tokens of its own segment, and positions
    restart per sequence; for the sampler's bits a sequence starts on a multiple of TILE
    (`kernels_pallas.blocked`). parents int32 [B, T] (optional, with segments; 0 = none): a
    token also attends to the earlier tokens of segment parents[b, t] (a prefix its sequence
    shares with others of the row, laid out once before them; the positions then continue
    from the prefix's length). kv_blocks int32 [B, T / TILE, KM] (optional, with segments;
    KM a multiple of KEY_BLOCK / TILE): the TILEs of keys each tile of TILE queries can see,
    in its sequence's order (its prefix's, then its own up to itself), padded with -1:
    attention then runs on those only (`gathered_attention`); without them, packed rows
    list every visible TILE themselves (`_tile_lists`, O(T^2)), with the same bits.
    items int32 [B, W] (optional, with kv_blocks; -1 = none): the (tile, key block) pairs
    attention computes, as tile * KM / (KEY_BLOCK / TILE) + block (rl.packing lists those
    with a visible key); default every pair (`gathered_attention`).
    columns int32 [B, N], sources int32 [B, T] (optional, with kv_blocks; `rl.packing`):
    the projections, norms and MLPs run on each row's N distinct tokens only (the token at
    column columns[b, n]), attention on the row layout (column t reads distinct token
    sources[b, t]): a token's row of a matmul has the same bits in any row count, so the
    result is the one the row layout gives, without computing a token a row repeats or pads.
    Returns x [B, T, d_model] in the params' dtype. Under JAXRL_CACHE_KERNELS
    (`kernels_pallas.invariant_kernels`) attention runs on the sampler's prefill kernel.
    """
    batch, length = tokens.shape
    if segments is None and length > config.max_seq_len:  # packed rows: positions restart
        raise ValueError(f"tokens has length {length} > max_seq_len {config.max_seq_len}")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    hkv, group, hd = config.n_kv_heads, config.n_heads // config.n_kv_heads, config.head_dim
    if (columns is None) != (sources is None) or (columns is not None and kv_blocks is None):
        raise ValueError("columns and sources go together, with kv_blocks (rl.packing lists "
                         "all three)")
    if items is not None and kv_blocks is None:
        raise ValueError("items name pairs of kv_blocks: pass kv_blocks with them")
    if segments is None and invariant_kernels() is not None:
        # plain causal rows as one packed sequence each, so attention runs on the sampler's
        # prefill kernel too (their tile lists follow)
        segments = jnp.ones((batch, length), jnp.int32)
    if segments is not None and kv_blocks is None:
        # every tile's visible TILEs listed from the rows themselves (rl.packing lists them
        # on the host): a sequence's keys are then reduced in its own key blocks, not the row's
        pad = -length % TILE
        padded = [jnp.pad(x, ((0, 0), (0, pad)), mode=mode) for x, mode in (
            (tokens, "constant"), (positions, "edge"), (segments, "constant"),
            (jnp.zeros_like(segments) if parents is None else parents, "constant"))]
        x = hidden_states(params, config, *padded, kv_blocks=_tile_lists(*padded[2:]),
                          remat=remat)
        return x[:, :length]
    if kv_blocks is not None:
        if segments is None or length % TILE or kv_blocks.shape[-1] % (KEY_BLOCK // TILE):
            raise ValueError(f"kv_blocks needs segments, a row length that is a multiple of "
                             f"{TILE} (packed rows) and whole key blocks of {KEY_BLOCK // TILE} "
                             f"tiles, got length {length}, kv_blocks {kv_blocks.shape}")
        attend = _gathered_attend(config, segments, parents, kv_blocks, items)
        if columns is not None:
            return _distinct_forward(params, config, tokens, positions, attend, columns,
                                     sources, remat)
    else:
        mask = jnp.tril(jnp.ones((length, length), bool))[None]  # [1, T, T]
        visible = jnp.repeat(mask, group, axis=1)[:, None]  # [1, 1, T * G, T]

        def attend(_, q, k, v, kv_cache):  # the sampler's order (kernels_pallas.blocked)
            qg = q.reshape(batch, length, hkv, group, hd).transpose(0, 2, 1, 3, 4)
            out = blocked_attention(qg.reshape(batch, hkv, length * group, hd),
                                    k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), visible,
                                    hd ** -0.5)  # [B, Hkv, T * G, D]
            out = out.reshape(batch, hkv, length, group, hd).transpose(0, 2, 1, 3, 4)
            return out.reshape(batch, length, config.n_heads, hd).astype(q.dtype), kv_cache

    x, _ = _decoder(params, config, embed(params, config, tokens), positions, attend, None,
                    remat)
    return x


def _distinct_forward(params, config, tokens, positions, attend, columns, sources, remat):
    """hidden_states on each row's distinct tokens (columns [B, N]) with attention on the
    row layout (sources [B, T]): x [B, T, d_model]."""
    take = jax.vmap(lambda x, index: x[index])  # per row (a row-sharded batch keeps it local)

    def attend_distinct(layer, q, k, v, kv_cache):  # q/k/v [B, N, H, D]
        out, kv_cache = attend(layer, take(q, sources), take(k, sources), take(v, sources),
                               kv_cache)
        return take(out, columns), kv_cache

    x = embed(params, config, take(tokens, columns))
    x, _ = _decoder(params, config, x, take(positions, columns), attend_distinct, None, remat)
    return take(x, sources)


def _sees(segments, parents):
    """segments, parents int32 [B, T] -> bool [B, T, T]: a query of segment s (parent p)
    sees the keys of s, and of p when p > 0 (causality apart)."""
    same = segments[:, :, None] == segments[:, None, :]
    if parents is None:
        return same
    return same | ((parents[:, :, None] == segments[:, None, :]) & (parents[:, :, None] > 0))


def _tile_lists(segments, parents):
    """segments, parents int32 [B, T] (T a multiple of TILE; segment 0 = padding, which
    sees nothing) -> kv_blocks int32 [B, T / TILE, KM]: the TILEs of keys some query of
    each tile sees (`_sees`, causal), increasing, then -1 (KM: T / TILE rounded up to whole
    key blocks). What rl.packing lists on the host, from [B, T, T] masks."""
    batch, length = segments.shape
    nq, per = length // TILE, KEY_BLOCK // TILE
    mask = jnp.tril(jnp.ones((length, length), bool))[None] & _sees(segments, parents)
    mask = mask & (segments > 0)[:, :, None]
    seen = mask.reshape(batch, nq, TILE, nq, TILE).any(axis=(2, 4))  # [B, NQ, NQ]
    order = jnp.argsort(~seen, axis=-1, stable=True).astype(jnp.int32)  # seen first, in order
    blocks = jnp.where(jnp.take_along_axis(seen, order, -1), order, -1)
    return jnp.pad(blocks, ((0, 0), (0, 0), (0, -nq % per)), constant_values=-1)


def _gathered_attend(config: ModelConfig, segments, parents, kv_blocks, items):
    """attend() for packed rows over each query tile's visible key blocks only.
    segments, parents int32 [B, T]; kv_blocks int32 [B, NQ, KM] (-1 = none); items int32
    [B, W] or None (every pair)."""
    batch, length = segments.shape
    nq, km = kv_blocks.shape[1:]
    hkv, group, hd = config.n_kv_heads, config.n_heads // config.n_kv_heads, config.head_dim
    cols = (jnp.maximum(kv_blocks, 0)[..., None] * TILE
            + jnp.arange(TILE, dtype=jnp.int32)).reshape(batch, nq * km * TILE)
    valid = jnp.repeat(kv_blocks >= 0, TILE, axis=-1)  # [B, NQ, KM * TILE]
    k_seg = jnp.take_along_axis(segments, cols, axis=1).reshape(batch, nq, 1, -1)
    q_cols = jnp.arange(length, dtype=jnp.int32).reshape(1, nq, TILE, 1)
    q_seg = segments.reshape(batch, nq, TILE, 1)
    sees = q_seg == k_seg
    if parents is not None:
        q_par = parents.reshape(batch, nq, TILE, 1)
        sees = sees | ((q_par == k_seg) & (q_par > 0))
    visible = sees & valid[:, :, None, :] & \
        (cols.reshape(batch, nq, 1, -1) <= q_cols)  # [B, NQ, TILE, KM * TILE]
    visible = jnp.repeat(visible, group, axis=2)[:, None]  # [B, 1, NQ, TILE * G, KM * TILE]
    blocks = jnp.broadcast_to(jnp.maximum(kv_blocks, 0)[:, None], (batch, hkv, nq, km))
    items = all_items(kv_blocks) if items is None else items  # [B or 1, W]
    items = jnp.broadcast_to(items[:, None], (batch, 1, items.shape[-1]))

    kernels = invariant_kernels()
    if kernels is None:
        gathered = gathered_attention
    else:  # the sampler's prefill kernel (a GPU's dots are not batch-invariant), per
        #     batch shard under a training mesh (a custom call the partitioner cannot split)
        def gathered(q, k, v, blocks, visible, items, scale):
            return per_batch_shard(
                lambda *args: gathered_prefill_attention(*args, scale, kernels),
                q, k, v, blocks, visible, items)

    def attend(_, q, k, v, kv_cache):
        qg = q.reshape(batch, nq, TILE, hkv, group, hd).transpose(0, 3, 1, 2, 4, 5)
        out = gathered(qg.reshape(batch, hkv, nq, TILE * group, hd),
                       k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), blocks, visible,
                       items, hd ** -0.5)  # [B, Hkv, NQ, TILE * G, D]
        out = out.reshape(batch, hkv, nq, TILE, group, hd).transpose(0, 2, 3, 1, 4, 5)
        return out.reshape(batch, length, config.n_heads, hd).astype(q.dtype), kv_cache
    return attend


def forward(params, config: ModelConfig, tokens):
    """Dense causal forward. tokens int32 [B, T] (T <= max_seq_len) -> logits f32 [B, T, V].
    Materialises [B, T, V]: training and scoring use rl.logprobs (chunked) instead."""
    return lm_logits(params, config, hidden_states(params, config, tokens))


def init_kv_cache(config: ModelConfig, num_pages: int, page_size: int):
    """The KV pool (k, v), each [n_layers, P, Hkv, page_size, D] zeros; page 0 is null."""
    shape = (config.n_layers, num_pages, config.n_kv_heads, page_size, config.head_dim)
    dtype = jnp.dtype(config.dtype)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def copy_pages(kv_cache, src, dst):
    """Copies pages src[i] -> dst[i] in every layer. src, dst int32 [C] (0 -> 0 is a no-op
    pad: the null page copied onto itself)."""
    return jax.tree.map(lambda pages: pages.at[:, dst].set(pages[:, src]), kv_cache)


def _paged_attend(kernel: Callable, page_table, token_seq, token_pos):
    """attend() for `_decoder` over the stacked pool, without copying a layer out of it.

    The pool [L, P, ...] is viewed as one flat pool [L * P, ...] (a free reshape) and layer
    l's pages are addressed as l * P + page: the K/V write is a scatter at those pages and
    the attention kernel reads them through the shifted page table.
    kernel(q, k_flat, v_flat, page_table, layer_offset) -> out.
    """
    def attend(layer, q, k, v, kv_cache):
        k_pool, v_pool = kv_cache
        offset = layer * k_pool.shape[1]
        table = page_table + offset
        k_flat, v_flat = write_kv(k_pool.reshape(-1, *k_pool.shape[2:]),
                                  v_pool.reshape(-1, *v_pool.shape[2:]), k, v, table,
                                  token_seq, token_pos)
        out = kernel(q, k_flat, v_flat, table, offset)
        return out, (k_flat.reshape(k_pool.shape), v_flat.reshape(v_pool.shape))
    return attend


def prefill_forward(params, config: ModelConfig, kv_cache, tokens, token_seq, token_pos,
                    page_table, cu_q_lens, kv_lens, logit_index, *, backend: str):
    """Paged prefill of packed new tokens; writes their KV, returns chosen rows' logits.

    tokens, token_seq, token_pos int32 [T] (token_pos -1 = padding); page_table int32 [S, W];
    cu_q_lens int32 [S+1]; kv_lens int32 [S]; logit_index int32 [S] (packed row whose logits
    to return). kv_cache: (k, v) each [L, P, Hkv, ps, D] (`init_kv_cache`).
    Returns (logits f32 [S, V], kv_cache').
    """
    def kernel(q, k_flat, v_flat, table, _):
        return paged_prefill_attention(q, k_flat, v_flat, table, cu_q_lens, kv_lens,
                                       backend=backend)

    attend = _paged_attend(kernel, page_table, token_seq, token_pos)
    x = embed(params, config, tokens)
    x, kv_cache = _decoder(params, config, x, jnp.maximum(token_pos, 0), attend, kv_cache)
    return lm_logits(params, config, x[logit_index]), kv_cache


def decode_forward(params, config: ModelConfig, kv_cache, tokens, positions, page_table,
                   shared_pages=None, *, backend: str):
    """One decode step for a batch of rows; writes each row's KV at its position.

    tokens int32 [B]; positions int32 [B] (-1 = inactive row); page_table int32 [B, W];
    kv_cache (k, v) each [L, P, Hkv, ps, D]. shared_pages int32 [S] (optional): the first S
    pages of every row's table, common to all rows and never written here (S * ps <= every
    live position); page_table then holds each row's pages after them.
    Returns (logits f32 [B, V], kv_cache').
    """
    rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    seq_lens = jnp.maximum(positions + 1, 0)
    shared_tokens = 0 if shared_pages is None else shared_pages.shape[0] * kv_cache[0].shape[-2]
    table_pos = jnp.where(positions >= 0, positions - shared_tokens, -1)  # in page_table

    def kernel(q, k_flat, v_flat, table, offset):
        shared = None if shared_pages is None else shared_pages + offset
        return paged_decode_attention(q, k_flat, v_flat, table, seq_lens, shared_pages=shared,
                                      backend=backend)

    attend = _paged_attend(kernel, page_table, rows, table_pos)
    x = embed(params, config, tokens)
    x, kv_cache = _decoder(params, config, x, jnp.maximum(positions, 0), attend, kv_cache)
    return lm_logits(params, config, x), kv_cache
