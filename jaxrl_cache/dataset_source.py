"""`--dataset`: the rows of a task, from wherever a TRL user keeps them.

`read_dataset(spec, split=, config=)` reads, by what `spec` is:
- a `.jsonl` / `.json` file: `data.read_rows` (a row's place is its line);
- a `.parquet` file: pyarrow (installed with `datasets`);
- a directory written by `datasets`' `save_to_disk` (a Dataset, or a DatasetDict whose
  `split` is taken, "train" by default); any other directory goes to `load_dataset`, which
  reads the data files in it;
- anything else is a Hub name (`openai/gsm8k`, with `config` "main"): `load_dataset(spec,
  config, split=)`, read from the `datasets` cache and downloaded unless
  `HF_DATASETS_OFFLINE=1` / `HF_HUB_OFFLINE=1`.
A single file or Dataset has one split: a `split` given for it is an error, as is a
`config` for anything but `load_dataset`. Every failure is one ValueError line starting
`--dataset SPEC:` (a missing `datasets` package names the extra to install); nothing is
read twice. No jax here.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Callable, Sequence

from jaxrl_cache.data import read_rows

FILE_TYPES = (".jsonl", ".json", ".parquet")
DATA_SUFFIXES = FILE_TYPES + (".csv", ".tsv", ".txt", ".arrow")  # a path, not a Hub name
INSTALL = "pip install 'jaxrl-cache[datasets]'"


@dataclasses.dataclass(frozen=True)
class Rows:
    """A dataset's rows (a sequence of mappings: a list, or a datasets.Dataset)."""
    rows: Sequence
    where: Callable[[int], str]  # row index -> its place, for errors ("f.jsonl:7")
    name: str  # what the run calls the dataset (its file or directory name, or Hub name)


def read_dataset(spec: str, *, split: str | None = None, config: str | None = None) -> Rows:
    """The rows `spec` names (see the module doc); ValueError (one line) when it cannot."""
    path = pathlib.Path(spec).expanduser()
    if path.is_file():
        _one_split(spec, split, config)
        if path.suffix.lower() in (".jsonl", ".json"):
            rows, lines = read_rows(path)
            found = Rows(rows, lambda i: f"{path}:{lines[i]}", path.name)
        elif path.suffix.lower() == ".parquet":
            found = Rows(_parquet(spec, path), lambda i: f"{path} row {i}", path.name)
        else:
            raise ValueError(f"--dataset {spec}: cannot read a {path.suffix or 'suffix-less'} "
                             f"file (expected {', '.join(FILE_TYPES)}, a directory saved "
                             f"with save_to_disk, or a Hub dataset name)")
    elif path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json",
                                                              "state.json")):
        found = _from_disk(spec, path, split, config)
    elif path.is_dir() or not _looks_like_a_path(spec):
        split = split or "train"
        found = Rows(_load_dataset(spec, config, split), lambda i: f"{spec}[{split}] row {i}",
                     f"{path.name if path.is_dir() else spec}[{split}]")
    else:
        raise ValueError(f"--dataset {spec}: no such file or directory")
    if len(found.rows) == 0:
        raise ValueError(f"--dataset {spec}: the dataset is empty (no rows)")
    return found


def _one_split(spec: str, split, config) -> None:
    if split is not None:
        raise ValueError(f"--dataset {spec}: a single file or Dataset has one split; --split "
                         f"{split} applies to a DatasetDict directory or a Hub dataset")
    if config is not None:
        raise ValueError(f"--dataset {spec}: --dataset-config {config} applies to a Hub "
                         f"dataset (or a directory load_dataset reads)")


def _looks_like_a_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or spec.lower().endswith(DATA_SUFFIXES) or \
        spec.count("/") > 1


def _datasets(spec: str, what: str):
    try:
        import datasets
    except ImportError:
        raise ValueError(f"--dataset {spec}: {what} needs the datasets package: "
                         f"{INSTALL}") from None
    return datasets


def _parquet(spec: str, path: pathlib.Path) -> list:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"--dataset {spec}: a parquet file needs pyarrow: {INSTALL}") from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 -- pyarrow's errors, one line
        raise ValueError(f"--dataset {spec}: not a readable parquet file "
                         f"({_line(e)})") from None


def _from_disk(spec: str, path: pathlib.Path, split, config) -> Rows:
    datasets = _datasets(spec, "a save_to_disk directory")
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"--dataset {spec}: not a readable datasets directory "
                         f"({_line(e)})") from None
    if not isinstance(data, datasets.DatasetDict):
        _one_split(spec, split, config)
        return Rows(data, lambda i: f"{path} row {i}", path.name)
    _one_split(spec, None, config)
    split = split or "train"
    if split not in data:
        raise ValueError(f"--dataset {spec}: no split {split!r} (its splits: "
                         f"{', '.join(data)}; --split chooses one)")
    return Rows(data[split], lambda i: f"{path}[{split}] row {i}", f"{path.name}[{split}]")


def _load_dataset(spec: str, config, split: str):
    datasets = _datasets(spec, "a Hub dataset")
    try:
        return datasets.load_dataset(spec, config, split=split)
    except Exception as e:  # noqa: BLE001 -- the library's many error types, one line
        raise ValueError(f"--dataset {spec}: {type(e).__name__}: {_line(e)}") from None


def _line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{text:.300}" or type(e).__name__
