"""`jaxrl-cache demo --config FILE`: a YAML or JSON mapping of the demo's settings.

Keys are the flags' names, with dashes or underscores (`group-size`, `group_size`, and
`async` for `--async`); a value is what the flag takes (numbers, strings, true for a switch,
a list for a repeatable flag such as `stop`); null leaves a setting at its default. The file
becomes command-line arguments placed before the real ones (`config_argv`), so every value
is checked exactly as the flag's own, and flags given on the command line win. Unknown keys
are one ValueError naming them all; so is a key given twice, or under two spellings. Only
argparse's public API: the parser's options come from a `Flags` table recorded as they are
added. No jax here: the CLI reads configs before importing it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Flag:
    """A long option as a config file sets it."""
    option: str  # the option the file's value is passed to ("--group-size")
    dest: str
    kind: str  # "value", "list" (repeatable: a list of values), "switch" (true or false) or
    #            "json" (metavar JSON: a mapping, passed as JSON text)
    const: object = None  # a switch: the value its flag stores


class Flags:
    """The long options of one parser, recorded from the actions its add_argument returns
    (argparse's public Action attributes: option_strings, dest, const) and the `action`
    named. A setting's keys: each long option without its dashes (dashes or underscores)
    and its dest; help, version and --config are no settings."""
    KINDS = {None: "value", "store": "value", "append": "list", "store_true": "switch",
             "store_false": "switch"}

    def __init__(self):
        self.by_key: dict[str, Flag] = {}

    def recording(self, add: Callable) -> Callable:
        """`add` (a parser's or an argument group's add_argument), recording what it adds."""
        def add_argument(*names, **kwargs):
            return self.add(add(*names, **kwargs), kwargs.get("action"))
        return add_argument

    def add(self, action: argparse.Action, kind: str | None) -> argparse.Action:
        long = [o for o in action.option_strings if o.startswith("--")]
        if kind in ("help", "version") or not long or action.dest == "config":
            return action
        if kind not in self.KINDS:
            raise TypeError(f"{long[-1]}: a config file cannot set action={kind!r}")
        kind = "json" if action.metavar == "JSON" else self.KINDS[kind]
        flag = Flag(long[-1], action.dest, kind, action.const)
        for option in long:
            self.by_key[_key(option[2:])] = flag
        self.by_key.setdefault(_key(action.dest), flag)
        return action

    def get(self, key) -> Flag | None:
        return self.by_key.get(_key(key))

    def dests(self) -> set[str]:
        return {flag.dest for flag in self.by_key.values()}


def _key(name) -> str:
    return str(name).replace("-", "_")


def read_config(path) -> dict:
    """The mapping in a .json, .yaml or .yml file (another suffix: JSON, else YAML);
    ValueError (one line, naming the file) when it cannot be read or is not a mapping."""
    path = pathlib.Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {path}: cannot read it ({e})") from None
    yaml_first = path.suffix.lower() in (".yaml", ".yml")
    try:
        if yaml_first:
            values = _yaml(text)
        else:
            try:
                values = json.loads(text, object_pairs_hook=_unique_keys)
            except json.JSONDecodeError as e:
                if path.suffix.lower() == ".json":
                    raise ValueError(f"line {e.lineno}: {e.msg}") from None
                values = _yaml(text)
    except ValueError as e:
        raise ValueError(f"--config {path}: not valid {'YAML' if yaml_first else 'JSON'} "
                         f"({str(e).splitlines()[0]})") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a mapping of settings (flag: value), "
                         f"got {type(values).__name__}")
    return values


def _unique_keys(pairs) -> dict:
    """A JSON object's pairs -> dict; a key given twice is an error (not the last one wins)."""
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"the key {key!r} is given twice")
        seen[key] = value
    return seen


def _yaml(text: str):
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
            twice = sorted({str(k) for k in keys if keys.count(k) > 1})
            if twice:
                raise ValueError(f"line {node.start_mark.line + 1}: the key {twice[0]!r} is "
                                 f"given twice")
            return super().construct_mapping(node, deep=deep)

    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 -- a SafeLoader
    except yaml.YAMLError as e:
        raise ValueError(" ".join(str(e).split())) from None


def config_argv(path, flags: Flags) -> list[str]:
    """The settings of the file at `path` as arguments of the parser whose options `flags`
    recorded (`--name=value` each, a switch as `--name` when it sets the value given, a
    repeatable flag once per item), in the file's order."""
    values = read_config(path)
    unknown = [k for k in values if flags.get(k) is None]
    if unknown:
        raise ValueError(f"--config {path}: unknown setting{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(str, unknown))} (keys are the demo's flag names, "
                         f"e.g. group_size or group-size)")
    spelled = {}
    for key in values:  # group_size and group-size (or a flag's dest) name one setting
        option = flags.get(key).option
        if option in spelled:
            raise ValueError(f"--config {path}: {spelled[option]} and {key} both set {option}")
        spelled[option] = key
    argv = []
    for key, value in values.items():
        argv += _arguments(path, key, flags.get(key), value)
    return argv


def _arguments(path, key, flag: Flag, value) -> list[str]:
    if value is None:
        return []
    if flag.kind == "switch":
        if not isinstance(value, bool):
            raise ValueError(f"--config {path}: {key} is a switch: true or false, got "
                             f"{value!r}")
        return [flag.option] if value == flag.const else []
    if isinstance(value, (list, tuple)):
        if flag.kind != "list":
            raise ValueError(f"--config {path}: {key} takes one value, got a list")
        return [f"{flag.option}={_text(v)}" for v in value]
    if isinstance(value, dict):
        if flag.kind == "json":  # --chat-template-kwargs: the mapping as JSON text
            return [f"{flag.option}={json.dumps(value)}"]
        raise ValueError(f"--config {path}: {key} takes a value, got a mapping")
    return [f"{flag.option}={_text(value)}"]


def _text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"  # a flag's type then refuses it by name
    return str(value)


class _Unset(list):
    """A dest's value before parsing; the very same object after it: not given. A list, so
    that a repeatable flag appends to a copy of it (argparse copies a non-list default)."""


def given_names(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests of `parser` that `argv` sets explicitly (the parser is left unchanged:
    argparse sets no default on a namespace attribute that exists, public behaviour)."""
    unset = {dest: _Unset() for dest in vars(parser.parse_args([]))}
    parsed = parser.parse_args(argv, namespace=argparse.Namespace(**unset))
    return {dest for dest, value in vars(parsed).items()
            if value is not unset.get(dest)} - {"config"}
