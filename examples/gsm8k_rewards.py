"""GSM8K rewards written for TRL's GRPOTrainer (`reward_funcs=[correctness_reward,
format_reward]`), used unchanged by `jaxrl-cache grpo --config examples/gsm8k_grpo.yaml`.

The config's system prompt makes every prompt chat messages, so (as in TRL) each completion
is a message list `[{"role": "assistant", "content": text}]`; `answer` is the dataset's
column of that name (GSM8K's worked solution, ending in `#### N`), passed by keyword.
"""
import re

FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def _final_number(text: str) -> float | None:
    """The number after the last '####' (commas dropped), or None."""
    found = FINAL.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def correctness_reward(completions, answer, **kwargs):
    """1.0 when the completion's final '#### N' equals the reference's, else 0.0."""
    responses = [completion[0]["content"] for completion in completions]
    return [1.0 if (got := _final_number(r)) is not None and got == _final_number(a) else 0.0
            for r, a in zip(responses, answer)]


def format_reward(completions, **kwargs):
    """1.0 when the completion ends with '#### <number>', else 0.0."""
    pattern = r"####\s*-?[\d,.]+\s*$"
    return [1.0 if re.search(pattern, completion[0]["content"]) else 0.0
            for completion in completions]
