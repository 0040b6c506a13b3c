"""The GRPO loop as library functions: a training script is a prompt source, a reward and
a loop over `grpo_step`.

One step: rollout calls (synchronous: at the trainer's version; asynchronous: drawn from a
RolloutWorker's buffer) -> decode -> reward of every sample -> `train_step` (micro-batches,
one or more updates), which audits every token before applying anything: older versions'
tokens scored with their own params on its packed micro-batches, its own version's in its
first update's forward, for free (with one mini-batch in fp32 compute; otherwise a
separate teacher-forced pass audits every token first, the first `audit_samples` of each
call) -> sync/publish of the new params -> one metrics record, read from the device once,
with the seconds of each phase (audit_seconds: the separate pass only).

Policy history: the params of every version a pending call may still hold tokens of (within
the lag window) are kept for the audit; the step lets go of older ones before its update.
Donating the trainer's params (`TrainConfig.donate=True`) is refused when the window keeps
old versions alive; the optimizer state alone may be (`donate="optimizer"`).

Multi-turn: a call may be an EpisodeBatch (`RolloutEngine.rollout_episodes`); its episodes
are rewarded (by default with their environment's return), audited on their sampled tokens
and trained on those only (`make_batch`), and the record gains episode counters.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable, Protocol

import jax
import numpy as np

from jaxrl_cache.rl.audit import (EXACT_EVIDENCE_TOKENS, AuditGate, audit_step_calls,
                                  name_misattributed, sample_mismatches, step_checks)
from jaxrl_cache.errors import AuditError
from jaxrl_cache.rl.batch import group_advantages, make_batch
from jaxrl_cache.rl.health import step_health
from jaxrl_cache.rl.memory import trim_host_memory
from jaxrl_cache.rl.rewards import Rewards
from jaxrl_cache.rl.train import AttributionFailure, TrainState, train_step
from jaxrl_cache.rl.train_config import TrainConfig
from jaxrl_cache.rollout.types import EpisodeBatch, RolloutBatch, WeightAck
from jaxrl_cache.rollout.worker import RolloutWorker, SampleBuffer


class Rollouts(Protocol):
    """Where a step's rollout calls come from, and where new params go."""

    def get(self, step: int, state: TrainState) -> list[tuple[object,
                                                              RolloutBatch | EpisodeBatch]]:
        """[(meta, batch)] of this step's calls (meta: what the prompt source returned)."""

    def publish(self, state: TrainState) -> WeightAck: ...

    def oldest_pending(self, trainer_version: int) -> int:
        """The oldest version whose tokens a call not yet handed out by `get` may hold (the
        policy history keeps no older params)."""

    def close(self) -> dict: ...

    gate: AuditGate  # the run's audit gate (AuditGate.for_engine); grpo_step replaces it


class SyncRollouts:
    """Each step: `calls` rollout calls at the trainer's version, then train, then sync;
    the sync lends the trainer's params to the engine (no copy) and the engine releases them
    after its calls, before the update may donate them.
    prompt_source(call) -> (prompts, meta) for the call-th call of the run; call c of step s
    is s * calls + c and draws with key fold_in(key, c) (a resumed run replays nothing).
    episodes: keyword arguments of engine.rollout_episodes (env_factory, max_turns, ...):
    the prompts are then tasks and each call an episode call."""

    def __init__(self, engine, prompt_source: Callable, sampling, *, calls: int, key,
                 episodes: dict | None = None,
                 exact_after: int | None = EXACT_EVIDENCE_TOKENS):
        self.engine, self.prompt_source, self.sampling = engine, prompt_source, sampling
        self.calls, self.key, self.episodes = calls, key, episodes
        self.gate = AuditGate.for_engine(engine, exact_after)

    def get(self, step: int, state: TrainState):
        out = []
        for c in range(step * self.calls, (step + 1) * self.calls):
            prompts, meta = self.prompt_source(c)
            args = (state.model_params, int(state.version), prompts)
            rng = jax.random.fold_in(self.key, c)
            out.append((meta, self.engine.rollout(*args, self.sampling, rng=rng)
                        if self.episodes is None else
                        self.engine.rollout_episodes(*args, sampling=self.sampling, rng=rng,
                                                     **self.episodes)))
        # the trainer holds the only copy of the params while it updates, and no KV pool
        # (the next call runs at a newer version: it could reuse none of the cached KV)
        self.engine.release_weights(drop_kv=True)
        trim_host_memory()  # nor the rollout's freed memory
        return out

    def publish(self, state: TrainState) -> WeightAck:
        """Borrows the new params (no copy): `get` releases them before the next update."""
        return self.engine.sync_weights(state.model_params, state.version, borrow=True)

    def oldest_pending(self, trainer_version: int) -> int:
        return trainer_version  # every call runs at the trainer's version

    def close(self) -> dict:
        return {}


class AsyncRollouts:
    """A RolloutWorker generates the next calls while the trainer trains; weight updates
    land between decode chunks (engine kv_policy); calls beyond the lag are dropped. The
    worker starts at call `first_call` (a resumed run continues the sequence of calls).
    episodes: as SyncRollouts'. borrow: the engine decodes with the trainer's params
    themselves, no copy (RolloutWorker's borrow): for a trainer that does not donate its
    params (TrainConfig.donate False or "optimizer")."""

    def __init__(self, engine, prompt_source: Callable, sampling, *, calls: int,
                 max_policy_lag: int, key, state: TrainState, first_call: int = 0,
                 stop_timeout: float = 120.0, episodes: dict | None = None,
                 exact_after: int | None = EXACT_EVIDENCE_TOKENS, borrow: bool = False):
        self.calls, self.stop_timeout = calls, stop_timeout
        self.gate = AuditGate.for_engine(engine, exact_after)
        self.buffer = SampleBuffer(calls, max_policy_lag)
        self.worker = RolloutWorker(engine, prompt_source, sampling, self.buffer, rng=key,
                                    episodes=episodes, borrow=borrow)
        self.worker.start(state.model_params, state.version, first_call=first_call)

    def get(self, step: int, state: TrainState):
        items = self.buffer.get(self.calls, int(state.version))
        trim_host_memory()  # what the last call freed, before the update's peak
        return [(item.meta, item.batch) for item in items]

    def publish(self, state: TrainState) -> WeightAck:
        return self.worker.publish(state.model_params, state.version)

    def oldest_pending(self, trainer_version: int) -> int:
        """The call in flight's start version, the worker's next one, the buffered calls'
        oldest tokens (read in that order: a call moving from the first to the last between
        the reads is seen at least once)."""
        return self.buffer.oldest_version(self.worker.oldest_version())

    def close(self) -> dict:
        """Stops the worker; a call still in flight after stop_timeout is left to its daemon
        thread (one line says so), so that the caller's final save still runs."""
        try:
            self.worker.stop(timeout=self.stop_timeout)
        except TimeoutError as e:
            print(f"{e}; leaving it to exit with the process", file=sys.stderr)
        self.buffer.drain()  # generated ahead for steps that will not run
        return self.buffer.metrics()


class PolicyHistory:
    """Params by version for the audit: the newest version and the `lag` before it, less
    those no call can still hold tokens of (`keep_from`)."""

    def __init__(self, lag: int):
        self.lag, self.params = lag, {}

    def keep_from(self, version: int) -> None:
        """Lets go of the params of versions older than `version`."""
        for old in [v for v in self.params if v < version]:
            del self.params[old]

    def seed(self, version: int, params) -> None:
        """Holds `params` under `version` unless it holds that version already."""
        if version not in self.params:
            self.add(version, params)

    def add(self, version: int, params) -> None:
        self.params[version] = params
        for old in [v for v in self.params if v < version - self.lag]:
            del self.params[old]


@dataclasses.dataclass(frozen=True)
class StepResult:
    """A step's new state and what it trained on; the per-sample fields are in batch order
    (that of `texts`), one entry per sample (rl/completions.py writes them as rows)."""
    state: TrainState
    record: dict  # host numbers: the metrics row of the step
    texts: list  # [(meta, sample, text)] of every sample (an Episode for an episode call,
    #              text its turns' texts joined), in batch order
    ack: WeightAck
    calls: tuple = ()  # int: the sample's rollout call (its index among the step's calls)
    rewards: tuple = ()  # float: the sample's reward (its functions' weighted sum)
    reward_values: dict | None = None  # {function name: (float | None, ...)} (Scores.values);
    #                                    None: episode returns (reward=None)
    advantages: tuple = ()  # float: the advantage the update used
    mismatch: tuple = ()  # float | None: rl.audit.sample_mismatches


def _items(meta, batch, decode: Callable) -> list[tuple]:
    """[(meta, sample, text)] of a call: its samples, or its Episodes with their turns' text."""
    if isinstance(batch, EpisodeBatch):
        return [(meta, e, "".join(e.turn_texts)) for e in batch.episodes]
    return [(meta, s, s.text if s.text is not None else decode(s.output_ids))
            for s in batch.samples]


def _episode_counters(batches: list) -> dict:
    """Record fields of a step with episode calls: counts over their episodes."""
    episodes = [e for b in batches if isinstance(b, EpisodeBatch) for e in b.episodes]
    return dict(episodes=len(episodes),
                turns_mean=float(np.mean([len(e.turns) for e in episodes])),
                env_errors=sum(e.finish_reason == "error" for e in episodes),
                env_steps=sum(b.env_steps for b in batches if isinstance(b, EpisodeBatch)),
                env_seconds=sum(b.env_seconds for b in batches if isinstance(b, EpisodeBatch)))


def grpo_step(step: int, state: TrainState, rollouts: Rollouts, reward, *,
              decode: Callable, history: PolicyHistory, train: TrainConfig = TrainConfig(),
              advantages: Callable = group_advantages, audit_samples: int | None = None,
              ref_params=None, max_policy_lag: int | None = None, mesh=None) -> StepResult:
    """One GRPO step (see the module doc). reward: what `rl.rewards.Rewards.of` takes (a
    plain callable reward(meta, sample, text) -> float, for an episode call reward(meta,
    episode, its turns' text joined); RewardFns, per sample or batched, weighted; a
    Rewards); they score every sample before any audit or training (a failing one is a
    one-line RewardError and nothing changes) and the record gains each one's mean and std
    by name. None: every call must be an EpisodeBatch and each episode's return
    (Episode.reward) is its reward.
    decode(token ids) -> str (used when a sample has no text of its own); history: params by
    version for the audit (the state's version is added when missing; the new version's
    params are added; those no pending call can hold are let go). audit_samples: the first
    k samples of each call in the separate audit (None: all), run only where the train step
    cannot check (`rl.audit.step_checks`). max_policy_lag: train_step's staleness bound
    (None: history.lag); mesh: train_step's mesh. Raises what train_step raises, and RuntimeError
    naming the samples if an audit flags one (a misattributed sample is never trained on:
    the step then applies no update); train_step's AttributionFailure passes through only
    if the separate audit then flags no sample."""
    if train.donate is True and history.lag > 0:
        raise ValueError("TrainConfig.donate with a policy lag > 0: the audit needs the "
                         "params of older versions, which donation would delete")
    scorer = None if reward is None else Rewards.of(reward)  # checked before any rollout
    gate, version = _gate_of(rollouts), int(state.version)
    history.seed(version, state.model_params)
    t0 = time.perf_counter()
    parts, untrainable = _trainable(step, rollouts.get(step, state))
    t1 = time.perf_counter()
    if reward is None and not all(isinstance(b, EpisodeBatch) for _, b in parts):
        raise ValueError("reward=None needs episode calls (EpisodeBatch) only: a single-turn "
                         "call has no reward of its own")
    items = [(c, item) for c, (meta, batch) in enumerate(parts)
             for item in _items(meta, batch, decode)]
    texts = [item for _, item in items]
    scores = None if scorer is None else scorer.score(step, texts, decode)
    rewards = [float(s.reward) for _, s, _ in texts] if scores is None else scores.totals
    t2 = time.perf_counter()
    batches = [b for _, b in parts]
    in_step, older, tolerance, sampler_config = _audit_plan(train, batches, version, history,
                                                            gate, state.config)
    try:
        counts = audit_step_calls(step, batches, history.params, sampler_config,
                                  in_step=in_step, tolerance=tolerance,
                                  audit_samples=audit_samples)
        t3 = time.perf_counter()
        batch = make_batch(batches, rewards, advantages=advantages)
        history.keep_from(rollouts.oldest_pending(version))  # `older` holds this step's
        try:
            new_state, metrics = train_step(
                state, batch, train, ref_params=ref_params, mesh=mesh,
                max_policy_lag=history.lag if max_policy_lag is None else max_policy_lag,
                audit_tolerance=tolerance if in_step else None, audit_params=older)
        except AttributionFailure as e:  # nothing was applied: name the samples, as the audit does
            _name_refused(step, batches, history, e.state, older, in_step - {version},
                          sampler_config, tolerance)
            raise
    except (AuditError, AttributionFailure) as e:
        rollouts.gate = gate.after_failure(e)
        raise
    metrics = jax.device_get({k: v for k, v in metrics.items() if k != "per_update"})
    checked = counts.checked_tokens + (int(metrics["audit_checked_tokens"]) if in_step else 0)
    worst = max(counts.max_abs_diff, float(metrics["logprob_mismatch_max"]) if in_step else 0.0)
    rollouts.gate = gate = gate.after_step(worst, checked)
    t4 = time.perf_counter()
    ack = rollouts.publish(new_state)
    t5 = time.perf_counter()
    history.add(int(new_state.version), new_state.model_params)
    record = _record(step, version, ack, rewards, batches, metrics, counts, checked, tolerance)
    record.update(gate.record())  # audit_floor, audit_exact_tokens
    record.update(step_health(batches, rewards))  # reward spread, lengths, truncation
    record.update(rollout_seconds=t1 - t0, reward_seconds=t2 - t1, audit_seconds=t3 - t2,
                  train_seconds=t4 - t3, publish_seconds=t5 - t4, step_seconds=t5 - t0)
    if scores is not None:
        record.update(scores.metrics)  # rewards/<name>/mean|std, reward_unscored
    if any(isinstance(b, EpisodeBatch) for b in batches):
        record.update(_episode_counters(batches), episodes_untrainable=untrainable)
    mismatch = sample_mismatches(batches, counts, in_step=in_step,
                                 step_max=float(metrics["logprob_mismatch_max"]))
    return _result(new_state, record, items, ack, rewards, batch, scores, mismatch)


def _result(state, record, items, ack, rewards, batch, scores, mismatch) -> StepResult:
    """The StepResult of a step: items [(call, (meta, sample, text))] in batch order."""
    return StepResult(state, record, [item for _, item in items], ack,
                      calls=tuple(c for c, _ in items), rewards=tuple(rewards),
                      advantages=tuple(batch.advantages.tolist()),
                      reward_values=None if scores is None else
                      {name: tuple(v) for name, v in scores.values.items()},
                      mismatch=tuple(mismatch))


def _audit_plan(train: TrainConfig, batches: list, version: int, history: PolicyHistory,
                gate: AuditGate, config) -> tuple:
    """(versions the train step checks, {older version: params} it scores, the tolerance,
    the sampler's model config: the trainer's in the engine's dtype, which the separate
    pass computes in)."""
    in_step, older = step_checks(train, batches, version, history.params, gate.sampler_dtype)
    return (in_step, older, gate.step_tolerance,
            dataclasses.replace(config, dtype=gate.sampler_dtype))


def _name_refused(step: int, batches: list, history: PolicyHistory, state: TrainState,
                  older: dict, scored: frozenset, config, tolerance: float) -> None:
    """After the train step refused its update: its samples named (`name_misattributed`).
    `state` is the unchanged one the refusal carries: the history holds its params again
    (a donating step deleted the arrays it held for that version, the same values).
    `older` still holds its params when their scoring refused; emptied, the versions the
    step `scored` passed (their params may be gone from the history) and are not checked."""
    history.params[int(state.version)] = state.model_params
    name_misattributed(step, batches, {**history.params, **older}, config, tolerance,
                       () if older else scored)


def _gate_of(rollouts) -> AuditGate:
    try:
        gate = rollouts.gate
    except AttributeError:
        gate = None
    if not isinstance(gate, AuditGate):
        raise TypeError(f"{type(rollouts).__name__}.gate must be an rl.audit.AuditGate (the "
                        f"run's audit gate: AuditGate.for_engine(engine)), got {gate!r:.80}")
    return gate


def _trainable(step: int, parts: list) -> tuple[list, int]:
    """(the calls without the episodes whose environment failed before a first turn, how
    many such episodes there were); RuntimeError when no call has a sample left."""
    untrainable = sum(not e.sampled_tokens for _, b in parts if isinstance(b, EpisodeBatch)
                      for e in b.episodes)
    if untrainable:  # counted only
        parts = [(meta, dataclasses.replace(b, episodes=[e for e in b.episodes
                                                         if e.sampled_tokens]))
                 if isinstance(b, EpisodeBatch) else (meta, b) for meta, b in parts]
        parts = [(meta, b) for meta, b in parts if b.samples]
        if not parts:
            raise RuntimeError(f"step {step}: no episode sampled a token (every environment "
                               f"failed before its first turn)")
    return parts, untrainable


def _record(step: int, version: int, ack: WeightAck, rewards: list, batches: list,
            metrics: dict, counts, checked: int, tolerance: float) -> dict:
    """The step's metrics row (host numbers; the caller adds the phase seconds and the
    health fields); every field is documented in docs/api.md ("Step metrics and sinks")."""
    context = sum(b.prompt_tokens for b in batches)
    return dict(
        step=step, version=version, next_version=ack.version,
        reward=float(np.mean(rewards)), samples=len(rewards),
        loss=float(metrics["loss"]), lr=float(metrics["lr"]),
        grad_norm=float(metrics["grad_norm"]), clip_fraction=float(metrics["clip_fraction"]),
        kl=float(metrics["kl"]), entropy=float(metrics["entropy"]),
        staleness_max=int(metrics["staleness_max"]),
        updates=int(metrics["updates"]),
        generated_tokens=sum(b.generated_tokens for b in batches),
        prompt_tokens=context,
        cached_tokens=sum(b.cached_tokens for b in batches),
        reused_tokens=sum(b.reused_tokens for b in batches),
        cache_hit_rate=sum(b.cached_tokens for b in batches) / max(context, 1),
        prefill_saved=sum(b.reused_tokens for b in batches) / max(context, 1),
        audited_samples=counts.samples, audit_checked_tokens=checked,
        audit_failed=counts.flagged, audit_tolerance=tolerance,
        logprob_mismatch_max=float(metrics["logprob_mismatch_max"]),
        logprob_mismatch_mean=float(metrics["logprob_mismatch_mean"]),
        logprob_mismatch_kl=float(metrics["logprob_mismatch_kl"]),
        mixed_tokens=counts.mixed_tokens,
        recomputed_tokens=sum(b.recomputed_tokens for b in batches),
        invalidated_pages=ack.invalidated_pages, sync_seconds=ack.seconds,
        sync_bytes=ack.copied_bytes, transposed_bytes=ack.transposed_bytes)
