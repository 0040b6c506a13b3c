"""Model hyperparameters: everything that changes the math of the decoder."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

MLP_ACTS = ("silu", "gelu_tanh")

@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling. kind "linear": every frequency / factor. kind "llama3"
    (Llama 3.1+): low frequencies / factor, high ones kept, a smooth ramp between, set by
    low/high_freq_factor and original_max_position."""
    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        if self.kind not in ("linear", "llama3"):
            raise ValueError(f"rope_scaling kind must be 'linear' or 'llama3', got {self.kind!r}")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"rope_scaling high_freq_factor ({self.high_freq_factor}) must "
                             f"exceed low_freq_factor ({self.low_freq_factor})")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # decoupled from d_model / n_heads (Qwen3, Llama 3.2 1B's 64 both allowed)
    d_ff: int
    max_seq_len: int  # longest sequence the model is run on (prompt + output)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    qkv_bias: bool = False  # biases on q/k/v projections (Qwen2; Llama attention_bias)
    tie_embeddings: bool = True
    dtype: str = "float32"  # params and activations; norms, softmax and logits run in fp32
    out_bias: bool = False  # bias on the attention output projection (Llama attention_bias)
    qk_norm: bool = False  # per-head RMSNorm of q and k before rotary (Qwen3)
    rope_scaling: RopeScaling | None = None
    embed_scale: bool = False  # embeddings x sqrt(d_model), rounded to the params' dtype (Gemma)
    norm_plus_one: bool = False  # every RMSNorm scales by (1 + w) in fp32; w stored (Gemma)
    mlp_act: str = "silu"  # the gated MLP's gate: "silu" (SwiGLU), "gelu_tanh" (GeGLU, Gemma)
    family: str = "llama"  # its `models.families` entry: the checkpoint format and the code

    def __post_init__(self):
        if self.mlp_act not in MLP_ACTS:
            raise ValueError(f"mlp_act must be one of {MLP_ACTS}, got {self.mlp_act!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "d_ff", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    def inv_freq(self) -> np.ndarray:
        """Rotary inverse frequencies f32 [head_dim / 2], scaling applied (as transformers)."""
        inv = (1.0 / self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float32)
                                        / np.float32(self.head_dim))).astype(np.float32)
        s = self.rope_scaling
        if s is None:
            return inv
        if s.kind == "linear":
            return (inv / np.float32(s.factor)).astype(np.float32)
        low_wavelen = s.original_max_position / s.low_freq_factor
        high_wavelen = s.original_max_position / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = ((s.original_max_position / wavelen - s.low_freq_factor)
                  / (s.high_freq_factor - s.low_freq_factor))
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)

    @classmethod
    def tiny(cls, vocab_size: int = 32, **overrides) -> "ModelConfig":
        """A few-hundred-thousand-parameter model for CPU tests and the demo."""
        base = dict(vocab_size=vocab_size, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=16, d_ff=128, max_seq_len=256, qkv_bias=True)
        return cls(**{**base, **overrides})
