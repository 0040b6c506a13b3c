"""TRL reward functions run unchanged (issue 63, part 2): written as TRL's docs write them
(`completion[0]["content"]` on chat prompts, a dataset column such as `solution` by name,
`**kwargs` for the rest, `async def` ones, None for "not applicable"), scored through
Rewards as a step scores them."""
import asyncio
import functools
import re
import time
from types import SimpleNamespace

import pytest

from jaxrl_cache.errors import RewardError
from jaxrl_cache.rl.answers import answer_reward
from jaxrl_cache.rl.rewards import RewardFn, Rewards, batched, load_reward

CHAT = [({"role": "system", "content": "Think, then answer."},
         {"role": "user", "content": f"What is {k} + {k}?"}) for k in range(4)]
SOLUTIONS = ["0", "2", "4", "6"]
TEXTS = ["<think>0+0</think><answer>0</answer>", "<answer>2</answer>",
         "<think>hm</think><answer>5</answer>", "six"]


# --- as TRL's docs write them ---------------------------------------------------------

def format_reward(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def accuracy_reward(completions, solution, **kwargs):
    """Reward function that checks the answer against the dataset's solution column; None
    where the completion has no <answer> (not applicable)."""
    rewards = []
    for completion, sol in zip(completions, solution):
        found = re.search(r"<answer>(.*?)</answer>", completion[0]["content"])
        rewards.append(None if found is None else float(found.group(1) == sol))
    return rewards


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


async def judge_reward(prompts, completions, **kwargs):  # an LLM judge's shape
    await asyncio.sleep(0.01)
    return [0.5 if "answer" in c[0]["content"] else 0.0 for c in completions]


def items(texts, group_of=lambda i: i):
    return [(None, SimpleNamespace(group=group_of(i), prompt_ids=(1, 2), output_ids=(i,)), t)
            for i, t in enumerate(texts)]


def chat_columns(meta, sample):  # what the CLI's columns give: the row's fields + prompt
    return {"prompt": CHAT[sample.group], "solution": SOLUTIONS[sample.group]}


def test_trl_doc_rewards_on_chat_prompts_get_message_lists_and_columns():
    seen = {}

    def spy(prompts, completions, completion_ids, trainer_state, **kwargs):
        seen.update(prompts=prompts, completions=completions, kwargs=kwargs,
                    state=trainer_state)
        return [None] * len(completions)

    rewards = Rewards((batched(format_reward), batched(accuracy_reward, weight=2.0),
                       batched(judge_reward), batched(spy)), columns=chat_columns,
                      max_steps=10)
    scores = rewards.score(4, items(TEXTS), str)
    assert scores.totals == [1.0 + 2.0 + 0.5, 0.0 + 2.0 + 0.5, 1.0 + 0.0 + 0.5, 0.0]
    assert scores.metrics["rewards/accuracy_reward/mean"] == pytest.approx(2 / 3)
    assert scores.metrics["reward_unscored"] == 0  # "six": format and judge still apply
    assert seen["prompts"] == [list(p) for p in CHAT]  # message lists, as TRL passes them
    assert seen["completions"] == [[{"role": "assistant", "content": t}] for t in TEXTS]
    assert seen["kwargs"] == {"solution": SOLUTIONS}
    assert (seen["state"].global_step, seen["state"].max_steps) == (4, 10)


def test_text_prompts_give_text_completions_and_none_is_not_applicable():
    texts = ["a" * 20, "b" * 25, "c"]
    rewards = Rewards((batched(reward_len),
                       batched(lambda completions, **_: [None, 1.0, None], name="some")),
                      columns=lambda meta, s: {"prompt": f"prompt {s.group}"})
    scores = rewards.score(0, items(texts), str)
    assert scores.totals == [0.0, -5.0 + 1.0, -19.0]
    assert scores.metrics["rewards/some/mean"] == 1.0 and scores.metrics["reward_unscored"] == 0
    only = Rewards((batched(lambda completions, **_: [None] * 3, name="never"),))
    assert only.score(0, items(texts), str).metrics["reward_unscored"] == 3


def test_answer_reward_reads_chat_completions():
    reward = answer_reward("numeric")
    assert reward.fn(completions=[[{"role": "assistant", "content": "#### 72"}], "#### 7"],
                     answer=["72", "72"]) == [1.0, 0.0]


def test_async_rewards_are_awaited_together():
    """Every async call of a step (per-sample and batched) is in flight at once: each waits
    at a barrier that opens only when all of them wait there (serial calls would time out)."""
    n = len(TEXTS)
    barrier = {}

    async def per_sample(meta, sample, text):
        await asyncio.wait_for(barrier["b"].wait(), 5)
        return float(sample.group)

    async def whole(completions, **kwargs):
        await asyncio.wait_for(barrier["b"].wait(), 5)
        return [1.0] * len(completions)

    class Judge:  # a callable object with an async __call__ (TRL detects it too)
        async def __call__(self, completions, **kwargs):
            await asyncio.wait_for(barrier["b"].wait(), 5)
            return [0.25] * len(completions)

    async def scaled(completions, scale, **kwargs):
        await asyncio.wait_for(barrier["b"].wait(), 5)
        return [scale] * len(completions)

    fns = (RewardFn(per_sample), batched(whole), batched(Judge(), name="judge"),
           batched(functools.partial(scaled, scale=2.0), name="scaled"))
    assert all(f.is_async for f in fns)
    for _ in range(2):  # a new event loop each step
        barrier["b"] = asyncio.Barrier(n + 3)
        start = time.perf_counter()
        scores = Rewards(fns, columns=chat_columns).score(0, items(TEXTS), str)
        assert scores.totals == [i + 1.0 + 0.25 + 2.0 for i in range(n)]
        assert time.perf_counter() - start < 4


async def slow(completions, **kwargs):
    await asyncio.sleep(30)


async def blocking(completions, **kwargs):
    time.sleep(0.3)  # holds the loop: cannot be cancelled, measured when it returns
    return [1.0] * len(completions)


async def raises(completions, **kwargs):
    raise ValueError("judge unavailable")


async def cancels(completions, **kwargs):
    raise asyncio.CancelledError()


@pytest.mark.parametrize("fn,match", [
    (batched(slow, timeout=0.2), r"'slow' on the batch of 4 samples: took more than 0.2 s"),
    (batched(blocking, timeout=0.1), r"'blocking' .*took more than 0.1 s"),
    (batched(raises), r"'raises' on the batch of 4 samples: raised ValueError: judge "),
    (batched(cancels), r"'cancels' .*raised CancelledError"),
    (batched(lambda completions, **_: [1.0], name="short"), r"returned 1 values for 4"),
])
def test_a_failing_async_reward_is_one_line(fn, match):
    start = time.perf_counter()
    with pytest.raises(RewardError, match=match) as info:
        Rewards((fn, batched(format_reward)), columns=chat_columns).score(
            0, items(TEXTS), str)
    assert "\n" not in str(info.value) and time.perf_counter() - start < 5


def test_async_definitions_and_specs(tmp_path):
    with pytest.raises(ValueError, match="is async: its calls are awaited together"):
        batched(slow, concurrent=True)
    with pytest.raises(ValueError, match="timeout needs concurrent=True or an async"):
        batched(format_reward, timeout=1)
    path = tmp_path / "trl_rewards.py"
    path.write_text("async def judge(prompts, completions, **kwargs):\n"
                    "    return [float(len(c[0]['content']) > 3) for c in completions]\n")
    judge = load_reward(f"{path}:judge=0.5")
    assert (judge.name, judge.batched, judge.is_async, judge.weight) == \
        ("judge", True, True, 0.5)
    scores = Rewards((judge,), columns=chat_columns).score(0, items(TEXTS), str)
    assert scores.totals == [0.5, 0.5, 0.5, 0.0]
