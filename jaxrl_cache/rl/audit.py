"""Attribution audit: recompute behavior logprobs teacher-forced with the claimed params."""
from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_cache.checks import as_real
from jaxrl_cache.rollout.types import RolloutBatch
from jaxrl_cache.models import ModelConfig
from jaxrl_cache.rl.train import pack_samples, teacher_forced_log_probs


@dataclasses.dataclass(frozen=True)
class AuditReport:
    ok: bool
    max_abs_diff: float
    num_samples: int
    num_tokens: int
    flagged: tuple  # indices of samples whose logprobs do not match their behavior version
    missing_versions: tuple  # behavior versions with no params supplied
    tolerance: float


_teacher_forced = jax.jit(teacher_forced_log_probs, static_argnums=1)


def audit_attribution(batch: RolloutBatch, params_by_version: dict, config: ModelConfig, *,
                      tolerance: float = 2e-3) -> AuditReport:
    """Checks invariant 2 for every sample of `batch`.

    Each sample's outputs are scored with params_by_version[sample.behavior_version] and the
    same sampling distribution; the sample is flagged if any token's logprob differs from the
    recorded one by more than `tolerance` (or its version's params are missing).
    tolerance must be finite and >= 0 (a NaN tolerance would pass every sample).
    """
    if not isinstance(batch, RolloutBatch):
        raise TypeError(f"batch must be a RolloutBatch, got {type(batch).__name__}")
    if not isinstance(params_by_version, Mapping):
        raise TypeError(f"params_by_version must be a mapping version -> params, got "
                        f"{type(params_by_version).__name__}")
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    tolerance = as_real(tolerance, "tolerance", minimum=0.0)
    sp = batch.sampling
    knobs = sp.as_arrays()
    flagged, missing, worst, n_tokens = [], set(), 0.0, 0
    by_version: dict[int, list[int]] = {}
    for i, s in enumerate(batch.samples):
        by_version.setdefault(s.behavior_version, []).append(i)
    for version, idx in sorted(by_version.items()):
        if version not in params_by_version:
            missing.add(version)
            flagged.extend(idx)
            continue
        samples = [batch.samples[i] for i in idx]
        tokens, _, _ = pack_samples(samples)
        logp = np.asarray(_teacher_forced(params_by_version[version], config,
                                          jnp.asarray(tokens), **knobs))
        for r, (i, s) in enumerate(zip(idx, samples)):
            p, o = len(s.prompt_ids), len(s.output_ids)
            diff = np.abs(logp[r, p - 1:p - 1 + o] - s.output_logprobs)
            diff = np.where(np.isnan(diff), np.inf, diff)
            n_tokens += o
            worst = max(worst, float(diff.max(initial=0.0)))
            if (diff > tolerance).any():
                flagged.append(i)
    return AuditReport(ok=not flagged, max_abs_diff=worst, num_samples=len(batch.samples),
                       num_tokens=n_tokens, flagged=tuple(sorted(flagged)),
                       missing_versions=tuple(sorted(missing)), tolerance=tolerance)
