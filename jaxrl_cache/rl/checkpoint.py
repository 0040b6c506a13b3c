"""Checkpoints of a TrainState (params, optimizer state, version) with orbax."""
from __future__ import annotations

import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrl_cache.rl.train import TrainState, optimizer_counts


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, or inconsistent with its version."""


def _payload(state: TrainState) -> dict:
    return dict(params=state.params, opt_state=state.opt_state, version=state.version)


def save_checkpoint(path, state: TrainState) -> pathlib.Path:
    """Writes `state` to the directory `path` (replaced if it exists); returns the path."""
    path = pathlib.Path(path).resolve()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, _payload(state), force=True)
        ckptr.wait_until_finished()
    return path


def restore_checkpoint(path, template: TrainState) -> TrainState:
    """Restores into the structure of `template` (same model and optimizer).

    Refuses a checkpoint whose optimizer update counts disagree with its version.
    """
    path = pathlib.Path(path).resolve()
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _payload(template))
    with ocp.StandardCheckpointer() as ckptr:
        try:
            restored = ckptr.restore(path, abstract)
        except Exception as e:  # orbax raises several types for structure mismatches
            raise CheckpointError(f"checkpoint at {path} does not match the template: {e}") from e
    version = int(np.asarray(restored["version"]))
    counts = optimizer_counts(restored["opt_state"])
    if any(c != version for c in counts):
        raise CheckpointError(f"checkpoint at {path} has version {version} but optimizer "
                              f"update counts {counts}; refusing an inconsistent state")
    return template.replace(params=restored["params"], opt_state=restored["opt_state"],
                            version=restored["version"])
