"""Task data in: rows (dicts) -> `Example(prompt, answer, row)`.

`prompts_from_rows` takes any sequence of mappings: a list of dicts, rows read from a JSONL
or JSON file (`read_rows`), or a `datasets.Dataset` (iterating one gives dicts; no
dependency on `datasets` here). A prompt is text or chat messages (a list of
`{"role", "content"}` mappings, TRL's conversational format), which the engine renders
with the model's chat template; `system_prompt` prepends a system message (a text prompt
becomes a user message after it). An answer is a string or a number: ints and integral
floats are written as integers (`72`, `72.0` -> "72"), other floats by `repr` (`0.5`);
bools, NaN and infinities are refused. A string answer holding `####` is GSM8K's (a
worked solution ending in `#### 1,000`): with `gsm8k_answers=True` (the default) the answer
is what follows the last `####`, stripped, commas removed (`gsm8k_answer`). With
`answer_key=None` the rows need no answer (a task scored by reward functions alone): every
Example's answer is None.

Errors are `RowError` (a ValueError) naming the row by its index (`RowError.index`), so a
caller that knows where rows came from (a file's line numbers) can say where. No jax here.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any, Iterable, Mapping


class RowError(ValueError):
    """A row that cannot be an Example; `index` is its position in the rows."""

    def __init__(self, index: int, detail: str):
        super().__init__(f"row {index}: {detail}")
        self.index, self.detail = index, detail


@dataclasses.dataclass(frozen=True)
class Example:
    """One task item: the prompt (text, or chat messages as a tuple of dicts), the answer
    as text (None: the task has none), and the row it came from (for rewards that read
    other fields; not compared)."""
    prompt: Any  # str | tuple[dict, ...]
    answer: str | None
    row: Mapping | None = dataclasses.field(default=None, compare=False, repr=False)


def hashable_prompt(prompt) -> str:
    """A hashable, canonical key of a prompt (text as is; chat messages as JSON)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def gsm8k_answer(text: str) -> str:
    """What follows the last '####' of a GSM8K solution, stripped, commas removed
    ('... #### 1,000' -> '1000'); `text` stripped when it holds no '####'."""
    if "####" not in text:
        return text.strip()
    return text.rsplit("####", 1)[1].strip().replace(",", "")


def canonical_answer(value, *, gsm8k_answers: bool = True) -> str:
    """An answer field as text (see the module doc); TypeError/ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError(f"expected a string or a number, got {type(value).__name__} "
                        f"{value!r:.60}")
    if isinstance(value, str):
        return gsm8k_answer(value) if gsm8k_answers else value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"expected a finite number, got {value!r}")
        if value.is_integer() and abs(value) < 2**53:
            return str(int(value))
        return repr(value)
    return str(value)


def _messages(value) -> tuple[dict, ...]:
    """Chat messages as a tuple of {"role": str, "content": str} dicts; TypeError else."""
    if not value:
        raise TypeError("expected text or chat messages, got an empty list")
    out = []
    for i, m in enumerate(value):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise TypeError(f"message {i} is not a {{\"role\": str, \"content\": str}} "
                            f"mapping: {m!r:.60}")
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


def prompts_from_rows(rows: Iterable[Mapping], *, prompt_key: str = "prompt",
                      answer_key: str | None = "answer", system_prompt: str | None = None,
                      gsm8k_answers: bool = True) -> list[Example]:
    """One Example per row, in order (see the module doc). Each row must be a mapping with
    `prompt_key` (text or chat messages) and `answer_key` (a string or a number; None: no
    answer); RowError naming the row and the field otherwise. `row` keeps the whole
    mapping."""
    examples = []
    keys = (prompt_key,) if answer_key is None else (prompt_key, answer_key)
    for index, row in enumerate(rows):
        expected = f"expected an object with field{'s' * (len(keys) > 1)} " + \
            " and ".join(map(repr, keys))
        if not isinstance(row, Mapping):
            raise RowError(index, f"{expected}, got {type(row).__name__} {row!r:.60}")
        missing = [k for k in keys if k not in row]
        if missing:
            which = "prompt" if missing[0] == prompt_key else "answer"
            raise RowError(index, f"{expected}; it has no {missing[0]!r} (its fields: "
                                  f"{', '.join(map(str, list(row)[:8])) or 'none'}; "
                                  f"--{which}-key chooses the {which} field)")
        try:
            prompt = row[prompt_key]
            if not isinstance(prompt, str):
                if isinstance(prompt, Mapping) or not isinstance(prompt, (list, tuple)):
                    raise TypeError(f"expected text or chat messages, got "
                                    f"{type(prompt).__name__} {prompt!r:.60}")
                prompt = _messages(prompt)
            if system_prompt is not None:
                turns = ({"role": "user", "content": prompt},) if isinstance(prompt, str) \
                    else prompt
                prompt = ({"role": "system", "content": system_prompt},) + turns
        except TypeError as e:
            raise RowError(index, f"{prompt_key!r}: {e}") from None
        try:
            answer = None if answer_key is None else canonical_answer(
                row[answer_key], gsm8k_answers=gsm8k_answers)
        except (TypeError, ValueError) as e:
            raise RowError(index, f"{answer_key!r}: {e}") from None
        examples.append(Example(prompt, answer, row))
    return examples


def read_rows(path) -> tuple[list, list[int]]:
    """(rows, the line each row starts on) of a UTF-8 JSONL file (one JSON value per line,
    blank lines skipped) or a JSON file holding a list (by content: a file whose first
    non-blank character is '[' and that parses whole). ValueError naming the file and line
    when it is missing, not UTF-8 or not valid JSON."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"--dataset {path}: no such file")
    data = path.read_bytes()
    if data.lstrip().startswith(b"["):
        try:
            rows = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            rows = None  # a JSONL file whose first line is a list: read it by lines
        if isinstance(rows, list):
            return rows, _row_lines(data.decode("utf-8"), len(rows))
    rows, lines = [], []
    for number, raw in enumerate(data.splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}:{number}: not UTF-8 text (byte "
                             f"0x{raw[e.start]:02x} at column {e.start + 1})") from None
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
        lines.append(number)
    return rows, lines


def _row_lines(text: str, count: int) -> list[int]:
    """The line each top-level element of a JSON list starts on (1 for all when the
    decoder cannot find them)."""
    decoder, lines, pos = json.JSONDecoder(), [], text.index("[") + 1
    try:
        for _ in range(count):
            while text[pos] in " \t\r\n,":
                pos += 1
            lines.append(text.count("\n", 0, pos) + 1)
            _, pos = decoder.raw_decode(text, pos)
    except (IndexError, json.JSONDecodeError):
        return [1] * count
    return lines
