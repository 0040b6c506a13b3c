"""The calculator environment: 3-digit multiplication with a written calculator tool.

An episode, as the character tokenizer sees it (<eos> ends each assistant turn):

    q:123*456=            question (the first observation; the engine prepends <bos>)
    c:123*456<eos>        turn 1: a tool call
     =56088 a:            the environment's answer (an observation, never trained on)
    56088<eos>            turn 2: the final answer -> reward 1.0, done

A turn is read after stripping surrounding whitespace:
- a tool call `c:<int><op><int>`, op one of + - *, operands of at most
  `MAX_OPERAND_DIGITS` ASCII digits with an optional leading minus, spaces allowed around
  the operator: the observation `" =<result> a:"`, reward 0, not done. The call beyond
  `max_tool_calls` ends the episode instead (reward 0, outcome "too_many_calls");
- a final answer: an integer of at most `MAX_ANSWER_DIGITS` digits (optional minus, leading
  zeros allowed), after a tool result or directly: reward 1.0 if it equals the product
  else 0.0, done (outcome "answer");
- anything else is malformed: reward 0, done (outcome "malformed"; no retry).
Nothing is evaluated as Python: expressions are parsed by one anchored regex of bounded
length, so `step` never raises on any text.

`CalculatorTask` draws questions with both operands in [10**(d-1), 10**d); an unordered
operand pair is held out for evaluation with probability `eval_fraction` (a fixed seeded
split, so `a*b` and `b*a` fall on the same side): `sample` never returns a held-out pair,
`eval_examples` only those. `tool_sft_pairs` gives the warm start's (prompt, completion)
token pairs of both turns for `rl.sft.pack_completions`.
"""
from __future__ import annotations

import dataclasses
import operator
import re
from typing import Sequence

import numpy as np

from jaxrl_cache.app.tasks import Example, Reward
from jaxrl_cache.rollout.env import EnvStep

MAX_OPERAND_DIGITS = 6
MAX_ANSWER_DIGITS = 2 * MAX_OPERAND_DIGITS
TOOL_PREFIX = "c:"  # short: the copy of the operands sits closer to the question
ANSWER_CUE = " a:"
_INT = rf"-?[0-9]{{1,{MAX_OPERAND_DIGITS}}}"
_CALL = re.compile(rf"{re.escape(TOOL_PREFIX)}({_INT}) *([+*-]) *({_INT})", re.ASCII)
_QUESTION = re.compile(rf"[^0-9]*?({_INT})([+*-])({_INT})=", re.ASCII)
_ANSWER = re.compile(rf"-?[0-9]{{1,{MAX_ANSWER_DIGITS}}}", re.ASCII)
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def parse_call(text: str) -> tuple[int, str, int] | None:
    """(left, op, right) of a tool-call turn, or None if `text` (stripped) is not one."""
    match = _CALL.fullmatch(text.strip())
    if match is None:
        return None
    return int(match[1]), match[2], int(match[3])


def parse_answer(text: str) -> int | None:
    """The integer of a final-answer turn, or None if `text` (stripped) is not one."""
    match = _ANSWER.fullmatch(text.strip())
    return None if match is None else int(match[0])


def tool_call_text(left: int, op: str, right: int) -> str:
    return f"{TOOL_PREFIX}{left}{op}{right}"


def tool_result_text(value: int) -> str:
    return f" ={value}{ANSWER_CUE}"


class CalculatorEnv:
    """One episode on `example` (`example.answer` is the product as decimal text); see the
    module doc. `tool_calls` counts the well-formed calls answered (the one refused past
    `max_tool_calls` is not counted); `outcome` is None until done, then "answer",
    "malformed" or "too_many_calls"; `reward` is the final reward."""

    def __init__(self, example: Example, max_tool_calls: int = 2):
        self.example = example
        self.max_tool_calls = max_tool_calls
        self.tool_calls = 0
        self.outcome: str | None = None
        self.reward = 0.0

    def reset(self) -> str:
        return self.example.prompt

    def step(self, action: str) -> EnvStep:
        if self.outcome is not None:
            raise RuntimeError("step() after the episode ended")
        call = parse_call(action)
        if call is not None:
            if self.tool_calls == self.max_tool_calls:
                return self._end("too_many_calls", 0.0)
            self.tool_calls += 1
            left, op, right = call
            return EnvStep(tool_result_text(_OPS[op](left, right)))
        answer = parse_answer(action)
        if answer is None:
            return self._end("malformed", 0.0)
        return self._end("answer", float(answer == int(self.example.answer)))

    def _end(self, outcome: str, reward: float) -> EnvStep:
        self.outcome, self.reward = outcome, reward
        return EnvStep(None, reward, done=True)


def tool_use_summary(envs: Sequence[CalculatorEnv]) -> dict:
    """Over a batch of episodes: mean tool calls, the fraction that called the tool at least
    once, the fraction ended by each outcome (unfinished ones count in none), mean reward."""
    n = max(len(envs), 1)
    out = dict(tool_calls_mean=sum(e.tool_calls for e in envs) / n,
               tool_use_rate=sum(e.tool_calls > 0 for e in envs) / n,
               reward_mean=sum(e.reward for e in envs) / n)
    for outcome in ("answer", "malformed", "too_many_calls"):
        out[f"{outcome}_rate"] = sum(e.outcome == outcome for e in envs) / n
    return out


@dataclasses.dataclass(frozen=True)
class CalculatorTask:
    """'q:123*456=' -> '56088' (see the module doc for the split)."""
    num_digits: int = 3
    eval_fraction: float = 0.1
    split_seed: int = 0
    prefix: str = "q:"
    reward: Reward = Reward()  # single-turn scoring of a direct answer (no tool)

    name = "calculator"
    has_answers = True

    def __post_init__(self):
        if not 1 <= self.num_digits <= MAX_OPERAND_DIGITS:
            raise ValueError(f"num_digits must be in [1, {MAX_OPERAND_DIGITS}], got "
                             f"{self.num_digits}")
        if isinstance(self.split_seed, bool) or not isinstance(self.split_seed, int) \
                or self.split_seed < 0:
            raise ValueError(f"split_seed must be an integer >= 0, got {self.split_seed!r}")
        if re.search(r"[0-9]", self.prefix) or self.prefix.endswith("-"):
            raise ValueError(f"prefix must hold no digit and not end with '-', got "
                             f"{self.prefix!r}")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")

    @property
    def low(self) -> int:
        return 10 ** (self.num_digits - 1)

    def held_out(self, left, right):
        """bool array: whether each operand pair (int arrays of one shape) is held out: a
        splitmix64 hash of (split_seed, min, max) mapped to [0, 1) below eval_fraction."""
        lo = np.minimum(left, right).astype(np.uint64)
        hi = np.maximum(left, right).astype(np.uint64)
        with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as intended
            key = np.uint64(self.split_seed) * np.uint64(1 << 42) + (lo << np.uint64(21)) + hi
            return (_splitmix64(key) >> np.uint64(11)) < np.uint64(self.eval_fraction * 2**53)

    def example(self, left: int, right: int) -> Example:
        return Example(f"{self.prefix}{left}*{right}=", str(left * right))

    def sample(self, rng: np.random.Generator, count: int) -> list[Example]:
        return self._draw(rng, count, held=False)

    def eval_examples(self, rng: np.random.Generator, count: int) -> list[Example]:
        return self._draw(rng, count, held=True)

    def _draw(self, rng: np.random.Generator, count: int, *, held: bool) -> list[Example]:
        """`count` uniform draws (with replacement) from one side of the split, by rejection."""
        pairs = np.zeros((0, 2), np.int64)
        while len(pairs) < count:
            draw = rng.integers(self.low, 10 * self.low, (2 * count + 16, 2))
            pairs = np.concatenate([pairs, draw[self.held_out(draw[:, 0], draw[:, 1]) == held]])
        return [self.example(int(a), int(b)) for a, b in pairs[:count]]


def _splitmix64(x):
    """uint64 array -> uint64 array of the same shape (the splitmix64 finaliser; wraps)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def parse_question(text: str) -> tuple[int, str, int] | None:
    """(left, op, right) of a question '<prefix><int><op><int>=', or None."""
    match = _QUESTION.fullmatch(text)
    return None if match is None else (int(match[1]), match[2], int(match[3]))


def tool_sft_pairs(examples: Sequence[Example], tokenizer) -> tuple[list, list]:
    """(prompts, completions): two token-id pairs per example, in order, for the warm start.

    Turn 1: encode(question) -> call + stop. Turn 2: encode(question) + call + stop +
    observation -> answer + stop. The call copies the question's operands; the stop id is
    the tokenizer's first; texts after the question are encoded without special tokens, as
    the engine appends sampled turns and observations."""
    stop = list(tokenizer.stop_token_ids[:1])
    prompts, completions = [], []
    for e in examples:
        call = parse_question(e.prompt)
        if call is None:
            raise ValueError(f"not a calculator question: {e.prompt!r}")
        question = tokenizer.encode(e.prompt)
        turn1 = tokenizer.encode(tool_call_text(*call), add_special_tokens=False) + stop
        observation = tokenizer.encode(tool_result_text(_OPS[call[1]](call[0], call[2])),
                                       add_special_tokens=False)
        prompts += [question, question + turn1 + observation]
        completions += [turn1, tokenizer.encode(e.answer, add_special_tokens=False) + stop]
    return prompts, completions
