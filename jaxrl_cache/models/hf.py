"""Hugging Face checkpoints in and out: config.json + safetensors <-> (ModelConfig, params).

Supported (`models.families`): LlamaForCausalLM (rope_scaling linear / llama3),
MistralForCausalLM (a sliding window caps max_seq_len at the window, where windowed and full
attention are equal), Qwen2ForCausalLM (q/k/v bias), Qwen3ForCausalLM (per-head q/k RMSNorm),
GemmaForCausalLM (GeGLU, norms by 1 + w, scaled embeddings). Any config field that would
change the math and is not implemented raises ConfigError naming the field
(`models.hf_config`): a checkpoint either loads as exactly the model transformers runs, or
not at all.

A broken directory raises ModelFileError (a ValueError) whose first line names the file and
the field or tensor: unreadable JSON, a config that is not an object, a missing, mistyped or
non-positive field, a truncated or corrupt safetensors file, a missing tensor, a tensor
whose header dtype is not floating point, an index entry outside the directory.
Weights are read as transformers reads them: model.safetensors, else the shards of
model.safetensors.index.json; a directory holding both is refused (transformers would pick
the single file, an older save's loader the index). tie_word_embeddings with a distinct
lm_head.weight in the file is refused too: transformers versions disagree on which head
that checkpoint means (4.x ties and drops the file's head, 5.x keeps it).

Weights move by the family's name tables (ours, Hugging Face name, transposed?): HF Linear
weights are [out, in], ours [in, out]; no rotary permutation is needed (both use the
rotate-half layout). Import reads safetensors through numpy (memory-mapped, no torch) and
fills each stacked [n_layers, ...] leaf directly in the target dtype.
"""
from __future__ import annotations

import json
import pathlib
import re
import struct

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxrl_cache.models.config import ModelConfig
from jaxrl_cache.models.families import ARCHITECTURES, family_for_architecture, family_of, \
    model_type
from jaxrl_cache.models.hf_config import (COMMON_FIELDS, DTYPES, INERT_FIELDS, OFF,
                                          ConfigError, ModelFileError, common_fields,
                                          common_to_hf, read_json, refuse)
from jaxrl_cache.models.lora import ADAPTERS, SCALE

_FLOAT_HEADER_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
_HEADER_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# other weight formats transformers or vLLM may load from a directory (save_pretrained refuses
# to write beside them)
_FOREIGN_WEIGHTS = re.compile(r".*\.(safetensors|bin|pt|pth|gguf)(\.index\.json)?")


def config_from_hf(hf, *, dtype: str | None = None,
                   source: str = "config.json") -> ModelConfig:
    """ModelConfig of a Hugging Face config.json dict, read by its architecture's family;
    ConfigError naming `source` and the field for anything unsupported, missing or mistyped.

    dtype: params dtype; default the checkpoint's dtype / torch_dtype (float32 if absent).
    """
    if not isinstance(hf, dict):
        raise ConfigError(f"{source}: expected a JSON object of config fields, got "
                          f"{type(hf).__name__}")
    archs = hf.get("architectures") or []
    family = family_for_architecture(archs[0]) if isinstance(archs, list) and \
        len(archs) == 1 else None
    if family is None:
        refuse(source, "architectures", archs, f"supported: {', '.join(ARCHITECTURES)}")
    arch = archs[0]
    if hf.get("model_type") not in (None, model_type(arch)):
        refuse(source, "model_type", hf["model_type"], f"{arch} is model_type "
               f"{model_type(arch)!r} (transformers builds the model from model_type)")
    for field, value in hf.items():
        if field not in INERT_FIELDS | COMMON_FIELDS | family.fields and value not in OFF:
            refuse(source, field, value, "unknown field (it may change the model's math)")
    common = common_fields(hf, source, dtype)
    return ModelConfig(**{**common, **family.read(hf, arch, source, common)})


def config_to_hf(config: ModelConfig) -> dict:
    """The config.json of `config`, written by its family. Raises ValueError if none of the
    family's architectures has this math."""
    own = family_of(config).write(config)
    return dict(architectures=own["architectures"],
                model_type=model_type(own["architectures"][0]), **common_to_hf(config),
                **{k: v for k, v in own.items() if k != "architectures"})


def _shard_name(index: pathlib.Path, tensor: str, file) -> str:
    """An index entry's file: a relative path inside the model directory (never opened
    otherwise: an index must not make the loader read /etc/passwd). Symlinks are followed,
    as for model.safetensors: the hub cache links each file to its blob."""
    parts = pathlib.PurePosixPath(file).parts if isinstance(file, str) else ()
    if not parts or parts[0] == "/" or ".." in parts or "\\" in file:
        raise ModelFileError(f"{index}: weight_map entry {tensor!r:.100}: {file!r:.100} is "
                             f"not a file inside the model directory")
    return file


def _tensor_names(file: pathlib.Path) -> list[str]:
    try:
        with safe_open(file, framework="np") as f:
            return list(f.keys())
    except SafetensorError as e:
        raise ModelFileError(f"{file}: not a readable safetensors file ({e})") from None


def _weight_files(path: pathlib.Path) -> tuple[str, dict[str, pathlib.Path]]:
    """(the weights' file name, HF tensor name -> the safetensors file holding it):
    model.safetensors, else the shards of model.safetensors.index.json (transformers'
    order); both at once is refused as ambiguous."""
    single, index = path / SINGLE_FILE, path / INDEX_FILE
    if single.exists() and index.exists():
        raise ModelFileError(f"{path}: holds both {SINGLE_FILE} and {INDEX_FILE} (a stale "
                             f"earlier save?): remove the one that is not this model")
    if single.exists():
        return SINGLE_FILE, {name: single for name in _tensor_names(single)}
    if not index.exists():
        raise ModelFileError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (safetensors weights "
                             f"as transformers saves them)")
    weight_map = read_json(index)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict):
        raise ModelFileError(f"{index}: no weight_map object (tensor name -> shard file)")
    files = {name: path / _shard_name(index, name, file) for name, file in weight_map.items()}
    for file in sorted(set(files.values())):
        held = set(_tensor_names(file)) if file.is_file() else None
        absent = sorted(name for name, f in files.items()
                        if f == file and (held is None or name not in held))
        if absent:
            raise ModelFileError(f"{index}: weight_map puts {absent[0]} in {file.name}, which "
                                 f"{'does not exist' if held is None else 'does not hold it'}")
    return INDEX_FILE, files


def _read_tensor(file: pathlib.Path, name: str) -> np.ndarray:
    """Tensor `name` of safetensors `file` (memory-mapped); its header dtype must be
    floating point. ModelFileError naming file and tensor otherwise."""
    try:
        with safe_open(file, framework="np") as f:
            kind = f.get_slice(name).get_dtype()
            if kind not in _FLOAT_HEADER_DTYPES:
                raise ModelFileError(f"{file}: tensor {name} has dtype {kind} in its header; "
                                     f"weights are floating point "
                                     f"({', '.join(sorted(_FLOAT_HEADER_DTYPES))})")
            return f.get_tensor(name)
    except SafetensorError as e:
        raise ModelFileError(f"{file}: cannot read tensor {name} ({e})") from None


def _check_tied_head(path: pathlib.Path, files: dict) -> None:
    """tie_word_embeddings with an lm_head.weight in the file: refused unless bitwise equal
    to the embedding (transformers 4.x ties and drops the file's head, 5.x keeps it)."""
    head = _read_tensor(files["lm_head.weight"], "lm_head.weight")
    embed = _read_tensor(files["model.embed_tokens.weight"], "model.embed_tokens.weight")
    if head.dtype != embed.dtype or head.shape != embed.shape or not np.array_equal(
            head.view(np.uint8), embed.view(np.uint8)):
        raise ModelFileError(
            f"{path / 'config.json'} field tie_word_embeddings=true, but "
            f"{files['lm_head.weight'].name} holds an lm_head.weight unlike "
            f"model.embed_tokens.weight (transformers versions disagree on which head this "
            f"means): set tie_word_embeddings false to use the file's head, or delete it")


def _weight_file_name(name: str) -> bool:
    """Whether `name` is a weight file save_pretrained writes (and so may replace)."""
    return name in (SINGLE_FILE, INDEX_FILE) or bool(_SHARD_FILE.fullmatch(name))


def _hf_names(config: ModelConfig, shapes: dict) -> list[tuple[tuple, str, bool]]:
    """Every (our path, HF name, transposed) the model needs, by its family's tables; our
    path is ("embed",) or ("layers", name, i)."""
    family = family_of(config)
    out = [((ours,), hf, t) for ours, hf, t in family.top_weights if ours in shapes]
    for i in range(config.n_layers):
        out += [(("layers", ours, i), f"model.layers.{i}.{hf}", t)
                for ours, hf, t in family.layer_weights if ours in shapes["layers"]]
    return out


def _param_shapes(config: ModelConfig) -> dict:
    """The params' ShapeDtypeStructs (the family decoder's abstract init)."""
    init = family_of(config).decoder.init_params
    return jax.eval_shape(lambda k: init(config, k), jax.random.key(0))


def from_pretrained(path, *, dtype: str | None = None) -> tuple[ModelConfig, dict]:
    """(ModelConfig, params) of a local Hugging Face model directory.

    Reads config.json and model.safetensors (or the shards of model.safetensors.index.json)
    memory-mapped through numpy, each tensor cast once into its stacked leaf of the target
    dtype (default: the checkpoint's). Peak host memory is about the params once plus one
    leaf and one tensor. Raises ConfigError for unsupported configs and ModelFileError (its
    base) for any other broken file, naming the file and field or tensor (module doc).
    """
    path = pathlib.Path(path)
    config_file = path / "config.json"
    config = config_from_hf(read_json(config_file), dtype=dtype, source=str(config_file))
    shapes = _param_shapes(config)
    weights, files = _weight_files(path)
    wanted = _hf_names(config, shapes)
    missing = [hf for _, hf, _ in wanted if hf not in files]
    if missing:
        raise ModelFileError(f"{path / weights}: missing tensor {missing[0]}"
                             f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
    ignorable = {"lm_head.weight"} if config.tie_embeddings else set()
    if ignorable & set(files):
        _check_tied_head(path, files)
    unused = sorted(set(files) - {hf for _, hf, _ in wanted} - ignorable)
    unused = [n for n in unused if not n.endswith("rotary_emb.inv_freq")]
    if unused:
        raise ModelFileError(f"{path / weights}: tensors the model does not use (unsupported "
                             f"architecture variant?): {unused[:5]}")
    np_dtype = DTYPES[config.dtype]
    by_leaf: dict[tuple, list] = {}
    for ours, hf, t in wanted:
        by_leaf.setdefault(ours[:2], []).append((ours, hf, t))
    params: dict = {"layers": {}}
    for leaf, items in by_leaf.items():
        shape = (shapes[leaf[0]] if len(leaf) == 1 else shapes["layers"][leaf[1]]).shape
        buf = np.empty(shape, np_dtype)
        for ours, hf, t in items:
            # one open per tensor: its mapped pages are released before the next one
            tensor = _read_tensor(files[hf], hf)
            tensor = tensor.T if t else tensor
            dest = buf if len(ours) == 1 else buf[ours[2]]
            if tensor.shape != dest.shape:
                raise ModelFileError(f"{files[hf]}: tensor {hf} has shape "
                                     f"{list(tensor.shape)} (after transpose: {t}); the "
                                     f"config needs {list(dest.shape)}")
            dest[...] = tensor
            del tensor
        value = jnp.asarray(buf)
        del buf
        if len(leaf) == 1:
            params[leaf[0]] = value
        else:
            params["layers"][leaf[1]] = value
    return config, params


def save_pretrained(path, config: ModelConfig, params, *, tokenizer=None,
                    max_shard_bytes: int = 4 << 30) -> pathlib.Path:
    """Writes a Hugging Face directory transformers (and vLLM) load as the same model.

    config.json, model.safetensors (or model-0000i-of-0000n.safetensors shards with
    model.safetensors.index.json past max_shard_bytes), in config.dtype, written one tensor at
    a time (host memory: the params, on one device not copied, plus one tensor); with a
    `Tokenizer` also its files and generation_config.json (bos/eos/stop ids). Returns the
    directory.
    An existing directory may be written again: weight files of an earlier save that this
    one does not rewrite (its single file, index or shards) are removed once the new ones
    are written, so exactly one set remains; other files are left as they are. Weights in
    another format or name (pytorch_model.bin, consolidated.safetensors, ...), which
    transformers or vLLM might load instead, make it refuse before writing anything, as do
    params carrying LoRA adapters (export `lora.merged(params)`, or the adapters alone with
    `models.peft.save_peft_adapter`).
    """
    path = pathlib.Path(path)
    if path.is_dir():
        foreign = sorted(f.name for f in path.iterdir()
                         if _FOREIGN_WEIGHTS.fullmatch(f.name) and not _weight_file_name(f.name))
        if foreign:
            raise FileExistsError(f"{path / foreign[0]}: weights this save would not replace "
                                  f"(transformers or vLLM could load them): remove them or "
                                  f"save elsewhere")
    config_json = json.dumps(config_to_hf(config), indent=2)
    if SCALE in params or ADAPTERS in params.get("layers", {}):
        raise ValueError("the params carry LoRA adapters, which this export would drop: pass "
                         "lora.merged(params), or save the adapters with save_peft_adapter")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(config_json)
    np_dtype = np.dtype(DTYPES[config.dtype])
    host = jax.tree.map(np.asarray, params)  # one device: views of the arrays, no copy
    shards: list[list] = [[]]  # [(HF name, its shape, where in `host`, transposed)]
    size = 0
    for ours, hf, t in _hf_names(config, _param_shapes(config)):
        array = host[ours[0]] if len(ours) == 1 else host["layers"][ours[1]][ours[2]]
        nbytes = array.size * np_dtype.itemsize
        if size and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((hf, array.shape[::-1] if t else array.shape, ours, t))
        size += nbytes

    def tensor(ours, t) -> np.ndarray:  # one HF tensor at a time (a copy if transposed)
        array = host[ours[0]] if len(ours) == 1 else host["layers"][ours[1]][ours[2]]
        return np.ascontiguousarray((array.T if t else array).astype(np_dtype, copy=False))

    metadata = {"format": "pt"}  # transformers requires the pt format tag
    if len(shards) == 1:
        written = {SINGLE_FILE}
        _write_safetensors(path / SINGLE_FILE, shards[0], tensor, np_dtype, metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _write_safetensors(path / name, shard, tensor, np_dtype, metadata)
            weight_map.update({hf: name for hf, *_ in shard})
        total = sum(int(np.prod(shape)) * np_dtype.itemsize
                    for shard in shards for _, shape, *_ in shard)
        (path / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        written = {INDEX_FILE, *weight_map.values()}
    for stale in sorted(f for f in path.iterdir()
                        if _weight_file_name(f.name) and f.name not in written):
        stale.unlink()
    if tokenizer is not None:
        tokenizer.save(path)
        stop = list(tokenizer.stop_token_ids)
        generation = dict(bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=stop[0] if len(stop) == 1 else stop)
        (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path


def _write_safetensors(file: pathlib.Path, entries: list, tensor, dtype: np.dtype,
                       metadata: dict) -> None:
    """A safetensors file of `entries` [(name, shape, *key)], written tensor by tensor:
    `tensor(*key)` gives each one's C-contiguous array, so the host holds one at a time (not
    a copy of them all, as safetensors' save_file does)."""
    header, offset = {"__metadata__": metadata}, 0
    for name, shape, *_ in entries:
        nbytes = int(np.prod(shape)) * dtype.itemsize
        header[name] = dict(dtype=_HEADER_DTYPES[dtype.name], shape=list(shape),
                            data_offsets=[offset, offset + nbytes])
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, shape, *key in entries:
            f.write(memoryview(tensor(*key).reshape(-1).view(np.uint8)))
