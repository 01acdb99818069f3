"""One loaded checkpoint, whatever its format: config, tokenizer and a stream of weights.

Every loader checks the tensors it found against the names and shapes the config implies before
anything is read, so a broken checkpoint fails at once with the tensor it lacks, not deep inside
a forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from fd_core.errors import CheckpointError, ModelNotFoundError, UnsupportedArchitectureError
from fd_core.loader.tokenizer_api import Tokenizer
from fd_core.models.config import ModelConfig

from fd_core.models import ARCHITECTURES, weight_shapes  # noqa: E402

SUPPORTED_ARCHITECTURES: frozenset[str] = frozenset(ARCHITECTURES)

# Other spellings of a supported architecture found in published config files.
_ALIASES = {
    "Ernie4_5_ForCausalLM": "Ernie4_5ForCausalLM",  # Baidu's -Paddle and early -PT repos
}


def canonical_architecture(name: str, source: Path | str) -> str:
    """The Hugging Face class name for ``name``, or UnsupportedArchitectureError naming ``source``."""
    name = _ALIASES.get(name, name)
    if name not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise UnsupportedArchitectureError(
            f"{source} holds a {name} model, which fd does not support (supported: {supported})."
        )
    return name


class Checkpoint:
    """A checkpoint ready to stream: ``config``, ``tokenizer``, ``format`` and ``weights()``.

    ``weights()`` yields ``(hf_name, array)`` one tensor at a time, so at most one tensor beyond the
    model's own copy is in memory. Arrays are float32 (or float16 where stored so); linear weights
    are ``[out, in]``. A tied ``lm_head`` is not yielded: ``config.tie_word_embeddings`` says to
    reuse the embedding.
    """

    def __init__(
        self,
        *,
        path: Path,
        format: str,
        config: ModelConfig,
        tokenizer: Tokenizer,
        readers: Mapping[str, Callable[[], np.ndarray]],
    ) -> None:
        self.path = path
        self.format = format
        self.config = config
        self.tokenizer = tokenizer
        self._readers = dict(readers)

    @property
    def num_tensors(self) -> int:
        return len(self._readers)

    def weight_names(self) -> list[str]:
        return list(self._readers)

    def tensor(self, name: str) -> np.ndarray:
        """One weight by its Hugging Face name."""
        try:
            read = self._readers[name]
        except KeyError:
            raise CheckpointError(f"{self.path} has no weight named {name}.") from None
        return read()

    def weights(self) -> Iterator[tuple[str, np.ndarray]]:
        # disable=None: a bar on a terminal, silence in logs and pipes.
        names = tqdm(self._readers, total=len(self._readers), desc="Loading weights", unit="tensor", disable=None)
        for name in names:
            yield name, self._readers[name]()

    def __repr__(self) -> str:
        return (
            f"Checkpoint({str(self.path)!r}, format={self.format!r}, "
            f"architecture={self.config.architecture!r}, tensors={self.num_tensors})"
        )


def select_weights(
    config: ModelConfig,
    found: Mapping[str, Sequence[int]],
    path: Path,
) -> list[str]:
    """The weights to load, in order, after checking ``found`` (name -> shape) has each at its shape.

    Extra tensors (rotary caches, multi-token-prediction heads...) are left out.
    """
    names = []
    for name, shape in weight_shapes(config).items():
        if name not in found:
            raise CheckpointError(f"{path} lacks the weight {name} that a {config.architecture} needs.")
        if tuple(found[name]) != shape:
            raise CheckpointError(
                f"Weight {name} in {path} has shape {tuple(found[name])}, but the config implies {shape}."
            )
        names.append(name)
    return names


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Open a GGUF file, or a Hugging Face or Paddle model folder, found on local disk.

    A folder holding a ``config.json`` is read as safetensors (Paddle layout when its tensors say
    so, see :func:`fd_core.loader.paddle_loader.is_paddle_layout`); a folder without one but with a
    single ``.gguf`` file is read as that file.
    """
    from fd_core.loader import gguf_loader, hf_loader, paddle_loader

    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"No checkpoint at {path}: the path does not exist.")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(
                f"{path} is a file but not a .gguf checkpoint; pass a model folder or a .gguf file."
            )
        return gguf_loader.load_gguf(path)
    if (path / "config.json").is_file():
        if paddle_loader.is_paddle_layout(path):
            return paddle_loader.load_paddle(path)
        return hf_loader.load_hf(path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return gguf_loader.load_gguf(ggufs[0])
    if len(ggufs) > 1:
        names = ", ".join(file.name for file in ggufs)
        raise ModelNotFoundError(f"{path} holds several GGUF files ({names}); pass the one to load.")
    raise ModelNotFoundError(f"{path} holds no model: no config.json and no .gguf file.")
