"""The tokenizer of a Hugging Face model directory, without transformers.

Built on the `tokenizers` library (the Rust tokenizer transformers' fast tokenizers wrap:
tokenizer.json gives the same ids) plus jinja2 for the chat template, rendered with the
environment transformers uses (sandboxed, trim_blocks, lstrip_blocks, tojson without HTML
escaping, raise_exception, strftime_now, and its `{% generation %}...{% endgeneration %}`
tag, which TRL's training templates use to mark assistant text: here it renders its body).
transformers' AutoTokenizer would pull in transformers (and its import cost) for the same
ids; this stays a core dependency.
Stop ids come from generation_config.json's eos_token_id (an int or a list), else the
tokenizer's eos token.
"""
from __future__ import annotations

import datetime
import json
import pathlib
from typing import Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from jaxrl_cache.models.hf_config import ModelFileError, read_json


def _token(value) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


class _Generation(jinja2.ext.Extension):
    """`{% generation %}BODY{% endgeneration %}` renders BODY (transformers' extension also
    records where the assistant's text is, for assistant masks; nothing here needs that)."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _jinja_env() -> jinja2.Environment:
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class Tokenizer:
    """Text <-> token ids, the chat template, and the stop ids of one model.

    Token ids stay the ground truth: `encode(decode(ids))` need not return ids.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, tokenizer_config: dict,
                 chat_template: str | None, stop_token_ids: Sequence[int]):
        self.backend = tokenizer
        self.tokenizer_config = tokenizer_config
        self.chat_template = chat_template
        self.special_tokens = {name: _token(tokenizer_config.get(name)) for name in
                               ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.bos_token_id = self.token_to_id(self.special_tokens["bos_token"])
        self.eos_token_id = self.token_to_id(self.special_tokens["eos_token"])
        stop = tuple(int(t) for t in stop_token_ids)
        self.stop_token_ids = stop or ((self.eos_token_id,) if self.eos_token_id is not None
                                       else ())
        self._template = _jinja_env().from_string(chat_template) if chat_template else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                            tokenize: bool = True, **kwargs) -> list[int] | str:
        """Renders chat messages ([{"role": ..., "content": ...}]) with the model's template;
        tokenize=True returns ids (the template writes any BOS itself, so none is added)."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json or "
                             "chat_template.jinja)")
        text = self._template.render(messages=list(messages),
                                     add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save(self, path) -> None:
        """Writes tokenizer.json and tokenizer_config.json (chat template included); removes
        a chat_template.jinja of an earlier save, which load_tokenizer would prefer."""
        path = pathlib.Path(path)
        self.backend.save(str(path / "tokenizer.json"))
        (path / "chat_template.jinja").unlink(missing_ok=True)
        config = dict(self.tokenizer_config)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2,
                                                               ensure_ascii=False))


def _stop_ids(file: pathlib.Path) -> list[int]:
    """generation_config.json's eos_token_id (an int or a list of ints; [] if absent)."""
    generation = read_json(file) if file.exists() else {}
    eos = generation.get("eos_token_id") if isinstance(generation, dict) else None
    ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
        raise ModelFileError(f"{file} field eos_token_id={eos!r:.100}: expected a token id "
                             f"or a list of token ids")
    return ids


def load_tokenizer(path) -> Tokenizer:
    """The Tokenizer of a Hugging Face model directory: tokenizer.json, tokenizer_config.json,
    chat_template.jinja (if present, it wins), generation_config.json (stop ids). A broken
    file raises ModelFileError naming it (and the field)."""
    path = pathlib.Path(path)
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"{path} has no tokenizer.json (only fast tokenizers are "
                                f"supported)")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as e:  # the Rust library raises a bare Exception
        raise ModelFileError(f"{path / 'tokenizer.json'}: not a readable tokenizer "
                             f"({str(e).splitlines()[0]})") from None
    config_file = path / "tokenizer_config.json"
    config = read_json(config_file) if config_file.exists() else {}
    if not isinstance(config, dict):
        raise ModelFileError(f"{config_file}: expected a JSON object, got "
                             f"{type(config).__name__}")
    template = config.pop("chat_template", None)
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: the default one
        template = {t.get("name"): t.get("template") for t in template
                    if isinstance(t, dict)}.get("default")
    if template is not None and not isinstance(template, str):
        raise ModelFileError(f"{config_file} field chat_template: expected a string")
    if (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    try:
        return Tokenizer(backend, config, template, _stop_ids(path / "generation_config.json"))
    except jinja2.TemplateSyntaxError as e:
        source = "chat_template.jinja" if (path / "chat_template.jinja").exists() else \
            "tokenizer_config.json"
        raise ModelFileError(f"{path / source}: chat_template line {e.lineno}: {e.message}") \
            from None
