"""Generation: sampling, the jitted prefill/decode core, and the engine around them."""
from jaxrl_cache.rollout.engine import RolloutEngine
from jaxrl_cache.rollout.sampling import SamplingParams
from jaxrl_cache.rollout.types import (CacheConfig, RolloutBatch, Sample, SchedulerConfig,
                                       WeightAck)
from jaxrl_cache.rollout.worker import Produced, RolloutWorker, SampleBuffer

__all__ = ["RolloutEngine", "SamplingParams", "CacheConfig", "RolloutBatch", "Sample",
           "SchedulerConfig", "WeightAck", "Produced", "RolloutWorker", "SampleBuffer"]
