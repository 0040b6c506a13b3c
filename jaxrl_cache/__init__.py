"""jaxrl_cache: attributable RL post-training of language models in JAX.

Every sample carries the policy version that produced it; prefix KV is cached per version
and never reused across versions. docs/attribution.md describes the protocol; docs/DESIGN.md the
layout of the code and the invariants (each with its test).
"""
# Names resolve on first use (PEP 562): importing a submodule (the CLI's parser: a fast
# --help) does not import jax.
_EXPORTS = {
    "CacheStats": "jaxrl_cache.cache", "PackedTokens": "jaxrl_cache.cache",
    "RadixCache": "jaxrl_cache.cache", "CacheFullError": "jaxrl_cache.errors",
    "PinnedPagesError": "jaxrl_cache.errors", "StalenessError": "jaxrl_cache.errors",
    "VersionError": "jaxrl_cache.errors", "deferred_signals": "jaxrl_cache.interrupts",
    "DecoderLM": "jaxrl_cache.models", "ModelConfig": "jaxrl_cache.models",
    "forward": "jaxrl_cache.models", "from_pretrained": "jaxrl_cache.models",
    "init_params": "jaxrl_cache.models", "load_tokenizer": "jaxrl_cache.models",
    "save_pretrained": "jaxrl_cache.models", "LoraConfig": "jaxrl_cache.models",
    "save_peft_adapter": "jaxrl_cache.models", "AuditReport": "jaxrl_cache.rl.audit",
    "audit_attribution": "jaxrl_cache.rl.audit",
    "CheckpointError": "jaxrl_cache.rl.checkpoint",
    "latest_checkpoint_version": "jaxrl_cache.rl.checkpoint",
    "restore_checkpoint": "jaxrl_cache.rl.checkpoint",
    "save_checkpoint": "jaxrl_cache.rl.checkpoint", "AsyncRollouts": "jaxrl_cache.rl.loop",
    "PolicyHistory": "jaxrl_cache.rl.loop", "SyncRollouts": "jaxrl_cache.rl.loop",
    "grpo_step": "jaxrl_cache.rl.loop", "TrainBatch": "jaxrl_cache.rl.batch",
    "make_batch": "jaxrl_cache.rl.batch", "TrainState": "jaxrl_cache.rl.train",
    "make_optimizer": "jaxrl_cache.rl.train", "train_step": "jaxrl_cache.rl.train",
    "TrainConfig": "jaxrl_cache.rl.train_config", "CacheConfig": "jaxrl_cache.rollout",
    "Produced": "jaxrl_cache.rollout", "RolloutBatch": "jaxrl_cache.rollout",
    "RolloutEngine": "jaxrl_cache.rollout", "RolloutWorker": "jaxrl_cache.rollout",
    "Sample": "jaxrl_cache.rollout", "SampleBuffer": "jaxrl_cache.rollout",
    "SamplingParams": "jaxrl_cache.rollout", "SchedulerConfig": "jaxrl_cache.rollout",
    "WeightAck": "jaxrl_cache.rollout",
    # rewards, answers, data in, evaluation, metrics (the TRL-style surface)
    "RewardError": "jaxrl_cache.errors", "RewardFn": "jaxrl_cache.rl.rewards",
    "Rewards": "jaxrl_cache.rl.rewards", "batched": "jaxrl_cache.rl.rewards",
    "load_reward": "jaxrl_cache.rl.rewards", "answer_reward": "jaxrl_cache.rl.answers",
    "answer_score": "jaxrl_cache.rl.answers", "Example": "jaxrl_cache.data",
    "prompts_from_rows": "jaxrl_cache.data", "read_rows": "jaxrl_cache.data",
    "evaluate": "jaxrl_cache.rl.evaluate", "MetricsSink": "jaxrl_cache.rl.sinks",
    "make_sinks": "jaxrl_cache.rl.sinks", "SpreadWatch": "jaxrl_cache.rl.health",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """A public name from its module, or a subpackage (`jaxrl_cache.rl`), on first use."""
    import importlib
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(__all__))
