"""Demo tasks: text prompts with reference answers and a verifiable reward on decoded text.

A task hands out `Example(prompt, answer)` pairs; the reward compares a decoded completion
with the answer:

- exact match (default): 1.0 if the completion equals the answer, both stripped of
  surrounding whitespace, else 0.0;
- with `answer_regex`: the last match of the regex in the completion (its first group that
  took part in the match, else the whole match) is compared the same way; no match scores
  0.0. GSM8K-style tasks use e.g. `####\\s*(-?[\\d,.]+)`;
- `check="numeric"` (the demo's default for a task file) compares the final answer (the
  regex's match, else the last `\\boxed{}` / `####`) with the answer as numbers (`72.`,
  `1,000`, `3/4`, `\\frac{3}{4}`), `check="math-verify"` through math-verify (the `math`
  extra): `rl.answers`.

`DatasetTask` reads the rows of `--dataset` (`dataset_source.read_dataset`: a JSONL, JSON
or parquet file, a `save_to_disk` directory, a Hub name) and holds every 4th example out
of training for evaluation; `CopyDigits` is the built-in task of `jaxrl-cache demo`
(generated, unlimited). A task's `sample` draws training examples, its
`eval_examples` the evaluation's. `char_tokenizer` builds the character-level tokenizer the
demo's own model uses.
"""
from __future__ import annotations

import dataclasses
import re
import string
from typing import Mapping

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from jaxrl_cache.data import Example, RowError, hashable_prompt, prompts_from_rows
from jaxrl_cache.dataset_source import read_dataset
from jaxrl_cache.models import Tokenizer
from jaxrl_cache.rl.answers import answer_score, check_answer_check

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0..3


@dataclasses.dataclass(frozen=True)
class Reward:
    """The (regex-extracted) completion's answer checked against the reference by `check`
    (`rl.answers.answer_score`); see the module doc."""
    answer_regex: str | None = None
    check: str = "exact"  # rl.answers.CHECKS: "exact", "numeric", "math-verify"

    def __post_init__(self):
        if self.answer_regex is not None:
            try:
                re.compile(self.answer_regex)
            except re.error as e:
                raise ValueError(f"--answer-regex {self.answer_regex!r} is not a valid "
                                 f"regular expression: {e}") from None
        try:
            check_answer_check(self.check)
        except ValueError as e:
            raise ValueError(f"--answer-check: {e}") from None

    def __call__(self, completion: str, answer: str) -> float | None:
        """1.0 or 0.0; None when math-verify cannot read the answer (not applicable)."""
        return answer_score(completion, answer, check=self.check,
                            answer_regex=self.answer_regex)


@dataclasses.dataclass(frozen=True)
class CopyDigits:
    """'number: 4821=' -> '4821'. Every prompt starts with the same instruction (the
    radix cache serves it); the n samples of a group share the whole prompt. Deliberately
    easy for a small transformer (an attention copy at a fixed offset): a short supervised
    warm start gets part of the way, GRPO on exact match does the rest. (A longer
    instruction, or more text between the number and its copy, slows the small model's warm
    start markedly: the copy offset is then harder to find.)"""
    num_digits: int = 4
    instruction: str = "number: "
    reward: Reward = Reward()

    name = "copy-digits"
    has_answers = True

    def sample(self, rng: np.random.Generator, count: int) -> list[Example]:
        digits = rng.integers(0, 10, (count, self.num_digits))
        numbers = ["".join(map(str, d)) for d in digits]
        return [Example(f"{self.instruction}{x}=", x) for x in numbers]

    def eval_examples(self, rng: np.random.Generator, count: int) -> list[Example]:
        """Fresh draws (of 10**num_digits numbers; not held out from training)."""
        return self.sample(rng, count)


class DatasetTask:
    """Examples from the rows `spec` names (`read_dataset(spec, split=, config=)`), each
    with a prompt (text or chat messages) at `prompt_key` and an answer (a string or a
    number; GSM8K's "... #### N" gives N) at `answer_key` (`data.prompts_from_rows`, with
    `system_prompt`); `where(i)` is the place of `examples[i]` (a file's line).

    Answers: the task has them (`has_answers`) when the first row has `answer_key`; then
    every row needs one. Without them (a task scored by reward functions alone, allowed
    only with `answers_required=False`) every answer is None and nothing is held out.

    Held out for evaluation (with answers): every 4th example counted from the last
    (`examples[n-1], examples[n-5], ...`: ceil(n/4) of n; the 4th, 8th, ..., 60th of 60).
    `train` is the rest less any example whose prompt is also held out (so no evaluated
    prompt is ever trained on); it must not be empty. `sample` draws `train` uniformly with
    replacement; `eval_examples` is a seeded permutation of `held_out`, repeated to
    `count`. Errors name the dataset and the row's place."""

    def __init__(self, spec, reward: Reward = Reward(), *, prompt_key: str = "prompt",
                 answer_key: str = "answer", system_prompt: str | None = None,
                 split: str | None = None, config: str | None = None,
                 answers_required: bool = True):
        self.spec, self.reward = str(spec), reward
        data = read_dataset(self.spec, split=split, config=config)
        self.name, self.where = data.name, data.where
        first = data.rows[0]
        self.has_answers = not isinstance(first, Mapping) or answer_key in first
        if answers_required and not self.has_answers:
            raise ValueError(f"{self.where(0)}: no {answer_key!r} field (its fields: "
                             f"{', '.join(map(str, list(first)[:8]))}): the answer reward "
                             f"needs one (--answer-key chooses it); a task without answers "
                             f"needs --reward functions")
        try:
            self.examples = prompts_from_rows(
                data.rows, prompt_key=prompt_key, system_prompt=system_prompt,
                answer_key=answer_key if self.has_answers else None)
        except RowError as e:
            raise ValueError(f"{self.where(e.index)}: {e.detail}") from None
        n = len(self.examples)
        self.held_out = [e for i, e in enumerate(self.examples)
                         if self.has_answers and (n - 1 - i) % 4 == 0]
        held = {hashable_prompt(e.prompt) for e in self.held_out}
        self.train = [e for e in self.examples if hashable_prompt(e.prompt) not in held]
        if not self.train:
            raise ValueError(f"--dataset {self.spec}: no examples left to train on once "
                             f"every 4th is held out for evaluation (needs 2 distinct "
                             f"prompts)")

    def sample(self, rng: np.random.Generator, count: int) -> list[Example]:
        return [self.train[i] for i in rng.integers(0, len(self.train), count)]

    def eval_examples(self, rng: np.random.Generator, count: int) -> list[Example]:
        order = np.resize(rng.permutation(len(self.held_out)), count)
        return [self.held_out[i] for i in order]


def char_tokenizer() -> Tokenizer:
    """One token per printable ASCII character (and newline), after <pad> <bos> <eos> <unk>.

    Encoding prepends <bos>; decoding joins characters and drops the special tokens; <eos>
    is the stop token. Saved beside the model it is an ordinary Hugging Face tokenizer.json.
    """
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {token: i for i, token in enumerate(list(SPECIALS) + chars)}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"),
                                                 behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIALS))
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    config = dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                  tokenizer_class="PreTrainedTokenizerFast")
    return Tokenizer(backend, config, None, [vocab["<eos>"]])
