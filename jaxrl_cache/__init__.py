"""jaxrl_cache: attributable RL post-training of language models in JAX.

Every sample carries the policy version that produced it; prefix KV is cached per version
and never reused across versions. README.md describes the protocol; docs/DESIGN.md the
layout of the code and the invariants (each with its test).
"""
from jaxrl_cache.cache import CacheStats, PackedTokens, RadixCache
from jaxrl_cache.errors import CacheFullError, PinnedPagesError, StalenessError, VersionError
from jaxrl_cache.interrupts import deferred_signals
from jaxrl_cache.models import (DecoderLM, ModelConfig, forward, from_pretrained, init_params,
                                load_tokenizer, save_pretrained)
from jaxrl_cache.rl.audit import AuditReport, audit_attribution
from jaxrl_cache.rl.checkpoint import (CheckpointError, latest_checkpoint_version,
                                       restore_checkpoint, save_checkpoint)
from jaxrl_cache.rl.loop import AsyncRollouts, PolicyHistory, SyncRollouts, grpo_step
from jaxrl_cache.rl.batch import TrainBatch, make_batch
from jaxrl_cache.rl.train import TrainState, make_optimizer, train_step
from jaxrl_cache.rl.train_config import TrainConfig
from jaxrl_cache.rollout import (CacheConfig, Produced, RolloutBatch, RolloutEngine,
                                 RolloutWorker, Sample, SampleBuffer, SamplingParams,
                                 SchedulerConfig, WeightAck)

__all__ = [
    "AuditReport", "audit_attribution", "CheckpointError", "latest_checkpoint_version",
    "restore_checkpoint", "save_checkpoint", "deferred_signals", "CacheConfig",
    "RolloutBatch", "RolloutEngine", "Sample", "SchedulerConfig", "WeightAck",
    "CacheFullError", "PinnedPagesError", "StalenessError", "VersionError", "DecoderLM",
    "ModelConfig", "forward", "from_pretrained", "init_params", "load_tokenizer",
    "save_pretrained", "CacheStats", "PackedTokens", "RadixCache", "SamplingParams", "TrainBatch",
    "TrainState", "make_batch", "make_optimizer", "train_step", "Produced", "RolloutWorker",
    "SampleBuffer", "TrainConfig", "AsyncRollouts", "PolicyHistory", "SyncRollouts",
    "grpo_step",
]
