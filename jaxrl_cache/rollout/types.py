"""What the rollout engine is configured with and what it returns."""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_cache.checks import as_count
from jaxrl_cache.rollout.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    num_pages: int = 512  # physical KV pages, page 0 included (the null page)
    page_size: int = 16
    prefix_cache: bool = True  # False: no radix reuse and no group sharing (a baseline)

    def __post_init__(self):
        """Types and ranges only (numpy ints accepted); the engine checks the pool's bytes
        against the model and the device when it builds the pool."""
        object.__setattr__(self, "num_pages", as_count(self.num_pages, "num_pages", minimum=2,
                                                       maximum=2**31 - 1))  # int32 page ids
        object.__setattr__(self, "page_size", as_count(self.page_size, "page_size", minimum=1,
                                                       maximum=2**16))
        if not isinstance(self.prefix_cache, (bool, np.bool_)):
            raise TypeError(f"prefix_cache must be a bool, got "
                            f"{type(self.prefix_cache).__name__} {self.prefix_cache!r:.80}")
        object.__setattr__(self, "prefix_cache", bool(self.prefix_cache))


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching knobs (shapes: each value is one compiled size, never a recompile
    per call)."""
    max_num_seqs: int = 64  # decode slots: rows generated concurrently
    chunk_steps: int = 16  # decode steps per on-device chunk between host scheduling
    max_prefill_tokens: int = 2048  # new prompt tokens admitted per prefill launch (soft)

    def __post_init__(self):
        for name in ("max_num_seqs", "chunk_steps", "max_prefill_tokens"):
            object.__setattr__(self, name, as_count(getattr(self, name), name, minimum=1,
                                                    maximum=2**31 - 1))


@dataclasses.dataclass(frozen=True)
class Sample:
    prompt_ids: tuple
    output_ids: tuple
    output_logprobs: np.ndarray  # f32 [len(output_ids)] behavior logprobs (see sampling.py)
    behavior_version: int
    token_versions: np.ndarray  # int64 [len(output_ids)] version that produced each token
    cached_tokens: int  # prompt tokens whose KV came from the radix cache
    finish_reason: str  # "stop" (a stop token or a stop string, its completing token
    #                     included) or "length"
    group: int  # index of the prompt in the rollout call
    # Asynchronous mode (engine kv_policy "recompute"/"keep"): weights may change between
    # decode chunks while the sample runs. behavior_version is then the version of its first
    # token and token_versions[t] the version whose params sampled token t.
    kv_versions: tuple = ()  # sorted versions that wrote KV this sample attended to
    #                          (() = only behavior_version: the synchronous case)
    mixed_tokens: np.ndarray | None = None  # bool [len(output_ids)]: token t attended KV
    #   written by a version other than token_versions[t] (kv_policy="keep" only); None = none
    text: str | None = None  # decoded output_ids (engine with a tokenizer), cut at the stop
    #                          string that ended it (rollout/text.py); None without one

    @property
    def oldest_version(self) -> int:
        """The oldest version that sampled one of its tokens (staleness is measured from it)."""
        return int(self.token_versions.min()) if len(self.token_versions) else \
            self.behavior_version


@dataclasses.dataclass(frozen=True)
class WeightAck:
    version: int
    previous_version: int
    invalidated_pages: int
    seconds: float
    cached_versions: tuple  # versions with prefix entries after the sync (the lag window)
    dropped_versions: tuple = ()  # versions whose entries this sync dropped
    recomputed_tokens: int = 0  # context tokens the rollout in flight will re-prefill


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    samples: list
    version: int
    sampling: SamplingParams
    prefill_tokens: int  # prompt tokens whose KV was computed
    reused_tokens: int  # prompt tokens not recomputed (radix hits + group sharing)
    cached_tokens: int  # prompt tokens served by the radix cache
    decode_steps: int  # on-device decode steps over all chunks
    decode_chunks: int
    prefill_launches: int
    seconds: float
    sync_ack: WeightAck | None = None  # this call committed a newer version (async: None if
    # a sync during the call committed it or a later one first)
    recomputed_tokens: int = 0  # context tokens re-prefilled after in-flight weight updates
    weight_updates: int = 0  # syncs that landed while this call ran (asynchronous mode)

    @property
    def generated_tokens(self) -> int:
        return sum(len(s.output_ids) for s in self.samples)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s.prompt_ids) for s in self.samples)
