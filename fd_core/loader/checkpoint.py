"""One loaded checkpoint, whatever its format: config, tokenizer and a stream of weights.

Every loader checks the tensors it found against the names and shapes the config implies before
anything is read, so a broken checkpoint fails at once with the tensor it lacks, not deep inside
a forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from fd_core.errors import CheckpointError, UnsupportedArchitectureError
from fd_core.loader.tokenizer_api import Tokenizer
from fd_core.models.config import ModelConfig
from fd_core.quantization.host import HostWeight, as_float

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

    ``weights()`` yields ``(hf_name, weight)`` one tensor at a time, so at most one tensor beyond the
    model's own copy is in memory. A weight is a float32 array (or float16 where stored so), or,
    for a matrix stored quantized in a form fd keeps (GGUF's Q4_1, say), a host
    ``QuantizedWeight``; matrices are ``[out, in]``. ``weights(dequantize=True)`` and ``tensor()``
    give float32 arrays throughout. A tied ``lm_head`` is not yielded:
    ``config.tie_word_embeddings`` says to reuse the embedding.
    """

    def __init__(
        self,
        *,
        path: Path,
        format: str,
        config: ModelConfig,
        tokenizer: Tokenizer | None,  # None: read without one (skip_tokenizer_init)
        readers: Mapping[str, Callable[[], HostWeight]],
        extras: Mapping[str, Callable[[], HostWeight]] | None = None,
    ) -> None:
        self.path = path
        self.format = format
        self.config = config
        self.tokenizer = tokenizer
        self._readers = dict(readers)
        # tensors the model itself does not load (an MTP layer's, say), for whoever asks
        self._extras = dict(extras or {})

    @property
    def num_tensors(self) -> int:
        return len(self._readers)

    def weight_names(self) -> list[str]:
        return list(self._readers)

    def tensor(self, name: str) -> np.ndarray:
        """One weight by its Hugging Face name, as a float array."""
        try:
            read = self._readers[name]
        except KeyError:
            raise CheckpointError(f"{self.path} has no weight named {name}.") from None
        return as_float(read())

    def weights(self, dequantize: bool = False, skip: Container[str] = ()) -> Iterator[tuple[str, HostWeight]]:
        """Every weight, read one at a time as the caller takes it; those named in ``skip`` are
        not read at all."""
        # the engine shows the progress (fd_core.phases.progress)
        for name in self._readers:
            if name in skip:
                continue
            weight = self._readers[name]()
            yield name, as_float(weight) if dequantize else weight

    def extra_names(self, prefix: str = "") -> list[str]:
        """The names of the tensors beside the model's own that start with ``prefix``."""
        return [name for name in self._extras if name.startswith(prefix)]

    def extra_weights(self, prefix: str) -> Iterator[tuple[str, HostWeight]]:
        """Those tensors, one at a time, as ``weights()`` yields the model's."""
        for name in self.extra_names(prefix):
            yield name, self._extras[name]()

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
