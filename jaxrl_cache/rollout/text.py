"""Text around the rollout engine: prompts as text or chat messages, decoded outputs, stop
strings. Pure host code; token ids stay the ground truth (training and the audit read
prompt_ids / output_ids only, never text).

Prompts: a str is encoded with the tokenizer's special tokens (e.g. a BOS); a list of chat
messages [{"role": ..., "content": ...}] is rendered by the chat template with
add_generation_prompt=True; anything else is left for the engine's token-id checks. Each
prompt is converted on its own, so one call may mix the three forms: the result is ids.

Stop strings are checked on the host between decode chunks, so compiled shapes never
change: a row keeps generating on the device until its chunk ends (up to chunk_steps - 1
tokens are computed and discarded). A row is cut after the output token whose decoded
text first contains a stop string (skip_special_tokens decoding: use stop_token_ids for
special tokens); its tokens and logprobs keep that token. That text is the decode of the
output so far, so a prefix ending in an incomplete UTF-8 character shows its U+FFFD (a stop
string may contain one). Text is decoded incrementally (the vLLM scheme: a few tokens of
context, a delta kept only once it is valid UTF-8), so each token costs one or two decodes
of a short window, and only when stop strings are set.

Chat message content must be a str or a list of content-part dicts (templates such as
Llama 3's render {"type": "text", "text": ...} parts); a template that fails on a prompt
raises ValueError naming the prompt.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxrl_cache.models.config import ModelConfig
from jaxrl_cache.models.tokenizer import Tokenizer
from jaxrl_cache.rollout import scheduler
from jaxrl_cache.rollout.sampling import SamplingParams


def check_tokenizer(tokenizer, config: ModelConfig) -> Tokenizer | None:
    """The engine's tokenizer (or None): its ids must all be rows of the model's embedding."""
    if tokenizer is None:
        return None
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must be a jaxrl_cache.models.Tokenizer (load_tokenizer("
                        f"path)), got {type(tokenizer).__name__}")
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's "
                         f"vocab_size is {config.vocab_size}: not this model's tokenizer")
    return tokenizer


def is_messages(prompt) -> bool:
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(m, dict) for m in prompt))


def _check_messages(i: int, messages) -> None:
    for k, m in enumerate(messages):
        missing = [f for f in ("role", "content") if f not in m]
        if missing:
            raise ValueError(f"prompt {i}: message {k} has no {missing[0]!r} (chat messages "
                             f"are {{'role': ..., 'content': ...}} dicts)")
        if not isinstance(m["role"], str):
            raise TypeError(f"prompt {i}: message {k} role must be a str, got "
                            f"{type(m['role']).__name__}")
        content = m["content"]
        if not (isinstance(content, str) or isinstance(content, list) and all(
                isinstance(part, dict) for part in content)):
            raise TypeError(f"prompt {i}: message {k} content must be a str (or a list of "
                            f"content-part dicts), got {type(content).__name__} "
                            f"{content!r:.80}")


def render_chat(tokenizer: Tokenizer, i: int, messages) -> list[int]:
    """The ids of chat prompt `i`; a template that fails on it (e.g. one that concatenates
    content parts as text) raises ValueError naming the prompt."""
    if not tokenizer.chat_template:
        raise ValueError(f"prompt {i} is chat messages, but the tokenizer has no chat_template "
                         f"(tokenizer_config.json or chat_template.jinja)")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:  # the template is arbitrary code: any failure is about this prompt
        raise ValueError(f"prompt {i}: the chat template failed on these messages: "
                         f"{type(e).__name__}: {e}") from e


def _check_stop(tokenizer: Tokenizer | None, stop: tuple[str, ...]) -> None:
    if not stop:
        return
    if tokenizer is None:
        raise ValueError("sampling.stop (stop strings) needs a tokenizer: "
                         "RolloutEngine(..., tokenizer=load_tokenizer(path))")
    special = {t.content: i for i, t in tokenizer.backend.get_added_tokens_decoder().items()
               if t.special}
    for k, s in enumerate(stop):
        for content, i in special.items():
            if content in s:
                raise ValueError(f"sampling.stop[{k}] contains the special token {content!r}, "
                                 f"which decoded text never shows; use stop_token_ids=({i},)")


def encode_prompts(tokenizer: Tokenizer | None, prompts, sampling) -> Sequence:
    """Text prompts and chat messages -> token ids (other prompts pass through unchanged for
    the engine's checks). Refuses text, chat messages and stop strings without a tokenizer,
    and stop strings holding a special token (stop_token_ids do that)."""
    if isinstance(sampling, SamplingParams):
        _check_stop(tokenizer, sampling.stop)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        return prompts  # the engine refuses it by name
    out = []
    for i, p in enumerate(prompts):
        text = isinstance(p, str)
        if (text or is_messages(p)) and tokenizer is None:
            raise TypeError(f"prompt {i} is {'text' if text else 'chat messages'}: pass "
                            f"tokenizer= to RolloutEngine, or token ids")
        if text:
            p = tokenizer.encode(p)
        elif is_messages(p):
            _check_messages(i, p)
            p = render_chat(tokenizer, i, p)
        out.append(p)
    return out


@dataclasses.dataclass
class _Stream:
    """Incremental detokenization of one row's output: text == decode(tokens[:offset]) (a
    tokenizer whose decoding of a prefix is a prefix of the decoding; byte-level BPE and
    SentencePiece are)."""
    read: int = 0  # tokens consumed (read - offset: an incomplete character so far)
    prefix: int = 0  # window start: text before it is final
    offset: int = 0  # window tokens already in `text`
    before: str = ""  # decode(tokens[prefix:offset])
    text: str = ""
    cut: int | None = None  # len(Sample.text) once a stop string was found


class RowText:
    """One rollout call's decoded outputs and stop strings (rows keyed by Row.index)."""

    def __init__(self, tokenizer: Tokenizer, sampling: SamplingParams):
        self.tokenizer = tokenizer
        self.stop = sampling.stop
        self.include = sampling.include_stop_str_in_output
        self.longest = max(map(len, self.stop), default=0)
        self.streams: dict[int, _Stream] = {}

    def find_stop(self, index: int, tokens: Sequence[int]) -> int | None:
        """Reads row `index`'s tokens not read yet; the number of tokens to keep (up to the one
        whose text completes the earliest stop string), or None while no stop string
        appeared. Once found, the row's stream is finished."""
        s = self.streams.setdefault(index, _Stream())
        decode = self.tokenizer.decode
        while s.cut is None and s.read < len(tokens):
            s.read += 1
            window = decode(tokens[s.prefix:s.read])
            if len(window) <= len(s.before):
                continue  # nothing new
            # decode(tokens[:read]), a trailing U+FFFD (an incomplete UTF-8 sequence) included:
            # a stop string may end in it, as in the text of this prefix
            text = s.text + window[len(s.before):]
            start = max(0, len(s.text) - self.longest + 1)  # no stop string before it
            hits = [(at, -len(stop)) for stop in self.stop if (at := text.find(stop, start)) >= 0]
            if hits:
                at, neg = min(hits)  # earliest start; the longer one on a tie
                s.text, s.cut = text, at - neg if self.include else at
                return s.read
            if not window.endswith("\ufffd"):  # valid UTF-8: the delta is final
                s.prefix, s.offset = s.offset, s.read
                s.before = decode(tokens[s.prefix:s.offset])
                s.text = text
        return None

    def stop_rows(self, slots: list, done: list[int]) -> list[int]:
        """After scheduler.apply_chunk: rows (scheduler.Row or None per slot) whose text hit a
        stop string are cut to the completing token and finish with "stop"; returns `done`
        with their slots added (sorted)."""
        if not self.stop:
            return done
        done = set(done)
        for i, row in enumerate(slots):
            if row is None:
                continue
            keep = self.find_stop(row.index, row.tokens)
            if keep is not None:
                scheduler.keep_tokens(row, keep)
                row.finish_reason = "stop"
                done.add(i)
        return sorted(done)

    def sample_text(self, row) -> str:
        """Sample.text: the decoded output, cut before (or after, include_stop_str_in_output)
        the stop string that ended it."""
        s = self.streams.pop(row.index, None)
        if s is not None and s.cut is not None:
            return s.text[:s.cut]
        return self.tokenizer.decode(row.tokens)
