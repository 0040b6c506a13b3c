"""An embedded task with a verifiable reward: reverse a short digit string.

Every prompt is BOS + a fixed instruction prefix + the digits + SEP, so all prompts share a
long prefix (the radix cache serves it) and the n samples of a group share the whole prompt.
"""
from __future__ import annotations

import dataclasses

import numpy as np

PAD, BOS, EOS, SEP = 0, 1, 2, 3
DIGIT0 = 4  # digits 0-9 are tokens 4..13
WORD0 = 14  # instruction "words" are tokens 14..vocab-1


@dataclasses.dataclass(frozen=True)
class ReverseDigits:
    num_digits: int = 4
    prefix_len: int = 46  # instruction tokens after BOS
    vocab_size: int = 32
    seed: int = 1234  # fixes the instruction text

    @property
    def prefix(self) -> list[int]:
        rng = np.random.default_rng(self.seed)
        return [BOS] + rng.integers(WORD0, self.vocab_size, self.prefix_len).tolist()

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + 1 + self.num_digits + 1

    @property
    def max_new_tokens(self) -> int:
        return self.num_digits + 1  # the reversed digits, then EOS

    def sample_prompts(self, rng: np.random.Generator, count: int) -> list[list[int]]:
        digits = rng.integers(0, 10, (count, self.num_digits))
        return [self.prefix + (DIGIT0 + d).tolist() + [SEP] for d in digits]

    def target(self, prompt) -> list[int]:
        digits = list(prompt[-1 - self.num_digits:-1])
        return digits[::-1] + [EOS]

    def reward(self, prompt, output) -> float:
        """In [0, 1]: the mean over target positions (reversed digits, then EOS) of 1 for the
        right token, and for a wrong digit in a digit slot 0.5 * (1 - |got - want| / 9), a
        dense signal that lets learning start from a random policy."""
        target = self.target(prompt)
        score = 0.0
        for i, want in enumerate(target):
            got = output[i] if i < len(output) else None
            if got == want:
                score += 1.0
            elif got is not None and i < self.num_digits and DIGIT0 <= got < DIGIT0 + 10:
                score += 0.5 * (1.0 - abs(got - want) / 9.0)
        return score / len(target)
