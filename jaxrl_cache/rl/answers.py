"""Final answers of math-style completions: extraction and comparison. Dependency-free but
for the optional math-verify check (the `math` extra).

- `final_answer(text)`: the content of the last `\\boxed{...}` / `\\fbox{...}` (braces
  balanced) or the rest of the line after the last `####`, whichever comes later; None if
  neither.
- `parse_number(text)`: an exact `Fraction`, or None. Read: surrounding whitespace and `$`
  math delimiters, a trailing period, a leading `+` / `-` / unicode minus, a currency `$`,
  thousands separators in groups of three (`1,000`, MATH's `10,\\!000` and `1{,}000`),
  decimals (`0.50`, `.5`, `72.`), exponents of up to 3 digits (`1e3`), fractions `a/b`
  and `\\frac{a}{b}` (`\\dfrac`, `\\tfrac`, MATH's `\\frac34`). Nothing else (units,
  words, `1,00`) is a number.
- `answer_score(completion, reference, check=, answer_regex=)` -> 1.0, 0.0 or None (the
  reference cannot be read; math-verify only). The checks (`CHECKS`):
  - "exact": the completion (or the regex's last match: its first group that took part
    in the match, else the whole match) equals the reference, both stripped; no match
    scores 0.0;
  - "numeric": the candidate is the regex's last match, else `final_answer`, else the
    whole completion; the reference is its own `final_answer` (a GSM8K solution ends in
    `#### 72`) or itself. Equal as numbers when both parse (exactly: 1/3 != 0.333), else as
    strings with whitespace, `$` and a trailing period removed;
  - "math-verify": `math_verify.verify` of the two parsed, each `$...$`-wrapped (the raw
    completion when it has no final answer: math-verify finds one itself); on the main
    thread with math-verify's own 5 s timeouts, on another without (its timeouts use
    signals; bound it with RewardFn.timeout).
- `answer_reward(check, ...)`: a batched (TRL-shaped) RewardFn reading an answer column.
"""
from __future__ import annotations

import importlib.util
import re
import threading
from fractions import Fraction

from jaxrl_cache.rl.rewards import RewardFn

CHECKS = ("exact", "numeric", "math-verify")
MATH_VERIFY_TIMEOUT_S = 5  # math-verify's own timeouts, main thread only

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_PLAIN = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,3})?")  # no 1e999999999
_GROUPED = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d*)?")
_FRAC = re.compile(r"\\[dt]?frac\s*(?:\{([^{}]+)\}|(\d))\s*(?:\{([^{}]+)\}|(\d))")  # \frac34


def check_answer_check(check: str) -> str:
    """`check` if it is one of CHECKS and usable here; ValueError of one line otherwise
    (math-verify not installed included)."""
    if check not in CHECKS:
        raise ValueError(f"the answer check must be one of {', '.join(CHECKS)}; got {check!r}")
    if check == "math-verify" and importlib.util.find_spec("math_verify") is None:
        raise ValueError("the math-verify answer check needs the math-verify package: "
                         "pip install 'jaxrl-cache[math]'")
    return check


_BRACES = re.compile(_BOX.pattern + r"|[{}]")


def final_answer(text: str) -> str | None:
    """The last `\\boxed{...}` / `\\fbox{...}` content or `#### ...` line, whichever is
    later (see the module doc). One pass over the braces: linear in the text, however many
    boxes are left unclosed."""
    boxed, opened = None, []  # opened: (box start, content start) or None per open brace
    for m in _BRACES.finditer(text):
        if m.group() == "}":
            if opened and (box := opened.pop()) is not None:
                if boxed is None or box[0] > boxed[0]:
                    boxed = (box[0], text[box[1]:m.start()].strip())
        else:
            opened.append((m.start(), m.end()) if m.group() != "{" else None)
    hashes = text.rfind("####")
    if hashes >= 0 and (boxed is None or hashes > boxed[0]):
        return text[hashes + 4:].split("\n", 1)[0].strip()
    return None if boxed is None else boxed[1]


def parse_number(text: str) -> Fraction | None:
    """`text` as an exact number, or None (what is read: the module doc)."""
    s = text.strip()
    if len(s) >= 2 and s[0] == s[-1] == "$":
        s = s[1:-1].strip()
    s = s.rstrip(".").replace("\\!", "").replace("{,}", ",").replace("\u2212", "-")
    sign = -1 if s[:1] == "-" else 1
    s = s[1:].lstrip() if s[:1] in ("+", "-") else s
    s = s[1:].lstrip() if s[:1] == "$" else s  # currency
    if m := _FRAC.fullmatch(s):
        parts = [_real(m.group(1) or m.group(2)), _real(m.group(3) or m.group(4))]
    elif s.count("/") == 1:
        parts = [_real(p) for p in s.split("/")]
    else:
        value = _real(s, signed=False)
        return None if value is None else sign * value
    if None in parts or parts[1] == 0:
        return None
    return sign * parts[0] / parts[1]


def _real(s: str, signed: bool = True) -> Fraction | None:
    """A plain or thousands-grouped decimal (with a sign if `signed`), or None."""
    s = s.strip()
    negative = signed and s[:1] == "-"
    s = s[1:].strip() if signed and s[:1] in ("+", "-") else s
    if _GROUPED.fullmatch(s):
        s = s.replace(",", "")
    if not _PLAIN.fullmatch(s):
        return None
    try:
        value = Fraction(s)
    except ValueError:  # past int's 4300-digit limit
        return None
    return -value if negative else value


def _squash(s: str) -> str:
    """A non-numeric answer for comparison: whitespace and `$` removed, no final period."""
    return re.sub(r"[\s$]", "", s).rstrip(".")


def _regex_answer(completion: str, answer_regex: str) -> str | None:
    matches = list(re.finditer(answer_regex, completion))
    if not matches:
        return None
    last = matches[-1]  # its first group that took part, else the whole match
    taking_part = [g for g in last.groups() if g is not None]
    return (taking_part[0] if taking_part else last.group(0)).strip()


def answer_score(completion: str, reference: str, *, check: str = "numeric",
                 answer_regex: str | None = None) -> float | None:
    """1.0 if the completion's answer matches the reference under `check`, else 0.0; None
    when math-verify cannot read the reference (not applicable, as TRL's accuracy
    reward)."""
    if check == "exact":
        got = completion.strip() if answer_regex is None else \
            _regex_answer(completion, answer_regex)
        return float(got is not None and got == reference.strip())
    got = _regex_answer(completion, answer_regex) if answer_regex is not None else \
        final_answer(completion)
    if got is None and answer_regex is not None:
        return 0.0
    gold = final_answer(reference)
    gold = reference.strip() if gold is None else gold
    if check == "math-verify":
        return _math_verify(completion if got is None else f"${got}$", f"${gold}$")
    got = completion.strip() if got is None else got
    a, b = parse_number(got), parse_number(gold)
    if a is not None and b is not None:
        return float(a == b)
    return float(_squash(got) == _squash(gold) != "")


def _math_verify(candidate: str, gold: str) -> float | None:
    from math_verify import parse, verify
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is \
        threading.main_thread() else None
    gold_parsed = parse(gold, parsing_timeout=timeout)
    if not gold_parsed:
        return None
    return float(verify(gold_parsed, parse(candidate, parsing_timeout=timeout),
                        timeout_seconds=timeout))


def answer_reward(check: str = "numeric", *, answer_regex: str | None = None,
                  column: str = "answer", **fields) -> RewardFn:
    """A batched reward fn(completions=, <column>=, **_) -> [answer_score of each]; fields:
    RewardFn's (name defaults to "answer"). The column's values may be numbers; a
    completion may be text or TRL's chat completion (its last message's content)."""
    check_answer_check(check)
    if answer_regex is not None:
        re.compile(answer_regex)

    def answer(completions, **columns):
        return [answer_score(c if isinstance(c, str) else c[-1]["content"], str(a),
                             check=check, answer_regex=answer_regex)
                for c, a in zip(completions, columns[column])]

    return RewardFn(answer, batched=True, **{"name": "answer", **fields})
