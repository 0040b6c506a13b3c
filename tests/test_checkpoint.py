"""Checkpoints: steps are versions, atomic under SIGKILL, verified by digest (on save too), never
touching a directory that is not ours, one writer per directory while readers poll, one-line
errors with a quiet stderr."""
import dataclasses
import fcntl
import json
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

from jaxrl_cache import dir_lock
from jaxrl_cache.errors import VersionError
from jaxrl_cache.models import ModelConfig, lora
from jaxrl_cache.rl.checkpoint import (MARKER, CheckpointError, base_fingerprint,
                                       checkpoint_lora_config, latest_checkpoint_version,
                                       restore_checkpoint, save_checkpoint)
from jaxrl_cache.rl.train import TrainState, optimizer_counts
from tests.helpers import CONFIG, hold_lock, varied_params

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


WRITER = """
import sys
import jax
from jaxrl_cache.rl.checkpoint import save_checkpoint
from jaxrl_cache.rl.train import TrainState
from tests.helpers import CONFIG, varied_params
base = varied_params(0)
print("ready", flush=True)
sys.stdin.readline()
for v in range(1, int(sys.argv[2]) + 1):
    save_checkpoint(sys.argv[1], TrainState.create(
        jax.tree.map(lambda x: x + v, base), config=CONFIG, version=v), max_to_keep=2)
    print("saved", v, flush=True)
print("holding", flush=True)
sys.stdin.readline()  # keeps the directory (and its lock) until the test lets go
"""


def _line(proc, deadline):
    ready, _, _ = select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))
    assert ready, "the writer did not answer"
    return proc.stdout.readline().decode().strip()


def test_a_reader_polls_while_the_writer_saves_and_a_second_writer_is_refused(tmp_path, state):
    """A writer process saves versions 1..4 (max_to_keep 2) while this process polls
    latest_checkpoint_version and restores the latest: every save returns, every restore
    succeeds with the params of its version. Then this process's save is refused naming
    the writer's pid, until the writer is killed -9: its lock is then taken over."""
    d, saves = tmp_path / "ckpt", 4
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    with open(tmp_path / "stderr", "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(d), str(saves)], env=env,
                                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, bufsize=0)  # unbuffered: select sees every line
    deadline = time.monotonic() + 120
    try:
        assert _line(proc, deadline) == "ready"
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        lines, restored = [], []
        while "holding" not in lines:
            assert time.monotonic() < deadline and proc.poll() is None, \
                (lines, (tmp_path / "stderr").read_text()[-2000:])
            if select.select([proc.stdout], [], [], 0)[0]:
                lines.append(proc.stdout.readline().decode().strip())
            v = latest_checkpoint_version(d)
            if v is not None:
                got = restore_checkpoint(d, state)  # the latest, possibly newer than v
                assert_params_equal(got, at_version(state, int(got.version),
                                                    shift=int(got.version)))
                restored.append(int(got.version))
        assert lines == [f"saved {v}" for v in range(1, saves + 1)] + ["holding"]
        assert restored and restored == sorted(restored) and restored[-1] == saves
        with pytest.raises(CheckpointError, match=f"in use by pid {proc.pid}") as e:
            save_checkpoint(d, at_version(state, saves + 1, shift=saves + 1))
        assert "\n" not in str(e.value)
        assert latest_checkpoint_version(d) == saves
    finally:
        proc.kill()
        proc.wait(30)
    assert "Traceback" not in (tmp_path / "stderr").read_text()
    save_checkpoint(d, at_version(state, saves + 1, shift=saves + 1), max_to_keep=2)
    assert_params_equal(restore_checkpoint(d, state), at_version(state, saves + 1,
                                                                 shift=saves + 1))


def test_readers_never_delete_a_save_in_progress(tmp_path, state):
    """Another process's unfinished save is an orbax temporary directory: reading leaves it."""
    d = tmp_path / "ckpt"
    save_checkpoint(d, state)
    in_progress = d / "1.orbax-checkpoint-tmp" / "state.orbax-checkpoint-tmp"
    in_progress.mkdir(parents=True)
    (in_progress / "part").write_bytes(b"x" * 64)
    assert latest_checkpoint_version(d) == 0
    restore_checkpoint(d, state)
    restore_checkpoint(d, state, step=0)
    assert (in_progress / "part").read_bytes() == b"x" * 64


@pytest.mark.parametrize("group_bytes", [None, 1])
def test_a_save_that_does_not_read_back_is_deleted_and_raised(tmp_path, state, monkeypatch,
                                                              group_bytes):
    """group_bytes=1: the read-back verifies one leaf at a time (what bounds a large
    state's verification memory) and still catches the flipped byte."""
    import jaxrl_cache.rl.checkpoint as ckpt
    if group_bytes is not None:
        monkeypatch.setattr(ckpt, "VERIFY_GROUP_BYTES", group_bytes)
        leaves = jax.tree.leaves(ckpt._payload(state))
        assert len(ckpt._leaf_groups(leaves)) == len(leaves) > 1
    d = tmp_path / "ckpt"
    save_checkpoint(d, state)
    save = ocp.CheckpointManager.save

    def corrupting_save(self, step, *args, **kwargs):  # the disk flips a byte as it lands
        result = save(self, step, *args, **kwargs)
        data = max((p for p in (d / str(step)).rglob("*") if p.is_file()),
                   key=lambda p: p.stat().st_size)
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
        return result

    monkeypatch.setattr(ocp.CheckpointManager, "save", corrupting_save)
    new = at_version(state, 1, shift=1.0)
    with pytest.raises(CheckpointError, match="does not read back .* the step was deleted"):
        save_checkpoint(d, new)
    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    assert latest_checkpoint_version(d) == 0 and not (d / "1").exists()
    save_checkpoint(d, new)  # the retry writes it again (not a no-op against a bad step)
    assert_params_equal(restore_checkpoint(d, state), new)


FULL_DISK = """
import resource, signal, sys
from jaxrl_cache.rl.checkpoint import CheckpointError, save_checkpoint
from jaxrl_cache.rl.train import TrainState
from tests.helpers import CONFIG, varied_params
state = TrainState.create(varied_params(0), config=CONFIG)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.RLIM_INFINITY))
try:
    save_checkpoint(sys.argv[1], state)
except CheckpointError as e:
    print(e)
"""


def test_a_failed_write_is_one_line_and_orbax_prints_nothing(tmp_path):
    """A save failing inside orbax's writer threads (a full disk: files may not grow past
    2 KiB): one CheckpointError line; the process's stderr stays empty to its exit."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path / "ckpt")], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("saving version 0 into") and "failed" in done.stdout
    assert done.stdout.count("\n") == 1
    assert done.stderr == ""


def test_directory_lock(tmp_path):
    """One claim per process; a dead holder's lock is taken over; a deleted lock file is
    claimed again; a live holder (helpers.hold_lock: plain flock) is named."""
    d = tmp_path / "dir"
    d.mkdir()
    lock = d / dir_lock.LOCK_FILE
    lock.write_text("999999999\n")  # a stale file: its writer died, nobody holds the flock
    dir_lock.claim(d)
    dir_lock.claim(d)
    assert lock.read_text() == f"{os.getpid()}\n"
    other = os.open(lock, os.O_RDWR)
    with pytest.raises(BlockingIOError):  # held: another open file cannot lock it
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(other)
    lock.unlink()  # e.g. the directory was cleared
    dir_lock.claim(d)
    assert lock.read_text() == f"{os.getpid()}\n"
    holder = hold_lock(tmp_path / "held")
    try:
        with pytest.raises(dir_lock.DirectoryInUse, match=f"in use by pid {holder.pid}"):
            dir_lock.claim(tmp_path / "held")
    finally:
        holder.kill()
        holder.wait(30)
    dir_lock.claim(tmp_path / "held")  # the dead holder's lock is taken over



@pytest.mark.parametrize("vanished", [FileNotFoundError, NotADirectoryError])
def test_a_step_pruned_while_a_reader_lists_steps_is_retried(tmp_path, state, monkeypatch,
                                                             vanished):
    """orbax stats every step while it builds a manager: a step the writer prunes meanwhile
    raises FileNotFoundError there (NotADirectoryError when it vanished between orbax's
    exists() and is_dir(): seen in CI). The reader rebuilds its manager (the restore
    succeeds); if steps keep vanishing it raises CheckpointError, never the OSError."""
    import jaxrl_cache.rl.checkpoint as ckpt
    save_checkpoint(tmp_path / "ckpt", state)
    real, failures = ckpt._manager, []

    def flaky(path, *args, **kw):
        if len(failures) < 2:
            failures.append(path)
            raise vanished(str(path / "1"))
        return real(path, *args, **kw)

    monkeypatch.setattr(ckpt, "_manager", flaky)
    got = restore_checkpoint(tmp_path / "ckpt", state)
    assert len(failures) == 2 and int(got.version) == int(state.version)
    monkeypatch.setattr(ckpt, "_manager", lambda path, *a, **k: (_ for _ in ()).throw(
        FileNotFoundError(str(path))))
    with pytest.raises(CheckpointError, match="kept disappearing"):
        latest_checkpoint_version(tmp_path / "ckpt")


# LoRA: adapters, optimizer state and version only, tied to the base by its fingerprint.
LORA = lora.LoraConfig(rank=4, alpha=16, targets=("q_proj", "v_proj", "down_proj"))


def lora_state(base, cfg=LORA, version=0, seed=3):
    """A LoRA TrainState with B off zero and optimizer moments that are not their init."""
    adapters = lora.init_adapters(CONFIG, cfg, jax.random.key(seed))
    adapters = jax.tree.map(lambda x: x + 0.01 * (seed + 1), adapters)
    s = TrainState.create(base, config=CONFIG, lora=cfg, adapters=adapters, version=version)
    moved = jax.tree.map(lambda x: x + 0.5 if jnp.issubdtype(x.dtype, jnp.floating) else x,
                         s.opt_state)
    return s.replace(opt_state=moved)


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_lora_checkpoint_holds_adapters_and_restores_them_bit_for_bit(tmp_path):
    base = varied_params(0)
    saved = lora_state(base, version=3)
    d = tmp_path / "ckpt"
    save_checkpoint(d, saved)
    meta = json.loads((d / "3" / "meta" / "metadata").read_text())
    assert meta["lora"] == dict(rank=4, alpha=16.0, targets=list(LORA.targets))
    assert meta["base"] == base_fingerprint(base)
    assert {p.split("'")[1] for p, _, _ in meta["layout"]} == {"opt_state", "params", "version"}
    assert not any("embed" in p or "wk" in p for p, _, _ in meta["layout"])  # no base weight
    stored = sum(p.stat().st_size for p in (d / "3").rglob("*") if p.is_file())
    assert stored < sum(x.nbytes for x in jax.tree.leaves(base))
    assert checkpoint_lora_config(d) == LORA

    template = TrainState.create(base, config=CONFIG, lora=LORA)  # fresh adapters, version 0
    got = restore_checkpoint(d, template)
    assert int(got.version) == 3 and optimizer_counts(got.opt_state) == [3]
    assert_trees_equal(got.params, saved.params)
    assert_trees_equal(got.opt_state, saved.opt_state)
    assert got.frozen is template.frozen and got.lora == LORA
    assert_trees_equal(got.model_params, saved.model_params)
    save_checkpoint(d, saved)  # the same contents again: a no-op


def test_lora_checkpoint_refuses_another_base_config_or_kind(tmp_path):
    base = varied_params(0)
    d, full_d = tmp_path / "lora", tmp_path / "full"
    save_checkpoint(d, lora_state(base))
    save_checkpoint(full_d, TrainState.create(base, config=CONFIG))
    assert checkpoint_lora_config(full_d) is None
    refusals = [
        (d, TrainState.create(varied_params(1), config=CONFIG, lora=LORA),
         "holds LoRA adapters of another base model .*: build the template over the base"),
        (d, TrainState.create(base, config=CONFIG, lora=dataclasses.replace(LORA, rank=2)),
         r"holds LoRA adapters \(rank 4, alpha 16, targets q_proj,v_proj,down_proj\), the "
         r"template trains LoRA adapters \(rank 2, .*lora=checkpoint_lora_config"),
        (d, TrainState.create(base, config=CONFIG, lora=dataclasses.replace(LORA, alpha=8)),
         r"the template trains LoRA adapters \(rank 4, alpha 8,"),
        (d, TrainState.create(base, config=CONFIG, lora=lora.LoraConfig(rank=4, alpha=16)),
         r"template trains LoRA adapters \(rank 4, alpha 16, targets q_proj,v_proj\)"),
        (d, TrainState.create(base, config=CONFIG),
         r"holds LoRA adapters .*, the template trains full fine-tuning params"),
        (full_d, TrainState.create(base, config=CONFIG, lora=LORA),
         r"holds full fine-tuning params, the template trains LoRA adapters .*: restore it "
         r"into a full fine-tuning TrainState"),
    ]
    for directory, template, message in refusals:
        with pytest.raises(CheckpointError, match=message) as e:
            restore_checkpoint(directory, template)
        assert "\n" not in str(e.value)
    other_base = lora_state(varied_params(1))  # same adapters and version, another base
    with pytest.raises(CheckpointError, match="already holds version 0 with other contents"):
        save_checkpoint(d, other_base)


def test_base_fingerprint_is_by_value_and_cached_by_identity(monkeypatch):
    import jaxrl_cache.rl.checkpoint as ckpt
    base = varied_params(0)
    first = base_fingerprint(base)
    calls = []
    digest = ckpt._digest
    monkeypatch.setattr(ckpt, "_digest", lambda tree: calls.append(1) or digest(tree))
    assert base_fingerprint(base) == first and not calls  # the very arrays: cached
    copy = jax.tree.map(jnp.copy, base)
    assert base_fingerprint(copy) == first and len(calls) == 1  # equal values, one pass
    moved = {**copy, "embed": copy["embed"].at[0, 0].add(1.0)}
    assert base_fingerprint(moved) != first
    assert base_fingerprint(jax.tree.map(lambda x: x.astype(jnp.bfloat16), base)) != first
