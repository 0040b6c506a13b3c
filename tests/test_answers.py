"""Answer checking (rl/answers.py) on real GSM8K / MATH-style completions: the numeric
check (thousands separators, trailing periods, signs, fractions, decimals, the last
\\boxed{} or ####), exact and math-verify (the `math` extra); the demo's --answer-check and
--reward: defaults, one-line refusals before any work, and the rewards a run scores."""
import json
import sys
import threading
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from jaxrl_cache.rl.answers import (answer_reward, answer_score, check_answer_check,
                                    final_answer, parse_number)
from jaxrl_cache.rl.rewards import Rewards

NATALIA = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many "
           "clips in May. How many clips did Natalia sell altogether in April and May?")
NATALIA_SOLUTION = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
                    "<<48+24=72>>72 clips altogether in April and May.\n#### 72")
# (completion, reference, numeric score)
GSM8K = [
    ("In May she sold 48 / 2 = 24 clips.\nAltogether: 48 + 24 = 72.\n#### 72.", "72", 1.0),
    ("In May she sold 24, so 48 + 24 = 72 clips.\n#### 72", NATALIA_SOLUTION, 1.0),
    ("Each laptop costs $250, so 4 laptops cost 4 * 250 = $1,000.\n#### 1,000", "1000", 1.0),
    ("4 * 250 = 1000 dollars\n#### $1,000", "1,000", 1.0),
    ("The temperature fell from 5 to -3 degrees.\n#### -3", "-3", 1.0),
    ("The temperature fell by 8, from 5 to \u22123.\n#### \u22123", "-3", 1.0),
    ("Half a pizza each: 1/2.\n#### 0.5", "1/2", 1.0),
    ("She pays 2.50 per apple.\n#### 2.50", "2.5", 1.0),
    ("#### 70 wait, she also sold 2 more: 72 in all.\n#### 72", "72", 1.0),  # the last
    ("#### 72\nThen she gave away 1,\nso #### 71", "72", 0.0),
    ("She sold 48 + 24 = 72 clips in April and May.", "72", 0.0),  # no final answer
    ("#### 72 clips", "72", 0.0),  # words are no number
    ("#### 1,00", "100", 0.0),  # not a thousands separator
    ("#### 1/3", "0.333", 0.0),  # exact rationals
    ("#### 7200", "72", 0.0),
]
MATH = [
    ("The probability is $\\boxed{\\frac{3}{4}}$.", "so the answer is $\\boxed{\\frac34}$.", 1.0),
    ("Hence $x = \\boxed{0.75}$", "\\dfrac{3}{4}", 1.0),
    ("There are $\\boxed{10,\\!000}$ such numbers.", "10000", 1.0),
    ("The sum is $\\boxed{1{,}024}$.", "1024", 1.0),
    ("We get $\\boxed{-\\frac{1}{2}}$.", "-1/2", 1.0),
    ("So $\\sin 45^\\circ = \\boxed{\\frac{\\sqrt{2}}{2}}$.", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("The polynomial is $\\boxed{x^2 + 1}$.", "x^2+1", 1.0),
    ("The intersection is $\\boxed{(3, -1)}$.", "$(3,-1)$", 1.0),
    ("First guess \\boxed{5}, but checking again gives \\boxed{6}.", "6", 1.0),
    ("First guess \\boxed{6}, but checking again gives \\boxed{5}.", "6", 0.0),
    ("\\boxed{\\frac{\\sqrt2}{2}}", "\\frac{\\sqrt{2}}{2}", 0.0),  # math-verify's job
]


@pytest.mark.parametrize("completion,reference,want", GSM8K + MATH)
def test_numeric_check_on_gsm8k_and_math_answers(completion, reference, want):
    assert answer_score(completion, reference, check="numeric") == want


def test_what_reads_as_a_number():
    for text, value in [("72.", 72), ("1,000", 1000), ("12,345,678.5", 12345678.5),
                        ("+5", 5), ("\u22124", -4), ("$1,200", 1200), (" $18 ", 18),
                        ("72.00", 72), (".5", 0.5), ("1e3", 1000), ("3/4", 0.75),
                        ("-\\dfrac{1}{2}", -0.5), ("\\frac{-1}{2}", -0.5), ("\\tfrac12", 0.5),
                        ("$\\frac{3}{4}$", 0.75)]:
        assert parse_number(text) == value, text
    for text in ["", "abc", "1,00", "12,34,567", "1/0", "--5", "72 clips", "1e9999",
                 "1" * 5000, "inf", "nan", "3/4/5", "\\frac{x}{2}"]:
        assert parse_number(text) is None, text
    assert final_answer("a \\boxed{1} then #### 2\nmore") == "2"
    assert final_answer("#### 1 then \\fbox{x^{2}}") == "x^{2}"
    assert final_answer("\\boxed{unbalanced") is None and final_answer("plain") is None


def test_exact_check_is_unchanged_and_a_regex_picks_the_answer():
    assert answer_score(" 4821\n", "4821", check="exact") == 1.0
    assert answer_score("#### 72.", "72", check="exact") == 0.0  # what --answer-check fixes
    gsm = r"####\s*(-?[\d,.]+)"
    assert answer_score("so 3 + 4 = 7\n#### 7", "7", check="exact", answer_regex=gsm) == 1.0
    assert answer_score("#### 72.", "72", check="numeric", answer_regex=gsm) == 1.0
    assert answer_score("#### 1,000", "1000", check="numeric", answer_regex=gsm) == 1.0
    assert answer_score("The answer is 72", "72", check="numeric",
                        answer_regex=r"answer is (\d+)") == 1.0
    assert answer_score("no number here", "72", check="numeric", answer_regex=gsm) == 0.0


@pytest.mark.parametrize("regex,completion", [
    (r"#### (\d+)|\\boxed\{(\d+)\}", "so \\boxed{12}"),  # the second alternative's group
    (r"#### (\d+)|\\boxed\{(\d+)\}", "so #### 12"),
    (r"(\d+)( apples)?", "it is 12"),  # an optional group that took no part
    (r"(x)?12", "it is 12"),  # no group took part: the whole match
])
def test_a_regex_group_that_took_no_part_in_the_match_is_skipped(regex, completion):
    assert answer_score(completion, "12", check="exact", answer_regex=regex) == 1.0
    assert answer_score(completion, "13", check="numeric", answer_regex=regex) == 0.0


def _final_answer_by_rescanning(text: str):
    """The reference: each box from the last rescans to its closing brace (quadratic)."""
    import re
    boxed = None
    for m in reversed(list(re.finditer(r"\\(?:boxed|fbox)\s*\{", text))):
        depth = 1
        for end in range(m.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                boxed = (m.start(), text[m.end():end].strip())
                break
        if boxed is not None:
            break
    hashes = text.rfind("####")
    if hashes >= 0 and (boxed is None or hashes > boxed[0]):
        return text[hashes + 4:].split("\n", 1)[0].strip()
    return None if boxed is None else boxed[1]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["\\boxed{", "\\fbox {", "{", "}", "7", " ", "####", "\n",
                                 "x"]), max_size=30).map("".join))
def test_final_answer_equals_the_rescanning_reference(text):
    assert final_answer(text) == _final_answer_by_rescanning(text)


class _CountingStr(str):
    reads = 0

    def __getitem__(self, index):
        type(self).reads += 1
        return super().__getitem__(index)


def test_final_answer_reads_a_text_of_unclosed_boxes_a_bounded_number_of_times():
    """28 KB of unclosed \\boxed{ took 20-51 s (every box rescanned the rest of the text)."""
    text = _CountingStr("\\boxed{1 " * 3000 + "#### 5")
    assert final_answer(text) == "5"
    assert _CountingStr.reads <= 10  # slices, not a read per character per box


def test_answer_reward_is_a_trl_shaped_reward():
    """answer_reward: batched, reads an answer column (numbers too), runs on threads."""
    reward = answer_reward("numeric", concurrent=True, weight=2.0)
    assert (reward.name, reward.batched, reward.weight) == ("answer", True, 2.0)
    assert reward.fn(completions=["#### 72.", "#### 71"], answer=[72, "72"]) == [1.0, 0.0]
    items = [(None, SimpleNamespace(group=i, prompt_ids=(), output_ids=()), c)
             for i, (c, _, _) in enumerate(GSM8K)]
    rewards = Rewards((reward,), columns=lambda meta, s: {"answer": GSM8K[s.group][1]})
    assert rewards.score(0, items, str).totals == [2.0 * want for _, _, want in GSM8K]


def test_math_verify_check():
    pytest.importorskip("math_verify")
    for completion, reference in [("#### 72.", "72"), ("#### 1,000", NATALIA_SOLUTION.replace(
            "72", "1,000")), ("\\boxed{\\frac{\\sqrt2}{2}}", "\\frac{\\sqrt{2}}{2}"),
            ("$\\boxed{1 + x^2}$", "x^2+1"), ("The answer is $\\frac{1}{2}$.", "0.5")]:
        assert answer_score(completion, reference, check="math-verify") == 1.0, completion
    assert answer_score("#### 71", "72", check="math-verify") == 0.0
    assert answer_score("#### 72", "", check="math-verify") is None  # unreadable reference
    out = []  # on a worker thread (no signal-based timeouts there)
    worker = threading.Thread(target=lambda: out.append(answer_score(
        "\\boxed{\\dfrac{3}{4}}", "0.75", check="math-verify")))
    worker.start()
    worker.join(60)
    assert out == [1.0]


def test_math_verify_missing_is_one_line_before_any_work(monkeypatch, tmp_path, capsys):
    from jaxrl_cache.app import cli
    from jaxrl_cache.app.options import DemoOptions
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if not installed
    with pytest.raises(ValueError, match=r"needs the math-verify package: pip install "
                                         r"'jaxrl-cache\[math\]'"):
        check_answer_check("math-verify")
    task = tmp_path / "t.jsonl"
    task.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    out = tmp_path / "run"
    assert cli.main(["grpo", "--dataset", str(task), "--answer-check", "math-verify",
                     "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--answer-check: the math-verify answer check needs" in err
    assert not out.exists()
    with pytest.raises(ValueError, match="must be one of exact, numeric, math-verify"):
        DemoOptions(dataset=str(task), answer_check="fuzzy")


REWARDS_FILE = """
def fmt(prompts, completions, answer, **kwargs):
    seen.update(prompts=prompts, answer=answer)
    return [1.0 if c.startswith("In") else None for c in completions]
seen = {}
"""


def test_demo_options_and_the_rewards_a_run_scores(tmp_path):
    """--answer-check defaults to numeric with --dataset (exact for the built-in task) and
    applies to a dataset only; --reward imports its function up front; given with
    --answer-check, the answer reward joins it (without, --reward's functions are the
    rewards, as TRL's reward_funcs); it gets TRL's keywords with the row's columns."""
    from jaxrl_cache.app import demo
    from jaxrl_cache.app.options import DemoOptions
    from jaxrl_cache.app.tasks import char_tokenizer
    rows = tmp_path / "gsm8k.jsonl"
    rows.write_text("".join(json.dumps({"question": f"{NATALIA} ({k})",
                                        "answer": NATALIA_SOLUTION}) + "\n" for k in range(4)))
    (tmp_path / "my_rewards.py").write_text(REWARDS_FILE)
    spec = f"{tmp_path / 'my_rewards.py'}:fmt=0.5"
    only = DemoOptions(dataset=str(rows), prompt_key="question", rewards=[spec])
    assert not only.answer_in_rewards and DemoOptions(dataset=str(rows)).answer_in_rewards
    opts = DemoOptions(dataset=str(rows), prompt_key="question", rewards=[spec],
                       answer_check="numeric", out=str(tmp_path / "run"))
    assert opts.rewards == (spec,) and opts.answer_in_rewards
    task = demo._make_task(opts)
    assert task.reward.check == "numeric" and demo._make_task(DemoOptions()).reward.check \
        == "exact"
    source = demo._prompt_source(opts, task, char_tokenizer())
    assert [f.name for f in source.reward.fns] == ["answer", "fmt"]
    assert [(f.weight, f.batched) for f in source.reward.fns] == [(1.0, False), (0.5, True)]
    examples = task.train[:2]
    texts = ["In May: 24. #### 72.", "#### 71", "In all #### 72", "72"]
    items = [(examples, SimpleNamespace(group=i // 2, prompt_ids=(), output_ids=()), t)
             for i, t in enumerate(texts)]
    scores = source.reward.score(0, items, str)
    assert scores.totals == [1.5, 0.0, 1.5, 1.0]  # a bare "72" is the whole answer
    assert scores.metrics["rewards/answer/mean"] == 0.75
    assert scores.metrics["rewards/fmt/mean"] == 1.0 and scores.metrics["reward_unscored"] == 0
    seen = source.reward.fns[1].fn.__globals__["seen"]
    assert seen["answer"] == [NATALIA_SOLUTION] * 4  # the row's own field, as TRL passes it
    assert seen["prompts"] == [examples[0].prompt] * 2 + [examples[1].prompt] * 2
    for bad, match in [(dict(answer_check="numeric"), "--answer-check applies to a --dataset"),
                       (dict(env="calculator", rewards=[spec]), "--reward: with --env"),
                       (dict(rewards=["nope"]), "--reward 'nope': expected module:function"),
                       (dict(rewards=[f"{spec[:-4]}=1", f"{spec[:-4]}=2"]),
                        "two reward functions are named 'fmt'")]:
        with pytest.raises(ValueError, match=match):
            DemoOptions(**bad)


def test_cli_flags_reach_the_options():
    from jaxrl_cache.app import cli
    args = cli.build_parser().parse_args(
        ["grpo", "--dataset", "t.jsonl", "--answer-check", "math-verify", "--reward", "m:f",
         "--reward", "n:g=0.5"])
    assert args.answer_check == "math-verify" and args.rewards == ["m:f", "n:g=0.5"]
    assert cli.build_parser().parse_args(["demo"]).rewards is None
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["demo", "--answer-check", "fuzzy"])
