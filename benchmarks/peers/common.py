"""The workload every peer runs (one definition, imported by each child script): task file,
chat-format prompts (one user message; each system applies the model's chat template),
reward, sizes (`--shape P x G x T`, `set_shape`), and the per-step JSON line the parent
reads. Standard library only, so each venv can import it."""
from __future__ import annotations

import json
import pathlib
import re
import resource
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = "/root/.cache/jaxrl_cache/SmolLM2-135M-Instruct"
TASK = ROOT / "examples/tasks/add.jsonl"
PROMPTS_PER_STEP, GROUP, MAX_NEW_TOKENS = 2, 8, 24  # set_shape changes them
SHAPES = ("2x8x24", "8x8x128")  # prompts per step x samples per prompt x new tokens
TEMPERATURE, LR, SEED = 1.0, 2e-5, 0
INT = re.compile(r"-?\d+")


def parse_shape(shape: str) -> tuple[int, int, int]:
    """"PxGxT" -> (prompts per step, samples per prompt, new tokens), each positive;
    ValueError naming the form otherwise."""
    parts = shape.lower().split("x")
    if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
        raise ValueError(f"shape must be PxGxT with positive integers (e.g. 2x8x24), "
                         f"got {shape!r}")
    prompts, group, new = map(int, parts)
    return prompts, group, new


def set_shape(shape: str) -> None:
    """PROMPTS_PER_STEP, GROUP, MAX_NEW_TOKENS from "PxGxT" (`parse_shape`)."""
    global PROMPTS_PER_STEP, GROUP, MAX_NEW_TOKENS
    PROMPTS_PER_STEP, GROUP, MAX_NEW_TOKENS = parse_shape(shape)


def messages(prompt: str) -> list[dict]:
    """The chat-format prompt every system is given: one user message."""
    return [{"role": "user", "content": prompt}]


def examples() -> list[dict]:
    """[{"prompt", "answer"}] of the task file, in file order."""
    return [json.loads(line) for line in TASK.read_text().splitlines() if line.strip()]


def step_examples(step: int) -> list[dict]:
    """The PROMPTS_PER_STEP examples of step `step` (the file in order, cycled)."""
    rows = examples()
    return [rows[(step * PROMPTS_PER_STEP + i) % len(rows)] for i in range(PROMPTS_PER_STEP)]


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, every thread (a step's difference
    over its wall seconds: the cores it kept busy)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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


def phase(name: str, edge: str) -> None:
    """A `PHASE {json}` line on stderr: `edge` ("start" / "end") of phase `name` at this wall
    time (benchmarks/run_memory.py lays them over its RSS trace)."""
    print("PHASE " + json.dumps(dict(name=name, edge=edge, t=time.time())), file=sys.stderr,
          flush=True)


def phased(name, fn):
    """`fn` wrapped in phase lines; `name` a string or a function of fn's arguments."""
    def wrapped(*a, **kw):
        label = name(*a, **kw) if callable(name) else name
        phase(label, "start")
        try:
            return fn(*a, **kw)
        finally:
            phase(label, "end")
    return wrapped
