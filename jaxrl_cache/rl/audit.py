"""Attribution audit: recompute each sampled token's behavior logprob teacher-forced with the
params of the version that claims to have sampled it (an episode's observation tokens are
context, never checked).

Every pass of it lives here:
- `step_audit_sums`: inside the train step, on the log-probs its first update computes
  anyway, for the tokens of the trainer's own version (the step's gate);
- the train step's scoring of older versions' tokens (async runs) with their own params,
  forward only on the step's packed micro-batches (`train_step(audit_params=...)`), when the
  step's own check runs;
- `audit_attribution`: a separate teacher-forced pass, wherever the step's forward does not
  reproduce the sampler (bf16 compute, several mini-batches), and to name flagged samples;
- `step_checks` / `audit_step_calls`: which tokens which check, for a GRPO step's calls;
- `AuditGate`: a run's gate (tolerance, measured floor, exact-token count, adoption of 0),
  a value the rollouts source holds and `grpo_step` replaces after each step.
"""
from __future__ import annotations

import dataclasses
from typing import Collection, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_cache.checks import as_real
from jaxrl_cache.errors import AuditError
from jaxrl_cache.rollout.types import EpisodeBatch, RolloutBatch
from jaxrl_cache.models import ModelConfig
from jaxrl_cache.rl.logprobs import next_token_log_probs
from jaxrl_cache.rl.batch import sample_loss_mask, sample_token_versions, token_flags
from jaxrl_cache.shapes import bucket
from kernels_pallas import invariant_kernels, is_power_of_2
from kernels_pallas.blocked import batch_invariant

AUDIT_TOLERANCE = 0.0  # exact numerics: a token whose bits differ is flagged
# Where the sampler does not compute the trainer's bits (a tensor-parallel engine on XLA's
# dots: XLA tiles a slice of a weight's columns unlike the whole weight; a GPU: XLA:GPU's
# dots and the compiled kernels change their bits with the row count,
# benchmarks/results/gpu-check-h200-*): the
# starting tolerance, ~10x the noise floor measured between the two on XLA:CPU (3-4e-5 on
# SmolLM2-135M fp32, 2026-12), blind to updates that move a log-prob less. A GRPO run
# raises it to CALIBRATION_MARGIN x the floor its first step measures (`calibrated`).
CALIBRATED_TOLERANCE = 5e-4
CALIBRATION_MARGIN = 10.0
# A run's first step has no stale KV to find (its engine has served only that version), so
# it gates at this ceiling while it measures the floor: a sampler/trainer disagreement above
# it is no rounding noise (a wrong temperature, a broken kernel) and refuses the update.
CALIBRATION_CEILING = 0.05


def exact_platform(engine) -> bool:
    """Whether `engine` computes on the platform whose dots keep the blocked order's bits
    whatever the row count: XLA:CPU. XLA:GPU's do not (the H200 check: 1023-1024 of 1024
    log-probs differ, max 4.5e-4)."""
    device = getattr(engine, "device", None)
    return getattr(device, "platform", "cpu") == "cpu"


def tolerance_for(engine) -> float:
    """The audit tolerance for samples of `engine`: AUDIT_TOLERANCE (0) when it computes
    the trainer's bits (CPU, the xla or interpret backend, a head size whose dots keep the
    blocked order: `kernels_pallas.blocked.batch_invariant`, true of every size once p @ v
    runs at `blocked.value_width`; on a tensor-parallel mesh only under the batch-invariant
    kernels, which tile each shard's columns as the whole weight), CALIBRATED_TOLERANCE
    otherwise (a GPU, the compiled pallas kernels, a mesh on XLA's dots, and a head size
    that is no power of two when the engine's attention and the trainer's run on different
    sides of the kernels setting: an interpret engine with the setting off, or an xla one
    with it on)."""
    backend, kernels = getattr(engine, "backend", "xla"), invariant_kernels()
    exact = exact_platform(engine) and backend in ("xla", "interpret")
    if exact and getattr(engine, "mesh", None) is not None:
        exact = kernels is not None
    config = getattr(engine, "model_config", None)
    if exact and config is not None:  # the dots keep the order at this head size (probe)
        exact = batch_invariant(config.head_dim, config.dtype)
        if (backend == "interpret") != (kernels is not None):
            # one side's attention runs the kernels, which split a head size that is no
            # power of two into power-of-two chunks (80 = 64 + 16), the other XLA's whole-D
            # dots (the trainer's attention follows the setting, the engine its backend)
            exact = exact and is_power_of_2(config.head_dim)
    return AUDIT_TOLERANCE if exact else CALIBRATED_TOLERANCE


# A calibrated run whose steps have reproduced every checked token bit for bit, at least
# this many of them and none off, adopts tolerance 0 for the rest of the run: its numerics
# are exact on this device in practice (a GPU with the batch-invariant kernels, if they hold
# there). An inexact sampler differs on most tokens (the H200 check: 1,023-1,024 of 1,024)
# and stale KV on nearly every one it fed, so one difference ends the count for good.
EXACT_EVIDENCE_TOKENS = 1024


def exact_evidence(evidence: int, worst: float, checked: int) -> int:
    """Tokens a calibrated run has seen reproduced bit for bit, after a step that checked
    `checked` more with largest |diff| `worst`; -1 once any token differed (then for good)."""
    if evidence < 0 or worst != 0.0:
        return -1
    return evidence + checked


def calibrated(floor: float) -> float:
    """The tolerance of a non-exact run whose first step measured `floor` (the largest
    |sampler - trainer| log-prob of tokens that cannot be stale): CALIBRATION_MARGIN x floor,
    at least CALIBRATED_TOLERANCE, at most CALIBRATION_CEILING."""
    return float(min(max(CALIBRATION_MARGIN * floor, CALIBRATED_TOLERANCE),
                     CALIBRATION_CEILING))


@dataclasses.dataclass(frozen=True)
class AuditGate:
    """A run's attribution gate, a value (grpo_step asks it and replaces it, never edits it).

    Invariants: tolerance 0 compares bits. An exact engine's gate (`exact_tokens` None)
    never changes. A calibrated one gates its first step at CALIBRATION_CEILING while it
    measures the floor (`step_tolerance`), then at `calibrated(floor)`; it counts the tokens
    reproduced bit for bit (-1 for good once one was not) and gates at 0 from `exact_after`
    of them on (None: never)."""
    tolerance: float = AUDIT_TOLERANCE
    floor: float | None = None  # the first step's measured sampler/trainer floor
    exact_tokens: int | None = None  # calibrated: tokens reproduced bit for bit so far
    exact_after: int | None = EXACT_EVIDENCE_TOKENS
    sampler_dtype: str = "float32"  # the engine's ModelConfig.dtype: the audit's compute

    def __post_init__(self):
        as_real(self.tolerance, "AuditGate.tolerance", minimum=0.0)

    @classmethod
    def start(cls, tolerance: float, exact_after: int | None = EXACT_EVIDENCE_TOKENS):
        """A run's gate before its first step: exact (0: no count) or calibrated."""
        return cls(tolerance, None, 0 if tolerance > 0 else None, exact_after)

    @classmethod
    def for_engine(cls, engine, exact_after: int | None = EXACT_EVIDENCE_TOKENS):
        config = getattr(engine, "model_config", None)
        return dataclasses.replace(cls.start(tolerance_for(engine), exact_after),
                                   sampler_dtype=getattr(config, "dtype", "float32"))

    @property
    def calibrating(self) -> bool:
        return self.tolerance > 0 and self.floor is None

    @property
    def step_tolerance(self) -> float:
        """The tolerance the next step gates at."""
        return CALIBRATION_CEILING if self.calibrating else self.tolerance

    @property
    def measured_exact(self) -> bool:
        """Whether a calibrated run gates at 0 by its own measurement."""
        return (self.exact_tokens is not None and self.exact_after is not None
                and self.exact_tokens >= self.exact_after)

    def after_step(self, worst: float, checked: int) -> AuditGate:
        """The gate after a step that checked `checked` tokens, largest |diff| `worst`."""
        if self.exact_tokens is None:
            return self
        floor, tolerance = (worst, calibrated(worst)) if self.calibrating else \
            (self.floor, self.tolerance)
        gate = dataclasses.replace(self, floor=floor, tolerance=tolerance,
                                   exact_tokens=exact_evidence(self.exact_tokens, worst,
                                                               checked))
        return dataclasses.replace(gate, tolerance=0.0) if gate.measured_exact else gate

    def after_failure(self, error: BaseException) -> AuditGate:
        """The gate after a step whose audit flagged samples: a run gating at 0 by
        measurement notes so on `error` (stale KV, or numerics not exact after all) and
        ends its count (the tolerance stays 0)."""
        if not self.measured_exact:
            return self
        error.add_note(f"The audit compares bits here because this run's earlier steps "
                       f"reproduced all {self.exact_tokens} tokens they checked bit for bit "
                       f"(a calibrated run gates at 0 from {self.exact_after} on; Sync/"
                       f"AsyncRollouts(exact_after=None) turns that off): these samples were "
                       f"produced with stale KV, or this device's numerics are not exact "
                       f"after all.")
        return dataclasses.replace(self, exact_tokens=-1)

    def record(self) -> dict:
        return dict(audit_floor=self.floor, audit_exact_tokens=self.exact_tokens)


AUDIT_MAXED = ("audit_diff_max",)  # step_audit_sums keys reduced by max over micro-batches


def step_audit_sums(logp, behavior, audited, versions, version) -> dict:
    """The in-step audit's sums over one micro-batch: of the tokens these very params
    sampled (audited bool [...] and versions == version), the largest |recomputed -
    recorded| log-prob (NaN counts as inf), their sum, the k3 estimate of KL(sampler ||
    trainer) summed, and their count. logp, behavior f32 [...]; versions int32 [...];
    version int32 []. Under exact numerics every difference is exactly 0."""
    check = audited & (versions == version)
    delta = jnp.where(check, logp - behavior, 0.0)
    gap = jnp.where(jnp.isnan(delta), jnp.inf, jnp.abs(delta))
    drift = jnp.where(check, jnp.exp(delta) - delta - 1.0, 0.0)
    return dict(audit_diff_max=gap.max(), audit_diff_sum=gap.sum(), audit_kl_sum=drift.sum(),
                audit_tokens=check.sum())


@dataclasses.dataclass(frozen=True)
class AuditReport:
    ok: bool
    max_abs_diff: float  # over checked tokens
    num_samples: int
    num_tokens: int  # sampled output tokens of the batch (Sample.loss_mask; observation
    #                  tokens excluded) = checked + mixed + those of missing versions
    #                  + those of `checked_elsewhere`
    flagged: tuple  # indices of samples with a checked token that does not match its version,
    #                 or a token whose version has no params
    missing_versions: tuple  # token versions (of tokens to check) with no params supplied
    tolerance: float  # 0: exact (any bit difference flags); > 0: calibrated, see `exact`
    num_checked_tokens: int  # tokens recomputed and compared
    num_mixed_tokens: int  # sampled tokens that attended KV of another version: reported,
    #                        not checked
    first_bad_token: tuple  # (sample, token index) of the first failing token per flagged sample
    mixed_tokens: tuple  # (sample, (token indices...)) for each sample with mixed tokens
    sample_diff_max: tuple = ()  # per sample: max |diff| over its checked tokens, None when
    #                              none was checked (all mixed, missing or checked elsewhere)

    @property
    def exact(self) -> bool:
        """True when the audit compared bits (tolerance 0): any stale KV that changed a
        log-prob at all is flagged. Otherwise a stale token whose log-prob moved less than
        the tolerance passes."""
        return self.tolerance == 0.0


def _rows(samples) -> np.ndarray:
    """Prompt + output of each sample, right-padded: int32 [bucket(N), bucket(longest)]."""
    longest = max(len(s.prompt_ids) + len(s.output_ids) for s in samples)
    tokens = np.zeros((bucket(len(samples), 64), bucket(longest, 64)), np.int32)
    for i, s in enumerate(samples):
        tokens[i, :len(s.prompt_ids) + len(s.output_ids)] = s.prompt_ids + s.output_ids
    return tokens


def _mixed(sample, index: int) -> np.ndarray:
    """Sample.mixed_tokens (None = no token mixed), checked."""
    return token_flags(sample, index, "mixed_tokens", False)


def _in_dtype(params, dtype: str):
    """params as an engine of `dtype` holds them: wider floats cast (fp32 master weights
    synced to a bf16 engine), everything else as it is."""
    def cast(x):
        wider = jnp.issubdtype(x.dtype, jnp.floating) and \
            x.dtype.itemsize > jnp.dtype(dtype).itemsize
        return x.astype(dtype) if wider else x
    return jax.tree.map(cast, params)


def audit_attribution(batch: RolloutBatch | EpisodeBatch, params_by_version: dict,
                      config: ModelConfig, *, tolerance: float = AUDIT_TOLERANCE,
                      checked_elsewhere: Collection[int] = ()) -> AuditReport:
    """Checks invariant 2 for every sampled output token of `batch`.

    An EpisodeBatch is audited through its samples (one per episode): every sampled token of
    every turn under its own version, the observation tokens (loss_mask False) seen as
    context only: neither checked, nor counted, nor able to flag a sample or a version.

    Token t of a sample is scored with params_by_version[token_versions[t]] and the batch's
    sampling distribution, teacher-forced over the whole sequence: one dense pass per version
    over the samples holding tokens of it, i.e. with every KV entry written by that version,
    which is the KV history a token had unless it is mixed. Mixed tokens (Sample.mixed_tokens,
    kv_policy="keep": they attended KV of other versions) are counted and listed, not checked.
    A sample is flagged if a checked token's logprob differs from the recorded one by more
    than `tolerance` (default 0: any bit difference, as the engine on one device computes
    the trainer's bits; `tolerance_for(engine)` gives a mesh engine's calibrated one) or one
    of its tokens to check has a version without params. config: the sampler's (its dtype:
    params wider than it are cast first, as the engine's sync casts them). In the
    synchronous case (all tokens of a sample at its behavior version) this is one pass per
    behavior version. tolerance must be finite and >= 0 (a NaN tolerance would pass every
    sample). A sample whose token_versions, mixed_tokens or loss_mask has the wrong shape or
    type is a ValueError naming it. checked_elsewhere: versions whose tokens another pass
    checks (the train step's, `step_checks`): they are neither recomputed nor counted here.
    """
    if not isinstance(batch, (RolloutBatch, EpisodeBatch)):
        raise TypeError(f"batch must be a RolloutBatch or an EpisodeBatch, got "
                        f"{type(batch).__name__}")
    if not isinstance(params_by_version, Mapping):
        raise TypeError(f"params_by_version must be a mapping version -> params, got "
                        f"{type(params_by_version).__name__}")
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    tolerance = as_real(tolerance, "tolerance", minimum=0.0)
    all_samples = batch.samples  # EpisodeBatch.samples builds them: once
    versions = [sample_token_versions(s, i) for i, s in enumerate(all_samples)]
    sampled = [sample_loss_mask(s, i) for i, s in enumerate(all_samples)]
    mixed = [_mixed(s, i) & m for i, (s, m) in enumerate(zip(all_samples, sampled))]
    skip = np.asarray(sorted(int(v) for v in checked_elsewhere), np.int64)
    by_version: dict[int, list[int]] = {}  # version -> samples with tokens of it to check
    for i, (v, m, on) in enumerate(zip(versions, mixed, sampled)):
        for version in np.unique(v[on & ~m & ~np.isin(v, skip)]):
            by_version.setdefault(int(version), []).append(i)
    first_bad: dict[int, int] = {}
    per_sample: dict[int, float] = {}
    missing, worst, checked = set(), 0.0, 0
    for version, idx in sorted(by_version.items()):
        todo = [(versions[i] == version) & sampled[i] & ~mixed[i]
                for i in idx]  # bool [len(output_ids)] each
        if version not in params_by_version:
            missing.add(version)
            bad = [(i, int(np.argmax(sel))) for i, sel in zip(idx, todo)]
        else:
            samples = [all_samples[i] for i in idx]
            logp = np.asarray(next_token_log_probs(
                _in_dtype(params_by_version[version], config.dtype), config, _rows(samples),
                batch.sampling))
            bad = []
            for r, (i, s, sel) in enumerate(zip(idx, samples, todo)):
                p, o = len(s.prompt_ids), len(s.output_ids)
                diff = np.abs(logp[r, p - 1:p - 1 + o] - s.output_logprobs)
                diff = np.where(np.isnan(diff) & sel, np.inf, np.where(sel, diff, 0.0))
                checked += int(sel.sum())
                worst = max(worst, float(diff.max(initial=0.0)))
                if sel.any():
                    per_sample[i] = max(per_sample.get(i, 0.0), float(diff.max()))
                if (diff > tolerance).any():
                    bad.append((i, int(np.argmax(diff > tolerance))))
        for i, t in bad:
            first_bad[i] = min(t, first_bad.get(i, t))
    return AuditReport(
        ok=not first_bad, max_abs_diff=worst, num_samples=len(all_samples),
        num_tokens=int(sum(m.sum() for m in sampled)), flagged=tuple(sorted(first_bad)),
        missing_versions=tuple(sorted(missing)), tolerance=tolerance,
        num_checked_tokens=checked, num_mixed_tokens=int(sum(m.sum() for m in mixed)),
        first_bad_token=tuple(sorted(first_bad.items())),
        mixed_tokens=tuple((i, tuple(int(t) for t in np.flatnonzero(m)))
                           for i, m in enumerate(mixed) if m.any()),
        sample_diff_max=tuple(per_sample.get(i) for i in range(len(all_samples))))


def audited_in_step(train, sampler_dtype: str = "float32") -> bool:
    """Whether the train step's own forward reproduces the sampler, so its gate
    (`step_audit_sums`) checks the tokens of its version: one mini-batch (the first update
    runs the params that sampled them), computing in fp32 or in the sampler's own dtype (a
    bf16 step reproduces an engine that sampled the bf16 cast of its params)."""
    return train.mini_batches == 1 and train.compute_dtype in ("float32", sampler_dtype)


def step_checks(train, batches: list, version: int, params_by_version: Mapping,
                sampler_dtype: str = "float32") -> tuple[frozenset, dict]:
    """(the versions whose tokens the train step checks, {older version: params} it scores
    for that: `train_step(audit_params=...)`). When its own forward reproduces the sampler
    (`audited_in_step`): its version, and every older version of a checkable token (sampled,
    not mixed) whose params are held, scored on the step's packed micro-batches. Otherwise
    none: the separate pass (`audit_step_calls`) checks every token."""
    if not audited_in_step(train, sampler_dtype):
        return frozenset(), {}
    present = set()
    for batch in batches:
        for i, s in enumerate(batch.samples):
            on = sample_loss_mask(s, i) & ~_mixed(s, i)
            present.update(np.unique(sample_token_versions(s, i)[on]).tolist())
    older = {v: params_by_version[v] for v in sorted(present)
             if v < version and v in params_by_version}
    return frozenset({version, *older}), older


def refuse(step: int, batch, report: AuditReport) -> None:
    """AuditError (a RuntimeError) naming the flagged samples of a call, if any."""
    if not report.ok:
        raise AuditError(f"step {step}: the attribution audit flagged samples "
                         f"{list(report.flagged)[:8]} of a call at version "
                         f"{batch.version} (max |diff| {report.max_abs_diff:.3g} at "
                         f"tolerance {report.tolerance:.3g}, missing versions "
                         f"{list(report.missing_versions)})")


def _checked_in_step(samples, in_step: Collection[int]) -> int:
    """Samples with a token the train step checks."""
    return sum(_in_step_tokens(s, i, in_step) for i, s in enumerate(samples))


def _in_step_tokens(sample, index: int, in_step: Collection[int]) -> bool:
    """Whether the train step checks a token of `sample` (sampled at a version of
    `in_step`, not mixed)."""
    return bool((sample_loss_mask(sample, index)
                 & ~token_flags(sample, index, "mixed_tokens", False)
                 & np.isin(sample_token_versions(sample, index), list(in_step))).any())


@dataclasses.dataclass(frozen=True)
class StepAuditCounts:
    samples: int  # audited by either check
    flagged: int
    checked_tokens: int  # by the separate pass (the step adds its own)
    mixed_tokens: int
    max_abs_diff: float  # over the separate pass's checked tokens
    sample_diff_max: tuple = ()  # per sample of the step's calls, in batch order: max |diff|
    #                              over its tokens the separate pass checked, else None


def audit_step_calls(step: int, batches: list, params_by_version: Mapping,
                     config: ModelConfig, *, in_step: Collection[int], tolerance: float,
                     audit_samples: int | None = None) -> StepAuditCounts:
    """The separate audit of a GRPO step's calls, planned around the step's own: the
    tokens of the versions `in_step` (`step_checks`) are left to the train step and only
    the others are recomputed here. audit_samples: the first k samples (episodes) of each
    call (None: all); past them the step still checks every token of `in_step`. Raises
    RuntimeError naming the samples when one is flagged (nothing is trained)."""
    audited = flagged = checked = mixed = 0
    worst, per_sample = 0.0, []
    for batch in batches:
        if audit_samples is None:
            subset = batch
        elif isinstance(batch, EpisodeBatch):
            subset = dataclasses.replace(batch, episodes=batch.episodes[:audit_samples])
        else:
            subset = dataclasses.replace(batch, samples=batch.samples[:audit_samples])
        report = audit_attribution(subset, params_by_version, config, tolerance=tolerance,
                                   checked_elsewhere=in_step)
        audited += report.num_samples
        flagged += len(report.flagged)
        checked += report.num_checked_tokens
        mixed += report.num_mixed_tokens
        worst = max(worst, report.max_abs_diff)
        size = len(batch.episodes if isinstance(batch, EpisodeBatch) else batch.samples)
        per_sample += [*report.sample_diff_max, *[None] * (size - report.num_samples)]
        refuse(step, batch, report)
        if in_step and audit_samples is not None:  # past the subset: checked in the step
            audited += _checked_in_step(batch.samples[audit_samples:], in_step)
    return StepAuditCounts(audited, flagged, checked, mixed, worst, tuple(per_sample))


def sample_mismatches(batches: list, counts: StepAuditCounts, *, in_step: Collection[int],
                      step_max: float) -> list:
    """Each sample's largest |sampler - trainer| log-prob over its checked tokens, in batch
    order, or None where that is not known per sample. The separate pass's figure
    (`counts.sample_diff_max`) is per sample; the train step's check of the tokens of the
    versions `in_step` gives only the step's largest (`step_max`): at 0 every one of those
    tokens is exact, else a sample holding one gets None (its figure is at most step_max).
    None too for a sample none of whose tokens was checked (all mixed, or past
    audit_samples without in_step)."""
    out = []
    for batch in batches:
        for i, sample in enumerate(batch.samples):
            separate = counts.sample_diff_max[len(out)]
            if not (in_step and _in_step_tokens(sample, i, in_step)):
                out.append(separate)
            else:
                out.append(None if step_max != 0.0 else separate or 0.0)
    return out


def name_misattributed(step: int, batches: list, params_by_version: Mapping,
                       config: ModelConfig, tolerance: float,
                       passed: Collection[int] = ()) -> None:
    """After the step's gate refused an update: the full audit of every call but the tokens
    of versions `passed` (checked already, their params maybe let go), raising the
    RuntimeError that names the flagged samples (returns only if it flags none)."""
    for batch in batches:
        refuse(step, batch, audit_attribution(batch, params_by_version, config,
                                              tolerance=tolerance, checked_elsewhere=passed))
