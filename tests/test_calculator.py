"""The calculator environment (app/calculator.py): the tool-call parser, rewards, tool-call
counting, the held-out split, and the SFT pairs of both turns."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxrl_cache.app.calculator import (MAX_OPERAND_DIGITS, CalculatorEnv, CalculatorTask,
                                        parse_answer, parse_call, tool_sft_pairs,
                                        tool_use_summary)
from jaxrl_cache.app.tasks import Example, char_tokenizer
from jaxrl_cache.rl.sft import pack_completions
from jaxrl_cache.rollout.env import EnvStep

BOUND = 10 ** MAX_OPERAND_DIGITS - 1
operands = st.integers(-BOUND, BOUND)
spaces = st.sampled_from(["", " ", "  "])
EXAMPLE = Example("q:123*456=", "56088")


def reference(left, op, right):
    return {"+": left + right, "-": left - right, "*": left * right}[op]


@settings(deadline=None, max_examples=300)
@given(operands, st.sampled_from("+-*"), operands, spaces, spaces,
       st.sampled_from(["", " ", "\n", " \n "]))
def test_tool_call_round_trip(left, op, right, before, after, edge):
    text = f"{edge}c:{left}{before}{op}{after}{right}{edge}"
    assert parse_call(text) == (left, op, right)
    env = CalculatorEnv(EXAMPLE)
    assert env.reset() == "q:123*456="
    assert env.step(text) == EnvStep(f" ={reference(left, op, right)} a:", 0.0, False)
    assert env.tool_calls == 1 and env.outcome is None


@settings(deadline=None, max_examples=300)
@given(st.one_of(st.text(max_size=40),
                 st.text(alphabet="c:0123456789+-*/ a=()x.\u0663", max_size=30),
                 st.builds(lambda n, s: "c:" + "9" * n + s, st.integers(1, 6000),
                           st.sampled_from(["*2", "", "**2", "*-"]))))
def test_step_never_raises(text):
    env = CalculatorEnv(EXAMPLE)
    step = env.step(text)
    call, answer = parse_call(text), parse_answer(text)
    if call is not None:
        assert step == EnvStep(f" ={reference(*call)} a:") and env.tool_calls == 1
    elif answer is not None:
        assert step == EnvStep(None, float(answer == 56088), True) and env.outcome == "answer"
    else:
        assert step == EnvStep(None, 0.0, True) and env.outcome == "malformed"
        assert env.tool_calls == 0


def test_malformed_and_bounded_texts():
    for text in ["", "c:", "c:12*", "c:1/2", "c:1**2", "c:1*2*3", "c: 1*2", "calc:1*2",
                 "c:" + "1" * (MAX_OPERAND_DIGITS + 1) + "*2", "c:\u0661*2", "\u0665\u0666",
                 "56088.0", "a:56088", "5" * 10_000, "56088 56088", "c:1*2 then 3"]:
        env = CalculatorEnv(EXAMPLE)
        assert env.step(text) == EnvStep(None, 0.0, True), text
        assert env.outcome == "malformed" and env.tool_calls == 0


def test_rewards():
    def final(*turns):
        env = CalculatorEnv(EXAMPLE)
        for turn in turns[:-1]:
            assert not env.step(turn).done
        step = env.step(turns[-1])
        assert step.done and step.observation is None and env.reward == step.reward
        return step.reward
    assert final("56088") == 1.0  # directly
    assert final("c:123*456", " 56088\n") == 1.0  # after the tool's answer
    assert final("c:1+1", "056088") == 1.0  # an integer: leading zeros read as such
    assert final("c:123*456", "56087") == 0.0
    assert final("-56088") == 0.0
    assert final("c:123*456", "c:123*456", "56088") == 1.0  # a second call is allowed


def test_tool_call_limit_and_counting():
    env = CalculatorEnv(EXAMPLE, max_tool_calls=2)
    assert env.step("c:1*2").observation == " =2 a:"
    assert env.step("c:3-5").observation == " =-2 a:"
    assert env.step("c:3-5") == EnvStep(None, 0.0, True)
    assert env.outcome == "too_many_calls" and env.tool_calls == 2
    with pytest.raises(RuntimeError, match="ended"):
        env.step("56088")
    envs = [CalculatorEnv(EXAMPLE) for _ in range(5)]
    scripts = [["c:123*456", "56088"], ["56088"], ["oops"], ["c:1*1", "c:2*2", "3"], []]
    for env, script in zip(envs, scripts):
        for turn in script:
            env.step(turn)
    assert tool_use_summary(envs) == dict(
        tool_calls_mean=3 / 5, tool_use_rate=2 / 5, reward_mean=2 / 5, answer_rate=3 / 5,
        malformed_rate=1 / 5, too_many_calls_rate=0.0)


def test_task_questions_and_held_out_split():
    task = CalculatorTask()
    train = task.sample(np.random.default_rng(0), 3000)
    held = task.eval_examples(np.random.default_rng(0), 3000)

    def pairs(examples):
        out = set()
        for e in examples:
            assert e.prompt.startswith("q:") and e.prompt.endswith("=")
            left, right = map(int, e.prompt[2:-1].split("*"))
            assert 100 <= left <= 999 and 100 <= right <= 999 and e.answer == str(left * right)
            out.add(frozenset((left, right)))
        return out
    train_pairs, held_pairs = pairs(train), pairs(held)
    assert not train_pairs & held_pairs and len(held_pairs) > 2000
    grid = np.arange(100, 1000)
    mask = task.held_out(grid[:, None], grid[None, :])
    assert mask.shape == (900, 900) and (mask == mask.T).all()
    assert 0.09 < mask.mean() < 0.11
    assert all(mask[min(p) - 100, max(p) - 100] for p in held_pairs)
    assert task.eval_examples(np.random.default_rng(3), 50) == \
        task.eval_examples(np.random.default_rng(3), 50)  # seeded
    other = CalculatorTask(split_seed=1).held_out(grid[:, None], grid[None, :])
    assert (other != mask).mean() > 0.1
    for bad in (dict(num_digits=0), dict(eval_fraction=1.0), dict(prefix="q1:"),
                dict(split_seed=-1)):
        with pytest.raises(ValueError):
            CalculatorTask(**bad)


def test_sft_pairs_decode_and_train_only_turns():
    tok = char_tokenizer()
    eos = tok.eos_token_id
    examples = [EXAMPLE, Example("q:999*999=", "998001")]
    prompts, completions = tool_sft_pairs(examples, tok)
    assert [tok.decode(p) for p in prompts] == [
        "q:123*456=", "q:123*456=c:123*456 =56088 a:",
        "q:999*999=", "q:999*999=c:999*999 =998001 a:"]
    assert [tok.decode(c) for c in completions] == ["c:123*456", "56088", "c:999*999",
                                                    "998001"]
    env = CalculatorEnv(EXAMPLE)  # turn 2's history: question, turn 1 with <eos>, the env's
    observation = env.step(tok.decode(completions[0])).observation  # observation
    assert prompts[1] == (tok.encode(env.reset()) + completions[0]
                          + tok.encode(observation, add_special_tokens=False))
    assert all(c[-1] == eos and eos not in c[:-1] for c in completions)
    assert prompts[0][0] == tok.bos_token_id and completions[0][-1] == eos
    assert max(len(p) + len(c) for p, c in zip(prompts, completions)) <= 128  # max_seq_len
    tokens, mask = pack_completions(prompts, completions)
    for row, completion in enumerate(completions):  # the loss targets: the turns only
        targets = tokens[row, 1:][mask[row] == 1]
        assert targets.tolist() == completion
    with pytest.raises(ValueError, match="not a calculator question"):
        tool_sft_pairs([Example("number: 4821=", "4821")], tok)
