"""`jaxrl-cache demo --mesh trainer=T,engine=E`: trainer and engine on disjoint device sets.

trainer=F is an FSDP axis of F devices, trainer=DxF a data x fsdp mesh of D*F devices
(the family's `train_rules`, `models.sharding`: params and Adam moments sharded, batches
split over data x fsdp);
engine=E is a tensor-parallel axis of E devices (`RolloutEngine(mesh=...)`). The trainer
takes the first D*F devices, the engine the next E. Each weight sync reshards a copy of the
trainer's params into the engine's layout; on disjoint sets every resident byte crosses
devices. The SFT warm start stays on the first device (it runs before the trainer exists).
"""
from __future__ import annotations

import dataclasses
import re

import jax
from jax.sharding import Mesh

from jaxrl_cache import parallel
from jaxrl_cache.models import ModelConfig
from jaxrl_cache.models.sharding import kv_layout
from jaxrl_cache.rl.batch import TrainBatch
from jaxrl_cache.rl.train import TrainState, train_step

_PART = re.compile(r"(trainer)=(?:(\d+)x)?(\d+)|(engine)=(\d+)")
SYNTAX = "trainer=F or trainer=DxF (data x fsdp devices), engine=E (tensor devices)"


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """Axis sizes of the two meshes: trainer data x fsdp, engine tensor."""
    data: int
    fsdp: int
    tensor: int

    @classmethod
    def parse(cls, text: str) -> "MeshLayout":
        """'trainer=4,engine=4' or 'trainer=2x2,engine=4' (either order); ValueError naming
        --mesh otherwise."""
        sizes: dict[str, tuple[int, ...]] = {}
        for part in str(text).replace(" ", "").split(","):
            match = _PART.fullmatch(part)
            if match is None:
                raise ValueError(f"--mesh {text!r}: cannot read {part!r}; expected {SYNTAX}, "
                                 f"e.g. trainer=4,engine=4")
            name = match[1] or match[4]
            if name in sizes:
                raise ValueError(f"--mesh {text!r}: {name} given twice")
            sizes[name] = (int(match[2] or 1), int(match[3])) if match[1] else (int(match[5]),)
        if set(sizes) != {"trainer", "engine"}:
            raise ValueError(f"--mesh {text!r}: needs both trainer and engine ({SYNTAX})")
        (data, fsdp), (tensor,) = sizes["trainer"], sizes["engine"]
        if min(data, fsdp, tensor) < 1:
            raise ValueError(f"--mesh {text!r}: every size must be >= 1")
        return cls(data, fsdp, tensor)

    def __str__(self) -> str:
        trainer = f"{self.data}x{self.fsdp}" if self.data > 1 else str(self.fsdp)
        return f"trainer={trainer},engine={self.tensor}"

    def check_devices(self, available: int) -> None:
        """ValueError naming --mesh unless `available` devices hold both meshes."""
        need = self.data * self.fsdp + self.tensor
        if need > available:
            raise ValueError(
                f"--mesh {self}: needs {self.data * self.fsdp} + {self.tensor} devices, "
                f"{available} available (on CPU, start with XLA_FLAGS="
                f"--xla_force_host_platform_device_count={need})")

    def build(self, config: ModelConfig, state: TrainState, samples_per_step: int,
              devices=None) -> "MeshPlacement":
        """Both meshes over `devices` (default: all); ValueError naming --mesh when there are
        too few devices, the model does not divide over an axis (`state` gives the leaves) or
        a step's samples do not split over the trainer's devices."""
        devices = list(jax.devices() if devices is None else devices)
        self.check_devices(len(devices))
        trainer_n = self.data * self.fsdp
        if samples_per_step % trainer_n:
            raise ValueError(f"--mesh {self}: a step's {samples_per_step} samples (--prompts-"
                             f"per-step x --group-size) do not split over the trainer's "
                             f"{trainer_n} devices")
        trainer = parallel.make_mesh({parallel.DATA: self.data, parallel.FSDP: self.fsdp},
                                     devices[:trainer_n])
        engine = parallel.make_mesh({parallel.TENSOR: self.tensor},
                                    devices[trainer_n:trainer_n + self.tensor])
        try:
            kv_layout(config, self.tensor)
            state_shardings = parallel.train_state_shardings(state, trainer)
            engine_shardings = parallel.rollout_shardings(state.params, config, engine)
        except ValueError as e:
            raise ValueError(f"--mesh {self}: {e}") from None
        return MeshPlacement(trainer, engine, state_shardings, engine_shardings)


@dataclasses.dataclass(frozen=True)
class MeshPlacement:
    """The demo's branch points on a mesh: where the state, batches and engine live."""
    trainer: Mesh
    engine: Mesh
    state_shardings: TrainState
    engine_shardings: dict  # the params' layout inside the engine

    def describe(self) -> str:
        ids = lambda mesh: [d.id for d in mesh.devices.flat]
        axes = lambda mesh: " x ".join(f"{k} {v}" for k, v in mesh.shape.items())
        return (f"trainer: {axes(self.trainer)} on devices {ids(self.trainer)}; "
                f"engine: {axes(self.engine)} on devices {ids(self.engine)}")

    def place_state(self, state: TrainState) -> TrainState:
        return jax.device_put(state, self.state_shardings)

    def train_step(self, state: TrainState, batch: TrainBatch, **kwargs):
        """`rl.train.train_step` with the batch's rows split over the trainer's devices."""
        return train_step(state, batch, mesh=self.trainer, **kwargs)

    def engine_kwargs(self) -> dict:
        return dict(mesh=self.engine)

    def sync_bytes(self, params) -> int:
        """Bytes a sync of `params` (trainer layout) moves across devices into the engine."""
        return parallel.transfer_bytes(params, self.engine_shardings)[0]
