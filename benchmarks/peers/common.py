"""The workload every peer runs (one definition, imported by each child script): task file,
reward, sizes, and the per-step JSON line the parent reads. Standard library only, so each
venv can import it."""
from __future__ import annotations

import json
import pathlib
import re
import resource
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = "/root/.cache/jaxrl_cache/SmolLM2-135M-Instruct"
TASK = ROOT / "examples/tasks/add.jsonl"
PROMPTS_PER_STEP, GROUP, MAX_NEW_TOKENS = 2, 8, 24
TEMPERATURE, LR, SEED = 1.0, 2e-5, 0
INT = re.compile(r"-?\d+")


def examples() -> list[dict]:
    """[{"prompt", "answer"}] of the task file, in file order."""
    return [json.loads(line) for line in TASK.read_text().splitlines() if line.strip()]


def step_examples(step: int) -> list[dict]:
    """The PROMPTS_PER_STEP examples of step `step` (the file in order, cycled)."""
    rows = examples()
    return [rows[(step * PROMPTS_PER_STEP + i) % len(rows)] for i in range(PROMPTS_PER_STEP)]


def reward(completion: str, answer: str) -> float:
    """1.0 iff the completion's last integer equals the answer."""
    found = INT.findall(completion)
    return float(bool(found) and found[-1] == answer.strip())


def peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM), MiB."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def emit(**row) -> None:
    """One JSON line on stdout, prefixed so the parent can find it among library output."""
    print("STEP " + json.dumps(row), flush=True)
    sys.stdout.flush()
