"""The output directory of one demo run: its files, its lock, its run record and metrics.

Files: run.json (the run record: options, then the policy directory and the pre-GRPO eval;
written atomically), metrics.jsonl (one row per GRPO step, appended a whole line per write),
completions.jsonl (one row per sample per step: rl/completions.py), checkpoints/, base_model/, sft_model/, final_model/, demo.png, metrics.csv, tensorboard/ and
wandb/ (--report-to), and the lock file
`.jaxrl_cache.lock` (dir_lock): one process runs in a directory at a time; another one is
refused naming the holder's pid, and the lock of a dead run is taken over.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil

from tqdm import tqdm

from jaxrl_cache.dir_lock import DirectoryInUse, claim
from jaxrl_cache.rl.sinks import CSV_FILE, TENSORBOARD_DIR, WANDB_DIR

RUN_FILE, METRICS, CHECKPOINTS, PLOT = "run.json", "metrics.jsonl", "checkpoints", "demo.png"
COMPLETIONS = "completions.jsonl"
OUTPUTS = (RUN_FILE, METRICS, COMPLETIONS, CHECKPOINTS, PLOT, "base_model", "sft_model",
           "final_model", CSV_FILE, TENSORBOARD_DIR, WANDB_DIR)  # the last three: --report-to


class RunDir:
    """The output directory of one run; see the module doc for its files."""

    def __init__(self, out):
        self.path = pathlib.Path(out)
        self.run_file = self.path / RUN_FILE
        self.metrics = self.path / METRICS
        self.completions = self.path / COMPLETIONS
        self.checkpoints = self.path / CHECKPOINTS

    def lock(self) -> None:
        """Makes this process the directory's one run (creating the directory) until it
        exits; ValueError naming the pid of a live run holding it."""
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            claim(self.path)
        except DirectoryInUse as e:
            raise ValueError(f"--out {self.path} is in use by another run (pid {e.pid}); wait "
                             f"for it to finish or choose another --out") from None

    def holds_run(self) -> bool:
        return any((self.path / name).exists() for name in OUTPUTS)

    def clear(self) -> None:
        """Removes this demo's outputs (and nothing else) from the directory."""
        for name in OUTPUTS:
            target = self.path / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()

    def read_record(self) -> dict:
        """The run record; ValueError naming run.json if it is empty, corrupted or not one."""
        try:
            record = json.loads(self.run_file.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{self.run_file}: not a readable run record ({e}); --overwrite "
                             f"starts the run over") from None
        if not (isinstance(record, dict) and isinstance(record.get("options"), dict)):
            raise ValueError(f"{self.run_file}: not a run record (no \"options\" object); "
                             f"--overwrite starts the run over")
        return record

    def write_record(self, record: dict) -> None:
        """Replaces run.json in one rename: a kill leaves the old record or the new one."""
        tmp = self.run_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=2))
        os.replace(tmp, self.run_file)

    def read_rows(self, version: int) -> list[dict]:
        """The metrics rows of steps 0..version-1, checked and in order; rewrites the file to
        exactly those (later rows belong to steps the checkpoint does not include)."""
        lines = self.metrics.read_text().splitlines() if self.metrics.exists() else []
        rows = []
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines) and len(rows) >= version:
                    tqdm.write(f"{self.metrics}: dropped a torn last line {number} (a step "
                               f"after the checkpoint, version {version})")
                    break
                raise ValueError(f"{self.metrics}:{number}: torn or corrupted line "
                                 f"{line[:60]!r}; cannot resume from version {version}") \
                    from None
            rows.append(row)
        kept = rows[:version]
        if [r.get("step") for r in kept] != list(range(version)):
            have = [r.get("step") for r in rows]
            raise ValueError(f"{self.metrics} must hold steps 0..{version - 1} in order to "
                             f"resume from the checkpoint at version {version}; it holds "
                             f"{_ranges(have)}")
        tmp = self.metrics.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.metrics)
        return kept

    def append_row(self, row: dict) -> None:
        """One whole line per write call: a kill leaves at most a torn last line."""
        fd = os.open(self.metrics, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(row) + "\n").encode())
        finally:
            os.close(fd)


def _ranges(values) -> str:
    if not values:
        return "no rows"
    if values == list(range(values[0], values[0] + len(values))):
        return f"steps {values[0]}..{values[-1]}"
    return f"steps {values[:12]}{'...' if len(values) > 12 else ''}"
