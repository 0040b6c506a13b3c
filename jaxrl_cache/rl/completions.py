"""The completions log: every sample of every GRPO step as one JSON line (the demo's
completions.jsonl), what TRL's completions table shows, plus where each sample came from.

`completion_rows(result, prompt)` gives a step's rows from its `StepResult`, in batch order:
step, version (the trainer's, before the step), call and group (the sample's rollout call
in the step and its prompt's index in that call: a GRPO group is one (call, group)),
prompt (`prompt(meta, sample)`: text, or chat messages), completion (the decoded text; an
episode's turns joined), rewards ({function name: value, null where it did not apply}; {}
for episode returns), reward (the weighted total the advantage came from), advantage (the
one the update used), finish_reason, completion_tokens (sampled ones), behavior_version and
last_version (its oldest and newest sampled token's version: equal unless weights changed
while it was generated), mixed_tokens (those that attended KV of another version) and
mismatch (rl.audit.sample_mismatches: its largest |sampler - trainer| log-prob, null where
only the step's largest is known).

`CompletionsLog` invariants: a step's rows are appended in one write call on an O_APPEND
file (nothing buffered: on disk when write returns; a kill leaves at most a torn last line);
opened at `start_step` (a resumed run's first step) it keeps exactly the rows of steps
before it, a torn last line dropped, and puts them back in one rename: a resumed run
neither duplicates nor loses a row of the steps its checkpoint holds.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Callable

import numpy as np


def completion_rows(result, prompt: Callable) -> list[dict]:
    """One row per sample of a `rl.loop.StepResult` (see the module doc); prompt(meta,
    sample) -> the sample's prompt as the caller wants it logged (text or messages)."""
    step, version = result.record["step"], result.record["version"]
    values = result.reward_values or {}
    rows = []
    for k, (meta, sample, text) in enumerate(result.texts):
        sampled = _sampled(sample)
        versions = np.asarray(sample.token_versions)[sampled]
        mixed = sample.mixed_tokens
        rows.append(dict(
            step=step, version=version, call=result.calls[k], group=sample.group,
            prompt=prompt(meta, sample), completion=text,
            rewards={name: v[k] for name, v in values.items()}, reward=result.rewards[k],
            advantage=result.advantages[k], finish_reason=sample.finish_reason,
            completion_tokens=int(sampled.sum()),
            behavior_version=int(versions.min()), last_version=int(versions.max()),
            mixed_tokens=0 if mixed is None else int((np.asarray(mixed) & sampled).sum()),
            mismatch=result.mismatch[k]))
    return rows


def _sampled(sample) -> np.ndarray:
    """bool [T]: the tokens the policy sampled (a Sample's output, an Episode's turns)."""
    mask = sample.loss_mask
    return np.ones(len(sample.token_versions), bool) if mask is None else np.asarray(mask)


class CompletionsLog:
    """completions.jsonl at `path`, from `start_step` on (see the module doc)."""

    def __init__(self, path, *, start_step: int = 0):
        self.path = pathlib.Path(path)
        kept = _lines_before(self.path, start_step) if self.path.exists() else []
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.path)

    def write(self, rows: list[dict]) -> None:
        """A step's rows (`completion_rows`), in one write call."""
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, "".join(json.dumps(r) + "\n" for r in rows).encode())
        finally:
            os.close(fd)


def _lines_before(path: pathlib.Path, start_step: int) -> list[str]:
    """The lines of `path` whose row's step is before `start_step`; a torn last line is
    dropped, any other unreadable line is a ValueError naming it."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            step = json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError):
            if number == len(lines):  # a step written when the process was killed
                break
            raise ValueError(f"{path}:{number}: torn or corrupted line {line[:60]!r}; "
                             f"remove the file to resume without the earlier completions") \
                from None
        if step < start_step:
            kept.append(line if line.endswith("\n") else line + "\n")
    return kept
