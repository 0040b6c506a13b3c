"""TrainConfig: everything `train_step` does with a batch, checked once, and the names of
its choices (TRL's loss types, the remat policies, the compute dtypes, the off-policy
corrections)."""
from __future__ import annotations

import dataclasses

from jaxrl_cache.checks import as_bool, as_count, as_real
from jaxrl_cache.versioning import MAX_VERSION

CORRECTIONS = ("none", "decoupled")
LOSS_TYPES = ("dapo", "grpo", "dr_grpo")  # TRL's names (see TrainConfig.loss_type)
IS_LEVELS = ("token", "sequence")  # TRL's importance_sampling_level
COMPUTE_DTYPES = ("float32", "bfloat16")
REMATS = ("auto", "full", "dots", "none")
MAX_LENGTH = 2**20  # tokens per sample


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything `train_step` does with a batch; checked once, here.

    loss_type (TRL's names): "dapo" token mean over the mini-batch; "grpo" mean over
    sequences of each sequence's token mean; "dr_grpo" token sum / (sequences x
    max_new_tokens), Dr. GRPO's constant normaliser. kl_beta > 0 adds beta x k3 KL to the
    reference params (`train_step(ref_params=...)`) per sampled token.

    TRL's knobs (same names, same formulas; docs/api.md): the ratio is clipped to
    [1 - clip_eps, 1 + epsilon_high] (clip-higher; None: clip_eps); importance_sampling_level
    "sequence" (GSPO) replaces each token's log-ratio by its sample's mean log-ratio over
    its trained tokens; entropy_coef > 0 subtracts coef x the mean entropy of the sampling
    distribution over the mini-batch's trained tokens (with its gradient);
    mask_truncated_completions gives samples cut by the token limit (finish_reason "length"
    or "token_budget") no loss weight (they are still audited, and still count in "grpo"'s
    and "dr_grpo"'s number of sequences, as in TRL).
    """
    clip_eps: float = 0.2
    epsilon_high: float | None = None  # upper clip range; None: clip_eps (symmetric)
    dual_clip: float | None = None  # > 1: bounds the ratio's pull on negative advantages
    correction: str = "none"  # or "decoupled" (see module doc)
    is_cap: float = 2.0  # decoupled importance weights truncated at is_cap (>= 1)
    max_policy_lag: int | None = None  # oldest token version a sample may have, behind
    loss_type: str = "dapo"
    kl_beta: float = 0.0
    importance_sampling_level: str = "token"  # or "sequence" (GSPO)
    entropy_coef: float = 0.0  # loss -= entropy_coef x mean entropy of the trained tokens
    mask_truncated_completions: bool = False
    mini_batches: int = 1  # updates per pass: the batch split into this many parts
    epochs: int = 1  # passes over the batch
    token_budget: int = 4096  # tokens per micro-batch (packed rows x row length)
    remat: str = "auto"  # layer-scan rematerialisation: "full", "dots", "none", or "auto"
    #                      (rl.memory.resolve_remat: "dots" when it fits in memory)
    compute_dtype: str = "float32"  # "bfloat16": bf16 compute, fp32 params and optimizer
    logprob_chunk: int = 128  # positions per LM-head chunk (rl/logprobs.LOGPROB_CHUNK)
    donate: bool | str = False  # True: reuse the input state's buffers (the caller's state
    #                             is consumed); "optimizer": only its optimizer state's (the
    #                             params stay readable: an async engine and audit read them)

    def __post_init__(self):
        norm = dict(clip_eps=as_real(self.clip_eps, "clip_eps", minimum=0.0, open_min=True),
                    is_cap=as_real(self.is_cap, "is_cap", minimum=1.0),
                    kl_beta=as_real(self.kl_beta, "kl_beta", minimum=0.0),
                    entropy_coef=as_real(self.entropy_coef, "entropy_coef", minimum=0.0),
                    mini_batches=as_count(self.mini_batches, "mini_batches", minimum=1,
                                          maximum=4096),
                    epochs=as_count(self.epochs, "epochs", minimum=1, maximum=4096),
                    token_budget=as_count(self.token_budget, "token_budget", minimum=2,
                                          maximum=MAX_LENGTH),
                    logprob_chunk=as_count(self.logprob_chunk, "logprob_chunk", minimum=1))
        if self.dual_clip is not None:
            norm["dual_clip"] = as_real(self.dual_clip, "dual_clip", minimum=1.0,
                                        open_min=True)
        if self.epsilon_high is not None:
            norm["epsilon_high"] = as_real(self.epsilon_high, "epsilon_high", minimum=0.0)
        if self.max_policy_lag is not None:
            norm["max_policy_lag"] = as_count(self.max_policy_lag, "max_policy_lag",
                                              maximum=MAX_VERSION)
        for name, allowed in (("correction", CORRECTIONS), ("loss_type", LOSS_TYPES),
                              ("remat", REMATS), ("compute_dtype", COMPUTE_DTYPES),
                              ("importance_sampling_level", IS_LEVELS)):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__} "
                                f"{value!r:.80}")
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r:.80}")
        if isinstance(self.donate, str) and self.donate != "optimizer":
            raise TypeError(f"donate must be a bool or 'optimizer', got {self.donate!r:.80}")
        if self.donate != "optimizer":
            norm["donate"] = as_bool(self.donate, "donate")
        norm["mask_truncated_completions"] = as_bool(self.mask_truncated_completions,
                                                     "mask_truncated_completions")
        for name, value in norm.items():
            object.__setattr__(self, name, value)

    @property
    def clip_high(self) -> float:
        """The ratio's upper clip range (epsilon_high, else clip_eps)."""
        return self.clip_eps if self.epsilon_high is None else self.epsilon_high

    @property
    def updates(self) -> int:
        return self.mini_batches * self.epochs
