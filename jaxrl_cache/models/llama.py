"""A Llama/Qwen2-family decoder LM: an nnx Module holds the weights, pure functions compute.

RMSNorm, rotary embeddings (Llama "rotate half" layout), GQA, SwiGLU, optional qkv bias,
tied or untied embeddings. Weights are stored [in, out] so x @ w; a Hugging Face Llama or
Qwen2 checkpoint maps on by transposing its Linear weights. The same params serve the dense
`forward` (training, audit) and the paged `prefill_forward` / `decode_forward` (rollout).
Params are always arguments, never closed over, so new weights never recompile.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_cache.models.config import ModelConfig
from kernels_pallas import paged_decode_attention, paged_prefill_attention, write_kv


class DecoderLayer(nnx.Module):
    """One pre-norm block: attention (GQA, rotary) and a SwiGLU MLP."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        d, hq, hkv, hd = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
        normal = nnx.initializers.normal(0.02)
        out = nnx.initializers.normal(0.02 / (2 * config.n_layers) ** 0.5)  # residual scaling

        def param(init, shape):
            return nnx.Param(init(rngs.params(), shape, dtype))

        self.attn_norm = nnx.Param(jnp.ones((d,), dtype))
        self.wq, self.wk, self.wv = (param(normal, (d, hq * hd)), param(normal, (d, hkv * hd)),
                                     param(normal, (d, hkv * hd)))
        if config.qkv_bias:
            self.bq = nnx.Param(jnp.zeros((hq * hd,), dtype))
            self.bk = nnx.Param(jnp.zeros((hkv * hd,), dtype))
            self.bv = nnx.Param(jnp.zeros((hkv * hd,), dtype))
        self.wo = param(out, (hq * hd, d))
        self.mlp_norm = nnx.Param(jnp.ones((d,), dtype))
        self.w_gate, self.w_up = param(normal, (d, config.d_ff)), param(normal, (d, config.d_ff))
        self.w_down = param(out, (config.d_ff, d))


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
        self.layers = nnx.List([DecoderLayer(config, rngs=rngs)
                                for _ in range(config.n_layers)])
        self.final_norm = nnx.Param(jnp.ones((config.d_model,), dtype))
        if not config.tie_embeddings:
            self.lm_head = nnx.Param(normal(rngs.params(), (config.d_model, config.vocab_size),
                                            dtype))

    def params(self) -> dict:
        """The weights as a plain pytree: layers is a list of dicts, one per block."""
        state = nnx.state(self, nnx.Param)
        # nnx.to_pure_dict is the newer spelling (State.to_pure_dict is deprecated)
        state = nnx.to_pure_dict(state) if hasattr(nnx, "to_pure_dict") else state.to_pure_dict()
        state["layers"] = [state["layers"][i] for i in range(self.config.n_layers)]
        return state

    def __call__(self, tokens):  # tokens int32 [B, T] -> logits f32 [B, T, V]
        return forward(self.params(), self.config, tokens)


def init_params(config: ModelConfig, key: jax.Array) -> dict:
    """Random params (normal(0.02) matrices, unit norms, zero biases) as a plain pytree."""
    return DecoderLM(config, rngs=nnx.Rngs(params=key)).params()


def rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rotary(x, positions, theta):
    """x [..., T, H, D]; positions int32 [..., T]. Llama rotate-half convention."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [D/2]
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [..., T, D/2]
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _qkv(layer, config, h, positions):
    """h [..., T, d_model] -> q [..., T, Hq, D], k/v [..., T, Hkv, D] with rotary applied."""
    q, k, v = h @ layer["wq"], h @ layer["wk"], h @ layer["wv"]
    if config.qkv_bias:
        q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
    lead = h.shape[:-1]
    q = q.reshape(*lead, config.n_heads, config.head_dim)
    k = k.reshape(*lead, config.n_kv_heads, config.head_dim)
    v = v.reshape(*lead, config.n_kv_heads, config.head_dim)
    return rotary(q, positions, config.rope_theta), rotary(k, positions, config.rope_theta), v


def _mlp(layer, h):
    return (jax.nn.silu(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"]


def _logits(params, config, x):
    x = rms_norm(x, params["final_norm"], config.norm_eps)
    head = params["embed"].T if config.tie_embeddings else params["lm_head"]
    return (x @ head).astype(jnp.float32)


def _decoder(params, config, x, positions, attend: Callable, kv_cache):
    """Runs every layer. attend(layer_index, q, k, v, cache_entry) -> (out, cache_entry)."""
    new_cache = []
    for i, layer in enumerate(params["layers"]):
        h = rms_norm(x, layer["attn_norm"], config.norm_eps)
        q, k, v = _qkv(layer, config, h, positions)
        attn, entry = attend(q, k, v, None if kv_cache is None else kv_cache[i])
        new_cache.append(entry)
        x = x + attn.reshape(*attn.shape[:-2], -1) @ layer["wo"]
        x = x + _mlp(layer, rms_norm(x, layer["mlp_norm"], config.norm_eps))
    return x, (None if kv_cache is None else tuple(new_cache))


def forward(params, config: ModelConfig, tokens):
    """Dense causal forward. tokens int32 [B, T] -> logits f32 [B, T, V]."""
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    group = config.n_heads // config.n_kv_heads
    causal = jnp.tril(jnp.ones((length, length), bool))

    def attend(q, k, v, _):
        k, v = jnp.repeat(k, group, axis=-2), jnp.repeat(v, group, axis=-2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * config.head_dim ** -0.5
        p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1).astype(v.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v), None

    x = params["embed"][tokens]
    x, _ = _decoder(params, config, x, positions, attend, None)
    return _logits(params, config, x)


def init_kv_cache(config: ModelConfig, num_pages: int, page_size: int):
    """Per layer (k_pages, v_pages), each [P, Hkv, page_size, D] zeros."""
    shape = (num_pages, config.n_kv_heads, page_size, config.head_dim)
    dtype = jnp.dtype(config.dtype)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                 for _ in range(config.n_layers))


def copy_pages(kv_cache, src, dst):
    """Copies pages src[i] -> dst[i] in every layer. src, dst int32 [C] (0 -> 0 is a no-op
    pad: the null page copied onto itself)."""
    return jax.tree.map(lambda pages: pages.at[dst].set(pages[src]), kv_cache)


def prefill_forward(params, config: ModelConfig, kv_cache, tokens, token_seq, token_pos,
                    page_table, cu_q_lens, kv_lens, logit_index, *, backend: str):
    """Paged prefill of packed new tokens; writes their KV, returns chosen rows' logits.

    tokens, token_seq, token_pos int32 [T] (token_pos -1 = padding); page_table int32 [S, W];
    cu_q_lens int32 [S+1]; kv_lens int32 [S]; logit_index int32 [S] (packed row whose logits
    to return). kv_cache: per layer (k_pages, v_pages) [P, Hkv, ps, D].
    Returns (logits f32 [S, V], kv_cache').
    """
    def attend(q, k, v, entry):
        k_pages, v_pages = write_kv(*entry, k, v, page_table, token_seq, token_pos)
        out = paged_prefill_attention(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens,
                                      backend=backend)
        return out, (k_pages, v_pages)

    x = params["embed"][tokens]
    x, kv_cache = _decoder(params, config, x, jnp.maximum(token_pos, 0), attend, kv_cache)
    return _logits(params, config, x[logit_index]), kv_cache


def decode_forward(params, config: ModelConfig, kv_cache, tokens, positions, page_table, *,
                   backend: str):
    """One decode step for a batch of rows; writes each row's KV at its position.

    tokens int32 [B]; positions int32 [B] (-1 = inactive row); page_table int32 [B, W].
    Returns (logits f32 [B, V], kv_cache').
    """
    rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    seq_lens = jnp.maximum(positions + 1, 0)

    def attend(q, k, v, entry):
        k_pages, v_pages = write_kv(*entry, k, v, page_table, rows, positions)
        out = paged_decode_attention(q, k_pages, v_pages, page_table, seq_lens, backend=backend)
        return out, (k_pages, v_pages)

    x = params["embed"][tokens]
    x, kv_cache = _decoder(params, config, x, jnp.maximum(positions, 0), attend, kv_cache)
    return _logits(params, config, x), kv_cache
