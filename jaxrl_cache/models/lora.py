"""LoRA adapters on the stacked layer weights: W x + scale * B(A x), base frozen.

A model with adapters is the base param tree with two additions, so every forward (dense,
paged prefill, paged decode) runs it unchanged and a new adapter state never recompiles:

    params["layers"]["lora"][name] = {"a": [n_layers, in, rank], "b": [n_layers, rank, out]}
    params["lora_scale"] = f32 [] (alpha / rank)

`attach(frozen, adapters)` builds that tree from the frozen part (the base plus the scale,
`frozen_part`) and the trainable adapters without copying either. The scale is an array
leaf, not a constant, so the trainer and the rollout engine run the same program shape.
Exactness: `linear` applies the scale to the [.., rank] intermediate, never as a product
feeding an add (XLA:CPU would contract that into an FMA in one program and not another).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_cache.models.config import ModelConfig
from jaxrl_cache.models.dense import dense

ADAPTERS = "lora"  # key under params["layers"]
SCALE = "lora_scale"  # top-level key of the scale, f32 []
HF_NAMES = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
            "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}  # PEFT -> ours
ALL_LINEAR = tuple(HF_NAMES)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """PEFT's LoraConfig defaults: rank 8, alpha 8, targets q_proj and v_proj ("all-linear":
    every attention and MLP projection). dropout must be 0: the trainer's forward has to
    reproduce the sampler's log-probs bit for bit (the in-step audit), which a dropped
    adapter activation breaks."""
    rank: int = 8
    alpha: float = 8.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    dropout: float = 0.0

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, (int, np.integer)) \
                or self.rank < 1:
            raise ValueError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) \
                or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be a finite number > 0, got {self.alpha!r}")
        if self.dropout != 0:
            raise ValueError(f"LoRA dropout must be 0, got {self.dropout!r}: the trainer's "
                             f"forward must reproduce the sampler's log-probs bit for bit "
                             f"(the attribution audit), and dropout changes it")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        if targets in (("all-linear",), ("all",)):
            targets = ALL_LINEAR
        unknown = [t for t in targets if t not in HF_NAMES]
        if unknown or not targets:
            raise ValueError(f"LoRA targets must be among {', '.join(ALL_LINEAR)} or "
                             f"'all-linear', got {list(targets)}")
        object.__setattr__(self, "rank", int(self.rank))
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "targets", tuple(t for t in ALL_LINEAR if t in targets))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _shapes(config: ModelConfig) -> dict:
    """(in, out) of each projection (ours names)."""
    q, kv, d, f = (config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim,
                   config.d_model, config.d_ff)
    return {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d), "w_gate": (d, f),
            "w_up": (d, f), "w_down": (f, d)}


def init_adapters(config: ModelConfig, lora: LoraConfig, key: jax.Array) -> dict:
    """Fresh adapters as PEFT initialises them: A uniform in +-1/sqrt(in) (kaiming-uniform
    with a = sqrt(5)), B zero, so the model starts as the base exactly.
    Returns {name: {"a": [n_layers, in, rank], "b": [n_layers, rank, out]}} in config.dtype."""
    dtype, n, shapes = jnp.dtype(config.dtype), config.n_layers, _shapes(config)
    out = {}
    for target, k in zip(lora.targets, jax.random.split(key, len(lora.targets))):
        d_in, d_out = shapes[HF_NAMES[target]]
        bound = 1.0 / math.sqrt(d_in)
        out[HF_NAMES[target]] = {
            "a": jax.random.uniform(k, (n, d_in, lora.rank), jnp.float32, -bound,
                                    bound).astype(dtype),
            "b": jnp.zeros((n, lora.rank, d_out), dtype)}
    return out


def frozen_part(base: dict, lora: LoraConfig) -> dict:
    """The frozen side of a LoRA model: the base tree (the very arrays) plus the scale."""
    if SCALE in base or ADAPTERS in base.get("layers", {}):
        raise ValueError("the base params already carry LoRA adapters; merge them first "
                         "(models.lora.merged) or pass the plain base")
    return {**base, SCALE: jnp.float32(lora.scale)}


def attach(frozen: dict, adapters: dict) -> dict:
    """The model's params: frozen (`frozen_part`) with the adapters under layers, no copy."""
    return {**frozen, "layers": {**frozen["layers"], ADAPTERS: adapters}}


def split(params: dict) -> tuple[dict, dict | None, jax.Array | None]:
    """(base without any LoRA entry, adapters or None, scale or None)."""
    if SCALE not in params:
        return params, None, None
    layers = {k: v for k, v in params["layers"].items() if k != ADAPTERS}
    base = {k: v for k, v in params.items() if k != SCALE}
    return {**base, "layers": layers}, params["layers"][ADAPTERS], params[SCALE]


def check_adapters(config: ModelConfig, adapters: dict) -> None:
    """Raises ValueError (one line) unless adapters fit the model: known targets, shapes
    [n_layers, in, r] / [n_layers, r, out] with one rank, the model's dtype."""
    shapes, dtype = _shapes(config), jnp.dtype(config.dtype)
    ranks = set()
    for name, ab in adapters.items():
        if name not in shapes or set(ab) != {"a", "b"}:
            raise ValueError(f"LoRA adapter {name!r} must be one of {sorted(shapes)} with "
                             f"'a' and 'b' weights")
        d_in, d_out = shapes[name]
        rank = ab["a"].shape[-1]
        ranks.add(rank)
        want = {"a": (config.n_layers, d_in, rank), "b": (config.n_layers, rank, d_out)}
        for part in ("a", "b"):
            if tuple(ab[part].shape) != want[part] or ab[part].dtype != dtype:
                raise ValueError(f"LoRA adapter {name}.{part} is {ab[part].dtype}"
                                 f"{list(ab[part].shape)}, the model needs {dtype}"
                                 f"{list(want[part])}")
    if len(ranks) > 1:
        raise ValueError(f"LoRA adapters must share one rank, got {sorted(ranks)}")


def linear(layer: dict, name: str, x, scale):
    """x [..., in] @ layer[name] [in, out], plus scale * (x A) B when `name` has an adapter;
    batch-invariant like `dense` (scale f32 [], or None without adapters)."""
    y = dense(x, layer[name])
    adapter = layer.get(ADAPTERS, {}).get(name)
    if adapter is None:
        return y
    u = dense(x, adapter["a"]) * scale.astype(x.dtype)
    return y + dense(u, adapter["b"])


@jax.jit
def merged(params: dict) -> dict:
    """The base tree with every adapter folded in (W + scale * A B): a plain model for
    export or inference elsewhere. Params without adapters come back as they are."""
    base, adapters, scale = split(params)
    if adapters is None:
        return params
    layers = dict(base["layers"])
    for name, ab in adapters.items():
        delta = jnp.einsum("lir,lro->lio", ab["a"].astype(jnp.float32),
                           ab["b"].astype(jnp.float32)) * scale
        layers[name] = (layers[name].astype(jnp.float32) + delta).astype(layers[name].dtype)
    return {**base, "layers": layers}


def adapter_bytes(adapters: dict) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(adapters))
