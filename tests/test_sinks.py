"""Metrics sinks (rl/sinks.py): TensorBoard event files read back record by record, CSV read
back with `csv`, a resumed run appending, W&B through a stand-in module, `--report-to`
through the demo and the CLI, and the demo without matplotlib."""
import csv
import os
import struct
import subprocess
import sys
import types

import numpy as np
import pytest

from jaxrl_cache.app import cli, demo
from jaxrl_cache.app.run_dir import RunDir
from jaxrl_cache.rl import sinks
from tensorboardX.proto import event_pb2
from tests.test_demo import REPO

RECORDS = [dict(step=s, reward=0.5 + s, loss=np.float32(-s), audit_failed=0, ok=True,
                mode="sync", sample=dict(prompt="p", completion="c"), lengths=[1, 2],
                rewards=dict(exact=dict(mean=0.25 * s))) for s in range(3)]


def read_events(logdir) -> list:
    """Every Event of every event file under logdir, file by file in name order (the
    TFRecord framing by hand: length u64, its crc u32, the payload, its crc u32)."""
    events = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            payload = data[at + 12:at + 12 + length]
            assert len(payload) == length, f"{path.name}: torn record"
            events.append(event_pb2.Event.FromString(payload))
            at += 12 + length + 4
    return events


def scalars_of(events) -> dict:
    """{tag: [(step, value)]} of the scalar summaries, TensorBoard's purge on a restart
    applied (a SessionLog START at step T drops the earlier events of steps >= T)."""
    out: dict = {}
    for e in events:
        if e.HasField("session_log") and e.session_log.status == event_pb2.SessionLog.START:
            out = {t: [(s, v) for s, v in pts if s < e.step] for t, pts in out.items()}
        for v in e.summary.value:
            out.setdefault(v.tag, []).append((e.step, v.simple_value))
    return out


def test_tensorboard_scalars_read_back_live_and_after_a_resume(tmp_path):
    sink = sinks.TensorBoardSink(tmp_path / "tb")
    for r in RECORDS:
        sink.write(r["step"], r)
        live = scalars_of(read_events(tmp_path / "tb"))  # on disk when write returns
        assert live["reward"][-1] == (r["step"], r["reward"])
    assert live["reward"] == [(0, 0.5), (1, 1.5), (2, 2.5)]
    assert live["loss"] == [(0, 0.0), (1, -1.0), (2, -2.0)]
    assert live["rewards/exact/mean"] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    assert live["ok"] == [(0, 1.0), (1, 1.0), (2, 1.0)]
    assert not {"mode", "sample/prompt", "lengths"} & set(live)  # numeric scalars only
    sink.close()
    resumed = sinks.TensorBoardSink(tmp_path / "tb", start_step=1)  # steps 1, 2 again
    resumed.write(1, dict(reward=9.0))
    resumed.close()
    assert scalars_of(read_events(tmp_path / "tb"))["reward"] == [(0, 0.5), (1, 9.0)]


CRASH = """
import os, sys
from jaxrl_cache.rl import sinks
sink = sinks.TensorBoardSink(sys.argv[1], start_step=int(sys.argv[2]))
for step in range(int(sys.argv[2]), 3):
    sink.write(step, dict(reward=float(step), step_seconds=0.5))
os._exit(9)  # no close, no atexit handler, no flush of anything
"""


def test_tensorboard_steps_survive_a_crash_and_a_resume(tmp_path):
    """A process killed right after its last write (os._exit: no close, no atexit cleanup)
    leaves every step it wrote readable, in its one event file; a resumed one then hides the
    steps after its checkpoint and appends."""
    logdir = tmp_path / "tb"
    for start in (0, 1):
        done = subprocess.run([sys.executable, "-c", CRASH, str(logdir), str(start)],
                              cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 9, done.stderr
        assert scalars_of(read_events(logdir))["reward"] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    names = sorted(p.name for p in logdir.glob("events.out.tfevents.*"))
    assert len(names) == 2  # one file per process (was one per step)
    assert names == sorted(names, key=lambda n: int(n.split(".")[-2]))  # written in order


def read_csv(path) -> tuple[list, list]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_csv_header_new_columns_and_resume(tmp_path):
    path = tmp_path / "metrics.csv"
    sink = sinks.CsvSink(path)
    sink.write(0, RECORDS[0])
    header, rows = read_csv(path)
    assert header == ["step", "reward", "loss", "audit_failed", "ok", "rewards/exact/mean"]
    assert rows == [dict(step="0", reward="0.5", loss="0.0", audit_failed="0", ok="1",
                         **{"rewards/exact/mean": "0.0"})]
    sink.write(1, dict(reward=1.5, eval_exact=0.75))  # a new column; the others missing
    sink.write(2, dict(reward=2.5))
    header, rows = read_csv(path)
    assert header[-1] == "eval_exact" and [r["step"] for r in rows] == ["0", "1", "2"]
    assert (rows[0]["eval_exact"], rows[1]["eval_exact"], rows[2]["eval_exact"]) == \
        ("", "0.75", "")
    assert rows[1]["loss"] == "" and float(rows[2]["reward"]) == 2.5
    sink.close()
    sinks.CsvSink(path, start_step=1).write(1, dict(reward=7.0))  # resumed at step 1
    _, rows = read_csv(path)
    assert [(r["step"], r["reward"]) for r in rows] == [("0", "0.5"), ("1", "7.0")]
    assert not list(tmp_path.glob("*.tmp"))


def test_report_to_names_and_wandb(monkeypatch, tmp_path):
    assert sinks.parse_report_to("tensorboard, csv") == ("tensorboard", "csv")
    assert sinks.parse_report_to(None) == sinks.parse_report_to("none") == ()
    with pytest.raises(ValueError, match="unknown sink 'tb'"):
        sinks.parse_report_to("csv,tb")
    with pytest.raises(ValueError, match="'none' excludes"):
        sinks.parse_report_to("none,csv")
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    monkeypatch.setattr(sinks.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="wandb is not installed"):
        sinks.parse_report_to("wandb")
    calls = []
    run = types.SimpleNamespace(log=lambda data, step: calls.append(("log", step, data)),
                                finish=lambda: calls.append(("finish",)))
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or run)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(sinks.importlib.util, "find_spec", lambda name: object())
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with sinks.make_sinks("wandb,csv", tmp_path, config=dict(lr=0.1)) as made:
        made.write(0, RECORDS[1])
    assert calls[0][1]["mode"] == "offline" and calls[0][1]["config"] == dict(lr=0.1)
    assert calls[1] == ("log", 0, sinks.scalars(RECORDS[1])) and calls[2] == ("finish",)
    assert (tmp_path / "wandb").is_dir() and (tmp_path / "metrics.csv").is_file()


def test_closing_closes_every_sink_and_never_raises(capsys):
    closed = []

    class Broken:
        def write(self, step, record):
            pass

        def close(self):
            closed.append("broken")
            raise OSError("disk full\nmore")

    class Fine(Broken):
        def close(self):
            closed.append("fine")

    group = sinks.Sinks([Broken(), Fine()])
    group.close()
    group.close()  # idempotent
    assert closed == ["broken", "fine"]
    assert capsys.readouterr().err == "closing the Broken failed: disk full\n"


SMALL = dict(steps=2, sft_steps=2, sft_batch=4, eval_prompts=4, group_size=2,
             prompts_per_step=4, rollout_calls=1, checkpoint_every=1)


def test_demo_reports_to_tensorboard_and_csv_and_runs_without_matplotlib(tmp_path, capsys,
                                                                         monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    out = tmp_path / "run"
    demo.run_demo(demo.DemoOptions(out=str(out), report_to="tensorboard,csv", **SMALL))
    assert "matplotlib is not installed: no demo.png" in capsys.readouterr().out
    assert not (out / "demo.png").exists()
    _, rows = read_csv(out / "metrics.csv")
    assert [r["step"] for r in rows] == ["0", "1"]
    for key in ("reward", "reward_std", "zero_std_groups", "completion_length_mean",
                "truncated_fraction", "entropy", "kl", "exact_match"):
        assert key in rows[0], key
    tb = scalars_of(read_events(out / "tensorboard"))
    assert [s for s, _ in tb["entropy"]] == [0, 1]
    assert tb["reward"][1][1] == pytest.approx(float(rows[1]["reward"]))
    demo.run_demo(demo.DemoOptions(out=str(out), resume=True, report_to="csv",
                                   **dict(SMALL, steps=3)))
    _, rows = read_csv(out / "metrics.csv")
    assert [r["step"] for r in rows] == ["0", "1", "2"]  # appended, not clobbered
    RunDir(out).clear()  # what --overwrite does first
    assert not (out / "metrics.csv").exists() and not (out / "tensorboard").exists()


@pytest.mark.parametrize("value, message", [("tb", "unknown sink 'tb'"),
                                            ("none,csv", "'none' excludes")])
def test_cli_report_to_errors_are_one_line(value, message, tmp_path, capsys):
    assert cli.main(["demo", "--report-to", value, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
