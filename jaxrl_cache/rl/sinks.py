"""Metrics sinks: where a step's record goes besides metrics.jsonl (TensorBoard, CSV, W&B).

A sink is anything with `write(step, record)` and `close()` (`MetricsSink`). Invariants:
- every write reaches the sink's files before it returns (flushed per step), so a run can
  be watched live and a crash loses nothing already written;
- a record is flattened (nested dicts joined with "/") and only numeric scalars (bools as
  0/1) are sent; strings, lists and None are left to metrics.jsonl, which stays the record;
- a resumed run (start_step = the first step it will run) appends: what the earlier
  process wrote for steps >= start_step (after the checkpoint it resumed from) is dropped
  (CSV rows removed; TensorBoard events hidden by its purge on a restart), the rest kept;
- a failing write raises (the caller stops as on any error; metrics.jsonl has the step);
  `Sinks.close()` closes every sink even if one fails, and never raises (a metrics sink
  must not cost the run its final checkpoint); it is idempotent.
Optional dependencies are imported when a sink is made: tensorboardX (a dependency),
wandb (when installed; always offline unless WANDB_MODE says otherwise).
"""
from __future__ import annotations

import csv
import importlib.util
import os
import pathlib
import sys
import time
from typing import Protocol

REPORT_TO = ("tensorboard", "csv", "wandb", "none")
CSV_FILE, TENSORBOARD_DIR, WANDB_DIR = "metrics.csv", "tensorboard", "wandb"


class MetricsSink(Protocol):
    def write(self, step: int, record: dict) -> None: ...

    def close(self) -> None: ...


def parse_report_to(text: str | None) -> tuple[str, ...]:
    """"tensorboard,csv" -> ("tensorboard", "csv"); None, "" or "none" -> (). ValueError (one
    line) for an unknown name, "none" beside others, or wandb when it is not installed."""
    names = [n.strip() for n in (text or "none").split(",")]
    bad = [n for n in names if n not in REPORT_TO]
    if bad:
        raise ValueError(f"--report-to: unknown sink {bad[0]!r}; choose from "
                         f"{', '.join(REPORT_TO)} (comma-separated)")
    if "none" in names and len(names) > 1:
        raise ValueError(f"--report-to: 'none' excludes the other sinks, got {text!r}")
    if "wandb" in names and importlib.util.find_spec("wandb") is None:
        raise ValueError("--report-to wandb: wandb is not installed (pip install wandb)")
    return tuple(dict.fromkeys(n for n in names if n != "none"))


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The record's numeric scalars (nested dicts flattened with "/"), in record order."""
    out = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, name + "/"))
        elif isinstance(value, (bool, int, float)) or _numpy_kind(value) in tuple("biuf"):
            kind = _numpy_kind(value) or ("f" if isinstance(value, float) else "i")
            out[name] = float(value) if kind == "f" else int(value)
    return out


def _numpy_kind(value) -> str | None:
    """A numpy scalar's dtype kind ("b", "i", "u", "f", ...), else None."""
    dtype = getattr(value, "dtype", None)
    return dtype.kind if dtype is not None and getattr(value, "shape", None) == () else None


class TensorBoardSink:
    """Scalars as TensorBoard events under `logdir`: one event file per sink, one Event per
    step holding its scalars, written through tensorboardX's synchronous EventsWriter and
    flushed before write() returns (a process killed after a write loses none of it).
    (tensorboardX 2.6.5's SummaryWriter queues events for a thread, and its flush() does not
    drain that queue.) A file's name carries the second, the host, then the time in ns and
    the pid, so a run's files sort in the order they were written. A resumed run
    (start_step > 0) first writes a SessionLog START at start_step: TensorBoard then drops the
    earlier files' events of steps >= start_step."""

    def __init__(self, logdir, *, start_step: int = 0):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        self.Event, self.logdir = Event, pathlib.Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._writer = EventsWriter(str(self.logdir / "events"),
                                    filename_suffix=f".{time.time_ns()}.{os.getpid()}")
        if start_step:
            self._write(Event(wall_time=time.time(), step=start_step,
                              session_log=SessionLog(status=SessionLog.START)))
        else:
            self._writer.flush()  # the file's header event

    def _write(self, event) -> None:
        self._writer.write_event(event)
        self._writer.flush()

    def write(self, step: int, record: dict) -> None:
        from tensorboardX.proto.summary_pb2 import Summary
        from tensorboardX.summary import scalar
        values = [v for tag, value in scalars(record).items() for v in scalar(tag, value).value]
        self._write(self.Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def close(self) -> None:
        self._writer.close()


class CsvSink:
    """One CSV row per step at `path`. The header comes from the first record; a later
    record with new fields rewrites the file once with those columns added (earlier rows
    leave them empty; a field a record lacks is empty too). Each write appends and closes
    the file (nothing buffered); a rewrite goes through a temporary file and a rename."""

    def __init__(self, path, *, start_step: int = 0):
        self.path = pathlib.Path(path)
        self.columns: list[str] = []
        if self.path.exists():
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                rows = list(reader)
                self.columns = list(reader.fieldnames or [])
            kept = [r for r in rows if _step_of(r) is not None and _step_of(r) < start_step]
            if len(kept) != len(rows):
                self._rewrite(kept)

    def write(self, step: int, record: dict) -> None:
        row = {"step": step, **scalars(record)}
        new = [k for k in row if k not in self.columns]
        if new:
            old = []
            if self.columns:
                with open(self.path, newline="") as f:
                    old = list(csv.DictReader(f))
            self.columns += new
            self._rewrite(old + [row])
            return
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.columns, restval="").writerow(row)

    def _rewrite(self, rows: list[dict]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, self.columns, restval="")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)

    def close(self) -> None:
        pass


def _step_of(row: dict) -> int | None:
    try:
        return int(float(row.get("step") or "nan"))
    except ValueError:
        return None


class WandbSink:
    """Scalars to a Weights & Biases run in `out_dir`/wandb, offline unless WANDB_MODE is set
    (`wandb sync` uploads it later). config: the run's options."""

    def __init__(self, out_dir, *, config: dict | None = None, project: str = "jaxrl-cache"):
        try:
            import wandb
        except ImportError:
            raise ValueError("--report-to wandb: wandb is not installed (pip install wandb)") \
                from None
        (pathlib.Path(out_dir) / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, dir=str(out_dir), config=config or {},
                              mode=os.environ.get("WANDB_MODE", "offline"))

    def write(self, step: int, record: dict) -> None:
        self.run.log(scalars(record), step=step)

    def close(self) -> None:
        self.run.finish()


class Sinks:
    """Several sinks as one (in order); a context manager that closes them on exit."""

    def __init__(self, sinks: list):
        self.sinks, self.closed = list(sinks), False

    def write(self, step: int, record: dict) -> None:
        for sink in self.sinks:
            sink.write(step, record)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 (reported, never raised: see the doc)
                print(f"closing the {type(sink).__name__} failed: {e}".splitlines()[0],
                      file=sys.stderr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def make_sinks(report_to, out_dir, *, start_step: int = 0, config: dict | None = None) -> Sinks:
    """The sinks `report_to` names (a parse_report_to string or a tuple of names) writing
    into `out_dir`: tensorboard/ (event files), metrics.csv, wandb/. start_step: the first
    step this process writes (a resumed run's); config: the run's options (W&B)."""
    names = parse_report_to(report_to) if isinstance(report_to, (str, type(None))) \
        else parse_report_to(",".join(report_to) or "none")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    made = Sinks([])
    try:
        for name in names:
            made.sinks.append(
                TensorBoardSink(out / TENSORBOARD_DIR, start_step=start_step)
                if name == "tensorboard" else
                CsvSink(out / CSV_FILE, start_step=start_step) if name == "csv" else
                WandbSink(out, config=config))
    except BaseException:
        made.close()
        raise
    return made
