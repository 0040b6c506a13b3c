"""What the rollout engine is configured with and what it returns."""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_cache.checks import as_bool, as_count
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
        object.__setattr__(self, "prefix_cache", as_bool(self.prefix_cache, "prefix_cache"))


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
    loss_mask: np.ndarray | None = None  # bool [len(output_ids)]: tokens the policy sampled
    #   (an episode's view: observation tokens are False, never trained on nor audited);
    #   None = every output token was sampled (a single-turn sample)

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
    copied_bytes: int = 0  # bytes of weights this sync copied (0: none, or borrowed in place)
    lent_bytes: int = 0  # bytes held as the caller's own arrays (sync_weights(borrow=True))
    copied_leaves: tuple = ()  # borrow: leaves copied because they could not be lent (host
    #                            arrays, another placement), by path; () otherwise
    transposed_bytes: int = 0  # bytes of the [out, in] copies written for decoding
    #                            (models.llama.sampler_layout; single-device, no LoRA)


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


FINISH_REASONS = ("done", "max_turns", "token_budget", "error")


@dataclasses.dataclass(frozen=True)
class Episode:
    """One multi-turn episode (rollout/episodes.py): the first observation, then every
    assistant turn and environment observation in order.

    Per token of `token_ids` (everything after the first observation): loss_mask True where
    the policy sampled it; logprobs its behavior log-prob (0 on observation tokens);
    token_versions the version that sampled it (an observation token carries the version of
    the last token sampled before it, so every entry is a real version); mixed_tokens as
    Sample.mixed_tokens. turns[k] = (start, end): turn k's sampled tokens are
    token_ids[start:end]; observation k follows it.
    """
    index: int  # position in the call's output (task order, then episode order)
    group: int  # index of its task in the call (a GRPO group: episodes of one task)
    prompt_ids: tuple  # the first observation
    token_ids: tuple
    loss_mask: np.ndarray  # bool [T]
    logprobs: np.ndarray  # f32 [T]
    token_versions: np.ndarray  # int64 [T]
    turns: tuple  # ((start, end), ...) one per assistant turn
    turn_texts: tuple  # decoded text of each turn (what the environment was given)
    rewards: tuple  # float per environment step
    finish_reason: str  # one of FINISH_REASONS
    cached_tokens: int  # context tokens of its turns served by the radix cache
    kv_versions: tuple = ()  # sorted versions that wrote KV its tokens attended to
    mixed_tokens: np.ndarray | None = None  # bool [T] (kv_policy "keep"); None = none
    error: str | None = None  # the environment's exception, when finish_reason == "error"

    @property
    def reward(self) -> float:
        """The episode's return: the sum of the environment's rewards."""
        return float(sum(self.rewards))

    @property
    def sampled_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask))

    def as_sample(self) -> Sample:
        """The episode as a Sample whose loss_mask marks the sampled tokens (what the batch
        builder and the audit consume)."""
        mask = np.asarray(self.loss_mask)
        well_formed = mask.dtype == np.bool_ and mask.shape == np.shape(self.token_versions)
        sampled = self.token_versions[mask] if well_formed else self.token_versions  # else
        # make_batch and the audit refuse the mask by name
        return Sample(
            prompt_ids=self.prompt_ids, output_ids=self.token_ids,
            output_logprobs=self.logprobs,
            behavior_version=int(sampled.min()) if sampled.size else
            int(self.token_versions.min(initial=0)),
            token_versions=self.token_versions, cached_tokens=self.cached_tokens,
            finish_reason=self.finish_reason, group=self.group, kv_versions=self.kv_versions,
            mixed_tokens=self.mixed_tokens, text="".join(self.turn_texts),
            loss_mask=self.loss_mask)


@dataclasses.dataclass(frozen=True)
class EpisodeBatch:
    """What `RolloutEngine.rollout_episodes` returns. `samples` (one per episode, with loss
    masks) is what `make_batch` and `audit_attribution` read, as for a RolloutBatch."""
    episodes: list
    version: int
    sampling: SamplingParams
    prefill_tokens: int  # context tokens whose KV was computed (all turns)
    cached_tokens: int  # context tokens served by the radix cache (all turns)
    history_tokens: int  # tokens of later turns' contexts that an earlier turn had seen
    history_cached: int  # ... of them served by the cache (not recomputed)
    decode_steps: int
    decode_chunks: int
    prefill_launches: int
    env_steps: int
    env_seconds: float  # summed time inside environment calls (on the worker threads)
    seconds: float
    sync_ack: WeightAck | None = None
    recomputed_tokens: int = 0  # context tokens re-prefilled after in-flight weight updates
    weight_updates: int = 0

    @property
    def samples(self) -> list:
        return [e.as_sample() for e in self.episodes]

    @property
    def generated_tokens(self) -> int:
        return sum(e.sampled_tokens for e in self.episodes)

    @property
    def prompt_tokens(self) -> int:
        """Context tokens of every turn (what a RolloutBatch's prompts are to its samples)."""
        return sum(len(e.prompt_ids) * len(e.turns) + sum(lo for lo, _ in e.turns)
                   for e in self.episodes)

    @property
    def reused_tokens(self) -> int:
        return self.cached_tokens
