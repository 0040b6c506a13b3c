"""The environment protocol of multi-turn episodes (`RolloutEngine.rollout_episodes`).

An environment is created per episode from its task (`env_factory(task)`). `reset()` gives
the first observation; after each assistant turn `step(text)` gets that turn's text (cut
at the stop string or token that ended it, special tokens dropped; its token ids when the
engine has no tokenizer) and returns an EnvStep.
The environment, not the engine, parses tool calls out of the text.

Observations are a str (encoded with the engine's tokenizer, no special tokens added), a
sequence of token ids, or, for the first one only, chat messages (rendered with the chat
template and its generation prompt). A later observation of a chat model carries its own
role markers (e.g. the end of the assistant turn and the start of the next one).

Environment calls are host Python on daemon worker threads and may be slow, hang or raise:
anything raised (SystemExit and KeyboardInterrupt included), a missing method or an invalid
answer ends that episode (finish_reason "error", the type and message kept), never the
batch; what they return is read on the same thread. A call past `env_timeout` ends its
episode; its thread stays parked until the call returns (its answer is then dropped) and
never keeps the process from exiting.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence, Union

Observation = Union[str, Sequence[int], Sequence[dict]]


@dataclasses.dataclass(frozen=True)
class EnvStep:
    observation: str | Sequence[int] | None  # appended to the history before the next
    #                                          turn; None: no further turn
    reward: float = 0.0
    done: bool = False  # True: the episode ends here (the observation is then ignored)


class Environment(Protocol):
    def reset(self) -> Observation:
        """The first observation of the episode."""

    def step(self, action: str) -> EnvStep:
        """The environment's answer to one assistant turn."""
