"""`resolve_model`: a local model directory, or a Hugging Face Hub id through
`huggingface_hub` (optional: `pip install huggingface_hub` or the `hub` extra).

A Hub id is read from the Hub cache (HF_HUB_CACHE, else huggingface_hub's default under
HF_HOME) when it is there; otherwise downloaded, unless HF_HUB_OFFLINE is set (then only
the cache is read). Only what `from_pretrained` and `load_tokenizer` read is fetched
(`ALLOW_PATTERNS`: JSON, safetensors, jinja chat templates). Every failure is one
ValueError line naming the model: no such directory, huggingface_hub missing, not in the
cache while offline, not on the Hub, no network.
"""
from __future__ import annotations

import os
import pathlib
import re

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_model(name, *, revision: str | None = None) -> pathlib.Path:
    """The local directory of model `name`: `name` itself when it is a directory, else the
    snapshot directory of the Hub repository `name` (see the module doc)."""
    path = pathlib.Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"--model {name}: not a directory (a Hugging Face model directory "
                         f"or Hub id)")
    text = str(name)
    if not _REPO_ID.fullmatch(text) or text.endswith((".json", ".safetensors")):
        raise ValueError(f"--model {name}: no such directory")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(f"--model {name}: no such directory, and huggingface_hub is not "
                         f"installed to read it from the Hub (pip install huggingface_hub)"
                         ) from None
    offline = _offline()
    try:
        folder = snapshot_download(text, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                   cache_dir=os.environ.get("HF_HUB_CACHE") or None,
                                   local_files_only=offline)
    except Exception as e:  # noqa: BLE001 - the Hub's many errors, as one line
        raise ValueError(_hub_error(text, e, offline)) from None
    return pathlib.Path(folder)


def _hub_error(name: str, error: Exception, offline: bool) -> str:
    kind = type(error).__name__
    if kind in ("LocalEntryNotFoundError", "CachedRepoTreeNotFoundError") or (
            offline and "offline" in str(error).lower()):
        return (f"--model {name}: not a local directory and not in the Hugging Face cache "
                f"(HF_HUB_OFFLINE is set: nothing is downloaded; unset it or run "
                f"`hf download {name}` first)" if offline else
                f"--model {name}: not a local directory, and it could not be downloaded "
                f"(no network?); it is not in the Hugging Face cache either")
    if kind in ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError",
                "HFValidationError"):
        return (f"--model {name}: no such directory, and not a Hub model this machine can "
                f"read ({kind}: {str(error).splitlines()[0] if str(error) else ''})")
    return f"--model {name}: could not fetch it from the Hub ({kind}: " \
           f"{(str(error).splitlines() or [''])[0][:200]})"
