"""Joining a multi-process (multi-host) run: JAX's multi-controller runtime, nothing of ours.

Every process runs the same program; after `initialize_from_env`, `jax.devices()` lists the
devices of all processes and meshes built from it span hosts. Call it before any other jax
call.
"""
from __future__ import annotations

import os
from typing import Mapping

import jax

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def initialize_from_env(env: Mapping[str, str] = os.environ) -> bool:
    """Joins the run described by JAX_COORDINATOR_ADDRESS (host:port of process 0),
    JAX_NUM_PROCESSES and JAX_PROCESS_ID; returns False (one process, nothing done) when
    JAX_COORDINATOR_ADDRESS is unset. CPU collectives go over gloo; GPUs use NCCL as always.
    """
    if "JAX_COORDINATOR_ADDRESS" not in env:
        return False
    missing = [k for k in ENV if k not in env]
    if missing:
        raise ValueError(f"JAX_COORDINATOR_ADDRESS is set but {missing} are not")
    count, index = int(env["JAX_NUM_PROCESSES"]), int(env["JAX_PROCESS_ID"])
    if not 0 <= index < count:
        raise ValueError(f"JAX_PROCESS_ID={index} is outside [0, JAX_NUM_PROCESSES={count})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
                               num_processes=count, process_id=index)
    return True
