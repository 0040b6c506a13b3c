"""jaxrl_cache: attributable RL post-training of language models in JAX.

Every sample carries the policy version that produced it; prefix KV is cached per version
and never reused across versions. README.md describes the protocol and the invariants;
docs/DESIGN.md the layout of the code.
"""
from jaxrl_cache.cache import CacheStats, RadixCache
from jaxrl_cache.errors import CacheFullError, PinnedPagesError, StalenessError, VersionError
from jaxrl_cache.models import DecoderLM, ModelConfig, forward, init_params
from jaxrl_cache.rl.audit import AuditReport, audit_attribution
from jaxrl_cache.rl.checkpoint import CheckpointError, restore_checkpoint, save_checkpoint
from jaxrl_cache.rl.train import TrainBatch, TrainState, make_batch, make_optimizer, train_step
from jaxrl_cache.rollout import (CacheConfig, RolloutBatch, RolloutEngine, Sample,
                                 SamplingParams, SchedulerConfig, WeightAck)

__all__ = [
    "AuditReport", "audit_attribution", "CheckpointError", "restore_checkpoint",
    "save_checkpoint", "CacheConfig", "RolloutBatch", "RolloutEngine", "Sample", "SchedulerConfig", "WeightAck",
    "CacheFullError", "PinnedPagesError", "StalenessError", "VersionError", "DecoderLM",
    "ModelConfig", "forward", "init_params", "CacheStats", "RadixCache", "SamplingParams",
    "TrainBatch", "TrainState", "make_batch", "make_optimizer", "train_step",
]
