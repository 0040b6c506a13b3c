"""Checkpoints: steps are versions, atomic under SIGKILL, verified by digest, never touching a
directory that is not ours, one-line errors with a quiet stderr."""
import os
import pathlib
import select
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxrl_cache.errors import VersionError
from jaxrl_cache.models import ModelConfig
from jaxrl_cache.rl.checkpoint import (MARKER, CheckpointError, latest_checkpoint_version,
                                       restore_checkpoint, save_checkpoint)
from jaxrl_cache.rl.train import TrainState, optimizer_counts
from tests.helpers import CONFIG, varied_params

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def state():
    return TrainState.create(varied_params(0), config=CONFIG, lr_schedule=1e-3)


def at_version(state, v, shift=0.0):
    """`state` moved to version v (counts too), params shifted so contents differ."""
    return TrainState.create(jax.tree.map(lambda x: x + shift, state.params), config=CONFIG,
                             lr_schedule=1e-3, version=v)


def assert_params_equal(a, b):
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_steps_are_versions_latest_and_max_to_keep(tmp_path, state):
    d = tmp_path / "ckpt"
    assert latest_checkpoint_version(d) is None
    for v in range(5):
        path = save_checkpoint(d, at_version(state, v, shift=v), max_to_keep=2)
        assert path == d.resolve() / str(v)
    assert latest_checkpoint_version(d) == 4
    assert sorted(p.name for p in d.iterdir() if p.name.isdigit()) == ["3", "4"]
    latest = restore_checkpoint(d, state)
    assert int(latest.version) == 4 and optimizer_counts(latest.opt_state) == [4]
    assert_params_equal(latest, at_version(state, 4, shift=4))
    older = restore_checkpoint(d, state, step=3)
    assert_params_equal(older, at_version(state, 3, shift=3))
    with pytest.raises(CheckpointError, match=r"no version 1 .* holds \[3, 4\]"):
        restore_checkpoint(d, state, step=1)
    with pytest.raises(VersionError):
        restore_checkpoint(d, state, step=-1)


def test_a_saved_version_is_never_rewritten(tmp_path, state):
    d = tmp_path / "ckpt"
    save_checkpoint(d, at_version(state, 2))
    before = sorted((p, p.stat().st_mtime_ns) for p in d.rglob("*"))
    save_checkpoint(d, at_version(state, 2))  # same contents: a no-op
    assert sorted((p, p.stat().st_mtime_ns) for p in d.rglob("*")) == before
    with pytest.raises(CheckpointError, match="already holds version 2 with other contents"):
        save_checkpoint(d, at_version(state, 2, shift=1.0))
    with pytest.raises(CheckpointError, match="already holds the newer version 2"):
        save_checkpoint(d, at_version(state, 1))
    assert_params_equal(restore_checkpoint(d, state), at_version(state, 2))


def test_flipped_byte_is_a_one_line_error_and_stderr_stays_quiet(tmp_path, state, capfd):
    d = tmp_path / "ckpt"
    save_checkpoint(d, state)
    data = max((p for p in (d / "0").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    capfd.readouterr()
    with pytest.raises(CheckpointError, match="is corrupted") as e:
        restore_checkpoint(d, state)
    assert "\n" not in str(e.value)
    assert capfd.readouterr().err == ""


def test_corrupted_metadata_and_foreign_directories(tmp_path, state, capfd):
    d = tmp_path / "ckpt"
    save_checkpoint(d, state)
    (d / "0" / "meta" / "metadata").write_text("{not json")
    capfd.readouterr()
    with pytest.raises(CheckpointError, match="unreadable|no valid metadata"):
        restore_checkpoint(d, state)
    assert capfd.readouterr().err == ""

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("precious")
    for call in (lambda: save_checkpoint(foreign, state),
                 lambda: restore_checkpoint(foreign, state),
                 lambda: latest_checkpoint_version(foreign)):
        with pytest.raises(CheckpointError, match="not empty and holds no jaxrl_cache"):
            call()
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        save_checkpoint(a_file, state)
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        restore_checkpoint(tmp_path / "missing", state)
    empty = tmp_path / "empty"
    save_checkpoint(empty, state)  # an empty directory becomes ours
    assert (empty / MARKER).is_file()


def test_template_must_match(tmp_path, state):
    d = tmp_path / "ckpt"
    save_checkpoint(d, state)
    bf16 = TrainState.create(jax.tree.map(lambda x: x.astype(jnp.bfloat16), state.params),
                             config=CONFIG)
    with pytest.raises(CheckpointError, match="does not match the template.*bfloat16"):
        restore_checkpoint(d, bf16)
    other = TrainState.create(varied_params(0, ModelConfig.tiny(vocab_size=40,
                                                            max_seq_len=96)),
                              config=CONFIG)
    with pytest.raises(CheckpointError, match="does not match the template"):
        restore_checkpoint(d, other)
    for bad in (None, state.params):
        with pytest.raises(TypeError, match="template must be a TrainState"):
            restore_checkpoint(d, bad)
    with pytest.raises(TypeError, match="state must be a TrainState"):
        save_checkpoint(d, None)
    with pytest.raises(ValueError, match="max_to_keep"):
        save_checkpoint(d, state, max_to_keep=0)


def test_ctrl_c_during_a_save_lands_after_it(tmp_path, state, monkeypatch):
    save = ocp.CheckpointManager.save

    def interrupted_save(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C as the write begins
        time.sleep(0.01)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", interrupted_save)
    d, new = tmp_path / "ckpt", at_version(state, 1, shift=1.0)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(d, new)
    monkeypatch.undo()
    assert latest_checkpoint_version(d) == 1
    assert_params_equal(restore_checkpoint(d, state), new)


SAVER = """
import sys
from jaxrl_cache.rl.checkpoint import save_checkpoint
from jaxrl_cache.rl.train import TrainState
from tests.helpers import CONFIG, varied_params
import jax
base = varied_params(0)
for v in range(1, 1000):
    save_checkpoint(sys.argv[1], TrainState.create(
        jax.tree.map(lambda x: x + v, base), config=CONFIG, version=v), max_to_keep=2)
    print(v, flush=True)
"""


@pytest.mark.parametrize("delay", [0.0, 0.1])
def test_sigkill_during_saves_leaves_the_previous_checkpoint(tmp_path, state, delay):
    """A saver loops over versions; SIGKILL lands `delay` s after the first save finished,
    i.e. somewhere inside a later save. Every step left behind restores and verifies."""
    d = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(d)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready and proc.stdout.readline().strip() == b"1", "saver did not start"
        time.sleep(delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    latest = latest_checkpoint_version(d)
    assert latest is not None and latest >= 1
    steps = sorted(int(p.name) for p in d.iterdir() if p.name.isdigit())
    assert steps and steps[-1] == latest
    for v in steps:
        restored = restore_checkpoint(d, state, step=v)
        assert int(restored.version) == v
        assert_params_equal(restored, at_version(state, v, shift=v))
    # a half-written step left by the kill does not block the next save
    save_checkpoint(d, at_version(state, latest + 1, shift=latest + 1), max_to_keep=2)
    assert int(restore_checkpoint(d, state).version) == latest + 1
