"""`jaxrl-cache demo --config FILE`: a YAML or JSON mapping of the demo's settings.

Keys are the flags' names, with dashes or underscores (`group-size`, `group_size`, and
`async` for `--async`); a value is what the flag takes (numbers, strings, true for a switch,
a list for a repeatable flag such as `stop`); null leaves a setting at its default. The file
becomes command-line arguments placed before the real ones (`config_argv`), so every value
is checked exactly as the flag's own, and flags given on the command line win. Unknown keys
are one ValueError naming them all. No jax here: the CLI reads configs before importing it.
"""
from __future__ import annotations

import argparse
import json
import pathlib


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


def config_argv(path, parser: argparse.ArgumentParser) -> list[str]:
    """The settings of the file at `path` as arguments of `parser` (`--name=value` each, a
    switch as `--name` when true, a repeatable flag once per item), in the file's order."""
    values = read_config(path)
    by_name = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and option not in ("--help", "--config"):
                by_name[option[2:].replace("-", "_")] = (option, action)
        if action.option_strings and action.dest not in ("help", "config"):
            by_name.setdefault(action.dest, (action.option_strings[-1], action))
    unknown = [k for k in values if str(k).replace("-", "_") not in by_name]
    if unknown:
        raise ValueError(f"--config {path}: unknown setting{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(str, unknown))} (keys are the demo's flag names, "
                         f"e.g. group_size or group-size)")
    spelled = {}
    for key in values:  # group_size and group-size (or a flag's alias) name one setting
        option = by_name[str(key).replace("-", "_")][0]
        if option in spelled:
            raise ValueError(f"--config {path}: {spelled[option]} and {key} both set {option}")
        spelled[option] = key
    argv = []
    for key, value in values.items():
        option, action = by_name[str(key).replace("-", "_")]
        argv += _arguments(path, key, option, action, value)
    return argv


def _arguments(path, key, option: str, action, value) -> list[str]:
    if value is None:
        return []
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ValueError(f"--config {path}: {key} is a switch: true or false, got "
                             f"{value!r}")
        return [option] if value == isinstance(action, argparse._StoreTrueAction) else []
    if isinstance(value, (list, tuple)):
        if not isinstance(action, argparse._AppendAction):
            raise ValueError(f"--config {path}: {key} takes one value, got a list")
        return [f"{option}={_text(v)}" for v in value]
    if isinstance(value, dict):
        if action.metavar == "JSON":  # --chat-template-kwargs: the mapping as JSON text
            return [f"{option}={json.dumps(value)}"]
        raise ValueError(f"--config {path}: {key} takes a value, got a mapping")
    return [f"{option}={_text(value)}"]


def _text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"  # a flag's type then refuses it by name
    return str(value)


def given_names(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests of `parser` that `argv` sets explicitly (defaults suppressed); `parser` is
    modified (a throwaway copy)."""
    for action in parser._actions:
        if action.dest not in ("help", "version"):
            action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv))) - {"config"}
