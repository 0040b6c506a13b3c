"""Checkpoints of a TrainState (params, optimizer state, version) through orbax's
CheckpointManager: one step per policy version, in one directory that holds nothing else.

Guarantees:
- Atomic: orbax writes a step into a temporary directory and renames it when complete, so a
  save killed at any moment leaves every earlier step restorable. A version already saved is
  never rewritten: saving identical contents again is a no-op, different contents under the
  same version are refused (a weight change comes with a new version).
- Verified: each step stores a digest (blake2b) of every array and the shape/dtype of every
  leaf; restore checks the template against them before reading and the digest after, so a
  flipped byte or a template of another model/dtype is a `CheckpointError`, as is a state
  whose optimizer update counts disagree with its version.
  A save reads the step it finalized back and checks it the same way (a step that does not
  read back is deleted and the save raises).
- Whole: SIGINT/SIGTERM arriving during a save are delivered once it has finalized.
- One writer: the first process to save into a directory owns it until it exits (a lock file,
  see dir_lock); another process's save is refused naming the owner's pid, and the lock of
  a dead owner is taken over. Readers (`latest_checkpoint_version`, `restore_checkpoint`)
  open orbax read-only: they never write or delete anything, so they may poll a directory
  while its writer saves. A restore of the latest step that the writer prunes meanwhile
  (max_to_keep) moves on to the newer latest step.
- Ours only: the directory carries a marker file; a non-empty directory without it is refused
  (never written into, never pruned).
- LoRA: a state with `lora` saves its adapters, optimizer state and version, never the base;
  the step's metadata holds the LoraConfig and the base's fingerprint (`base_fingerprint`).
  Restoring needs a template built over the same base with the same LoraConfig (refused
  otherwise, as is a full fine-tuning step into a LoRA template and vice versa).
  `checkpoint_lora_config` reads a step's LoraConfig to build that template.
- Quiet: errors are one line. In a process that uses this module, orbax's log records and the
  "Event loop is closed" reports its background threads leave after a failed write are
  dropped (the CheckpointError says what failed).
"""
from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import sys
import warnings
import weakref

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrl_cache.dir_lock import DirectoryInUse, claim
from jaxrl_cache.interrupts import deferred_signals
from jaxrl_cache.models.lora import SCALE, LoraConfig
from jaxrl_cache.rl.train import TrainState, optimizer_counts
from jaxrl_cache.versioning import as_version

MARKER = "JAXRL_CACHE_CHECKPOINTS"  # present in every directory save_checkpoint manages
RESTORE_ATTEMPTS = 5  # a restore of the latest step retries this often while pruned under it


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, corrupted, or inconsistent with its version."""


def _payload(state: TrainState) -> dict:
    return dict(params=state.params, opt_state=state.opt_state, version=state.version)


def _layout(payload) -> list[list]:
    """[path, shape, dtype] of every leaf, in tree order."""
    return [[jax.tree_util.keystr(path), list(np.shape(leaf)),
             str(leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype)]
            for path, leaf in jax.tree_util.tree_leaves_with_path(payload)]


def _digest(payload) -> str:
    """blake2b of every leaf's dtype, shape and bytes in tree order (one leaf on the host at
    a time)."""
    h = hashlib.blake2b(digest_size=32)
    for leaf in jax.tree.leaves(payload):
        _hash_leaf(h, leaf)
    return h.hexdigest()


def _hash_leaf(h, leaf) -> None:
    a = np.ascontiguousarray(jax.device_get(leaf))
    h.update(f"{a.dtype}{a.shape}".encode())
    h.update(memoryview(a.reshape(-1).view(np.uint8)))  # the buffer itself, no bytes copy


_FINGERPRINT: list = []  # [(weakrefs to the base's leaves, fingerprint)]: the last base


def base_fingerprint(base: dict) -> str:
    """The digest of a base model's params (every leaf's dtype, shape and bytes in tree
    order), which a LoRA checkpoint records: equal iff the base weights are bitwise equal.
    One pass over the base; the fingerprint of the last base is cached while its very
    arrays live (jax arrays are immutable)."""
    leaves = jax.tree.leaves(base)
    if _FINGERPRINT and len(_FINGERPRINT[0][0]) == len(leaves) and all(
            ref() is leaf for ref, leaf in zip(_FINGERPRINT[0][0], leaves)):
        return _FINGERPRINT[0][1]
    digest = _digest(base)
    if all(isinstance(leaf, jax.Array) for leaf in leaves):
        _FINGERPRINT[:] = [([weakref.ref(leaf) for leaf in leaves], digest)]
    return digest


def _lora_dict(lora: LoraConfig | None) -> dict | None:
    """A LoraConfig as the JSON a step's metadata holds (None for full fine-tuning)."""
    return None if lora is None else dict(rank=lora.rank, alpha=lora.alpha,
                                          targets=list(lora.targets))


def _base_of(state: TrainState) -> str:
    """The fingerprint of a LoRA state's frozen base (the frozen part without its scale)."""
    return base_fingerprint({k: v for k, v in state.frozen.items() if k != SCALE})


def _lora_meta(state: TrainState) -> dict:
    """The metadata a LoRA step adds (none for full fine-tuning)."""
    if state.lora is None:
        return {}
    return dict(lora=_lora_dict(state.lora), base=_base_of(state))


def _describe(lora: dict | None) -> str:
    if lora is None:
        return "full fine-tuning params"
    return (f"LoRA adapters (rank {lora['rank']}, alpha {lora['alpha']:g}, targets "
            f"{','.join(lora['targets'])})")


def _check_kind(meta: dict, template: TrainState, where: pathlib.Path) -> None:
    """CheckpointError (one line) unless the step and the template are both full fine-tuning,
    or both LoRA with one LoraConfig over the same base (fingerprint)."""
    stored, wanted = meta.get("lora"), _lora_dict(template.lora)
    if stored != wanted:
        hint = ("restore it into a full fine-tuning TrainState (built without lora)"
                if stored is None else "build the template with TrainState.create(base, "
                "lora=checkpoint_lora_config(directory))")
        raise CheckpointError(f"checkpoint {where} holds {_describe(stored)}, the template "
                              f"trains {_describe(wanted)}: {hint}")
    if stored is not None and meta.get("base") != (base := _base_of(template)):
        raise CheckpointError(f"checkpoint {where} holds LoRA adapters of another base model "
                              f"(base fingerprint {str(meta.get('base'))[:12]}, the template's "
                              f"{base[:12]}): build the template over the base it was "
                              f"trained on")


class _OrbaxRecords(logging.Filter):
    """Drops log records emitted by orbax's code (it logs every failure with a traceback,
    from its background threads too, after the call has raised)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return f"{os.sep}orbax{os.sep}" not in record.pathname


_ORBAX_RECORDS = _OrbaxRecords()


class _ClosedLoopReports:
    """sys.unraisablehook that drops the "Event loop is closed" RuntimeErrors tensorstore's
    callbacks raise into a finished asyncio loop after a failed orbax write; passes on the
    rest."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable):
        e = unraisable.exc_value
        if not (isinstance(e, RuntimeError) and str(e) == "Event loop is closed"):
            self.previous(unraisable)


def _quiet() -> None:
    """Silences orbax for this process (idempotent): see the module doc."""
    for logger in (logging.getLogger("absl"), logging.getLogger()):
        if _ORBAX_RECORDS not in logger.filters:
            logger.addFilter(_ORBAX_RECORDS)
    if not isinstance(sys.unraisablehook, _ClosedLoopReports):
        sys.unraisablehook = _ClosedLoopReports(sys.unraisablehook)


def _directory(directory, *, create: bool) -> pathlib.Path | None:
    """The managed directory; None if it does not exist (or is empty and not created)."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path, got {type(directory).__name__}")
    path = pathlib.Path(directory).resolve()
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint directory")
    # One listing decides: a creator may write the marker between two separate looks.
    names = {p.name for p in path.iterdir()} if path.is_dir() else set()
    if MARKER in names:
        return path
    if any(not name.startswith(f".{MARKER}.") for name in names):
        raise CheckpointError(f"{path} is not empty and holds no jaxrl_cache checkpoints "
                              f"(no {MARKER} file); refusing to touch it")
    if not create:
        return None
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f".{MARKER}.{os.getpid()}.tmp"  # a concurrent creator writes its own
    tmp.write_text("orbax CheckpointManager directory; steps are policy versions\n")
    tmp.replace(path / MARKER)
    return path


def _claim(path: pathlib.Path) -> None:
    try:
        claim(path)
    except DirectoryInUse as e:
        raise CheckpointError(f"cannot save into {path}: it is in use by pid {e.pid}, its "
                              f"writer (one writer per checkpoint directory)") from None


SAVE_CONCURRENT_GB = 1  # a save writes at most this many GB of arrays at once


def _manager(path: pathlib.Path, max_to_keep: int | None = None, *,
             writer: bool = False) -> ocp.CheckpointManager:
    """The writer (it holds the lock) removes temporary directories of its own killed saves
    and prunes to max_to_keep; readers are read-only. The writer stores arrays uncompressed,
    SAVE_CONCURRENT_GB at a time: orbax's default (zstd, everything in flight at once) holds
    the encoded state beside it until the save ends, about one more copy of the state."""
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=False,
                                           enable_async_checkpointing=False,
                                           cleanup_tmp_directories=writer,
                                           read_only=not writer)
    handlers = dict(state=ocp.PyTreeCheckpointHandler(
        save_concurrent_gb=SAVE_CONCURRENT_GB, use_compression=False),
        meta=ocp.JsonCheckpointHandler()) if writer else None
    return ocp.CheckpointManager(path, options=options, item_names=("state", "meta"),
                                 item_handlers=handlers)


def _reader(path: pathlib.Path) -> ocp.CheckpointManager:
    """A read-only manager; rebuilt if the writer prunes a step while orbax lists the steps
    (FileNotFoundError; NotADirectoryError when the step directory vanished between orbax's
    exists() and is_dir()), up to RESTORE_ATTEMPTS times."""
    for attempt in range(1, RESTORE_ATTEMPTS + 1):
        try:
            return _manager(path)
        except (FileNotFoundError, NotADirectoryError):
            if attempt == RESTORE_ATTEMPTS:
                raise CheckpointError(f"{path}: steps kept disappearing while being listed "
                                      f"(a writer pruning faster than this reader)") from None


def save_checkpoint(directory, state: TrainState, *, max_to_keep: int = 3) -> pathlib.Path:
    """Saves `state` as step `state.version` of the checkpoint directory `directory` (created
    if missing), reads it back, and keeps the newest `max_to_keep` steps. Returns the step's
    path. The calling process becomes the directory's one writer (module doc).

    Versions are in the int32 range (see versioning). Refuses (CheckpointError, nothing
    written) a directory another live process writes to, a version older than the latest
    step, the same version with other contents, and a non-empty directory that is not a
    checkpoint directory. A step that does not read back as saved is deleted, then raised.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be a TrainState, got {type(state).__name__}")
    if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, (int, np.integer)) \
            or max_to_keep < 1:
        raise ValueError(f"max_to_keep must be a positive integer, got {max_to_keep!r}")
    version = as_version(state.version, "state.version")
    payload = _payload(state)
    meta = dict(version=version, digest=_digest(payload), layout=_layout(payload),
                **_lora_meta(state))
    path = _directory(directory, create=True)
    _claim(path)
    _quiet()
    with _manager(path, int(max_to_keep), writer=True) as mngr:
        latest = mngr.latest_step()
        if latest is not None and version < latest:
            raise CheckpointError(f"cannot save version {version} into {path}: it already "
                                  f"holds the newer version {latest}")
        if version in mngr.all_steps():
            stored = _read_meta(mngr, path, version)
            if any(stored.get(k) != meta.get(k) for k in ("digest", "lora", "base")):
                raise CheckpointError(f"{path} already holds version {version} with other "
                                      f"contents; a weight change needs a new version")
            return path / str(version)
        try:
            with deferred_signals():  # Ctrl-C lands after the step is finalized
                mngr.save(version, args=ocp.args.Composite(
                    state=ocp.args.PyTreeSave(payload), meta=ocp.args.JsonSave(meta)))
                mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - orbax raises many types
            # the failed save can leave orbax's write coroutines unawaited; the error below
            # says what happened, so Python's warning about them at exit is noise
            warnings.filterwarnings("ignore", r"coroutine .* was never awaited",
                                    RuntimeWarning)
            raise CheckpointError(f"saving version {version} into {path} failed: "
                                  f"{type(e).__name__}: {_first_line(e)}") from None
        try:
            if _read_meta(mngr, path, version) != meta:
                raise CheckpointError(f"checkpoint {path / str(version)} holds other metadata")
            if _stored_digest(path, version, payload) != meta["digest"]:
                raise CheckpointError(f"checkpoint {path / str(version)}'s arrays do not "
                                      f"match the saved state")
        except CheckpointError as e:
            mngr.delete(version)
            raise CheckpointError(f"saving version {version} into {path} failed: it does not "
                                  f"read back ({e}); the step was deleted") from None
    return path / str(version)


VERIFY_GROUP_BYTES = 64 * 2**20  # a save reads its step back in groups of leaves this big


def _leaf_groups(leaves: list) -> list[list[int]]:
    """Indices of consecutive leaves in groups of at most VERIFY_GROUP_BYTES (a bigger leaf
    alone)."""
    groups, size = [[]], 0
    for i, leaf in enumerate(leaves):
        nbytes = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        if groups[-1] and size + nbytes > VERIFY_GROUP_BYTES:
            groups, size = groups + [[]], 0
        groups[-1].append(i)
        size += nbytes
    return groups


def _stored_digest(path: pathlib.Path, step: int, template: dict) -> str:
    """`_digest` of a step's stored arrays, read back as numpy in groups of leaves
    (`_leaf_groups`, orbax's placeholder restore), so verifying a save holds one group beside
    the state instead of a second copy of it. `template`: the payload that was saved."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    leaves, treedef = jax.tree.flatten(abstract)
    h = hashlib.blake2b(digest_size=32)
    with _reader(path) as mngr:
        for group in _leaf_groups(leaves):
            chosen = set(group)
            item = treedef.unflatten([leaf if i in chosen else ocp.PLACEHOLDER
                                      for i, leaf in enumerate(leaves)])
            args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
            try:
                restored = mngr.restore(step, args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(item=item, restore_args=args)))["state"]
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"checkpoint {path / str(step)} is corrupted: "
                                      f"{type(e).__name__}: {_first_line(e)}") from None
            for leaf in jax.tree.leaves(restored):
                if leaf is not ocp.PLACEHOLDER:
                    _hash_leaf(h, leaf)
    return h.hexdigest()


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def _read_meta(mngr, path, step) -> dict:
    try:
        meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {path / str(step)} is unreadable: "
                              f"{type(e).__name__}: {_first_line(e)}") from None
    if not isinstance(meta, dict) or not {"version", "digest", "layout"} <= meta.keys():
        raise CheckpointError(f"checkpoint {path / str(step)} has no valid metadata")
    return meta


def _read_step(mngr, path: pathlib.Path, step: int, template: dict,
               state: TrainState | None = None) -> tuple[dict, dict]:
    """(payload, meta) of `step` read into the structure and layout of the payload
    `template`; CheckpointError if its metadata, layout or digest do not match, or (given
    the template `state`) the step is not of its kind: LoRA config and base (`_check_kind`)."""
    meta = _read_meta(mngr, path, step)
    if state is not None:
        _check_kind(meta, state, path / str(step))
    layout = _layout(template)
    if meta["layout"] != layout:
        diff = next(((a, b) for a, b in zip(meta["layout"], layout) if a != b),
                    (f"{len(meta['layout'])} leaves", f"{len(layout)} leaves"))
        raise CheckpointError(f"checkpoint {path / str(step)} does not match the template: "
                              f"stored {diff[0]}, template {diff[1]}")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    try:
        restored = mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract)))["state"]
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {path / str(step)} is corrupted: "
                              f"{type(e).__name__}: {_first_line(e)}") from None
    if _digest(restored) != meta["digest"]:
        raise CheckpointError(f"checkpoint {path / str(step)} is corrupted: its arrays do not "
                              f"match the stored digest")
    return restored, meta


def latest_checkpoint_version(directory) -> int | None:
    """The newest saved version in `directory`, or None if there is none (or no directory).
    CheckpointError if the directory exists but is not a checkpoint directory. Read-only."""
    path = _directory(directory, create=False)
    if path is None:
        return None
    _quiet()
    with _reader(path) as mngr:
        return mngr.latest_step()


def checkpoint_lora_config(directory, *, step: int | None = None) -> LoraConfig | None:
    """The LoraConfig step `step` (default: the latest) was trained with, None for a full
    fine-tuning step: what the template of `restore_checkpoint` needs. Read-only;
    CheckpointError if there is no such step."""
    path = _directory(directory, create=False)
    if path is None:
        raise CheckpointError(f"no checkpoint in {pathlib.Path(directory).resolve()}")
    _quiet()
    with _reader(path) as mngr:
        steps = mngr.all_steps()
        chosen = (max(steps) if steps else None) if step is None else as_version(step, "step")
        if chosen is None or chosen not in steps:
            raise CheckpointError(f"no {'checkpoint' if chosen is None else f'version {chosen}'}"
                                  f" in {path}")
        lora = _read_meta(mngr, path, chosen).get("lora")
    if lora is None:
        return None
    try:
        return LoraConfig(rank=lora["rank"], alpha=lora["alpha"], targets=tuple(lora["targets"]))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path / str(chosen)} has invalid LoRA metadata "
                              f"{lora!r:.200}: {_first_line(e)}") from None


def restore_checkpoint(directory, template: TrainState, *, step: int | None = None) -> TrainState:
    """Restores step `step` (default: the latest) into the structure of `template` (same
    model, optimizer and dtypes; its tx, schedule and config are kept). Read-only: it may
    run while another process saves (module doc).

    CheckpointError if there is no such step, the template's layout differs from the stored
    one, the arrays' digest does not match, or the optimizer update counts disagree with the
    version. LoRA: the template's LoraConfig and base (fingerprint) must be the step's, and
    a full fine-tuning step needs a full fine-tuning template (module doc); the template's
    frozen base is kept.
    """
    if not isinstance(template, TrainState):
        raise TypeError(f"template must be a TrainState, got {type(template).__name__}")
    path = _directory(directory, create=False)
    if path is None:
        raise CheckpointError(f"no checkpoint in {pathlib.Path(directory).resolve()}")
    _quiet()
    for attempt in range(1, RESTORE_ATTEMPTS + 1):
        with _reader(path) as mngr:
            steps = mngr.all_steps()
            if step is None and not steps:
                raise CheckpointError(f"no checkpoint in {path}")
            chosen = max(steps) if step is None else as_version(step, "step")
            if chosen not in steps:
                raise CheckpointError(f"no version {chosen} in {path}; it holds "
                                      f"{sorted(steps)}")
            try:
                restored, _ = _read_step(mngr, path, chosen, _payload(template), template)
                break
            except CheckpointError:
                # the writer may have pruned it while we read, after saving a newer step
                newer = latest_checkpoint_version(path)
                if step is not None or attempt == RESTORE_ATTEMPTS or newer is None \
                        or newer <= chosen:
                    raise
    version = int(np.asarray(restored["version"]))
    counts = optimizer_counts(restored["opt_state"])
    if version != chosen or any(c != version for c in counts):
        raise CheckpointError(f"checkpoint {path / str(chosen)} has version {version} but "
                              f"optimizer update counts {counts}; refusing an inconsistent "
                              f"state")
    return template.replace(params=restored["params"], opt_state=restored["opt_state"],
                            version=restored["version"])
