"""Reading ``.safetensors`` files straight into NumPy, bf16 included.

``safetensors.numpy`` refuses bf16, and the checkpoints we load are mostly bf16, so we parse the
(documented, tiny) header ourselves and memory-map the data: one tensor is materialised at a time.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from fd_core.errors import CheckpointError

# safetensors dtype tag -> NumPy dtype it is stored as (bf16 is read as raw 16-bit words).
_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "F8_E4M3": np.uint8,  # FP8 checkpoints: the bit patterns (NumPy has no float8)
    "BOOL": np.bool_,
}

DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def bf16_to_float32(words: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 words (uint16) to float32: bf16 is the top half of a float32."""
    return (words.astype(np.uint32) << 16).view(np.float32)


class SafetensorsFile:
    """One ``.safetensors`` file: its tensor table, and each tensor on demand."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as handle:
                (header_len,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(header_len))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"Cannot read the safetensors header of {self.path}: {exc}.") from exc
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._data_start = 8 + header_len
        self.entries: dict[str, dict] = header
        for name, entry in header.items():
            if entry.get("dtype") not in _DTYPES:
                raise CheckpointError(
                    f"Tensor {name} in {self.path} has dtype {entry.get('dtype')!r}, which fd cannot read."
                )
        self._mmap: np.memmap | None = None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype_tag(self, name: str) -> str:
        return self.entries[name]["dtype"]

    def read(self, name: str) -> np.ndarray:
        """The tensor as NumPy, floats widened from bf16 to float32; other dtypes as stored."""
        entry = self.entries[name]
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin, end = entry["data_offsets"]
        raw = self._mmap[self._data_start + begin : self._data_start + end]
        dtype = np.dtype(_DTYPES[entry["dtype"]])
        shape = tuple(entry["shape"])
        if raw.size != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise CheckpointError(f"Tensor {name} in {self.path} is truncated or has a wrong size.")
        array = raw.view(dtype).reshape(shape)
        if entry["dtype"] == "BF16":
            return bf16_to_float32(array)
        # A private copy, so callers never hold a view into the mapping (and can write to it).
        return np.array(array)


class SafetensorsSet:
    """The ``*.safetensors`` files of one model folder, single or sharded, as one name -> tensor map."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        files = self._files()
        self.files = [SafetensorsFile(path) for path in files]
        self.owner: dict[str, SafetensorsFile] = {}
        for file in self.files:
            for name in file.entries:
                self.owner[name] = file

    def _files(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError) as exc:
                raise CheckpointError(f"Cannot read the shard index {index}: {exc}.") from exc
            names = sorted(set(weight_map.values()))
            missing = [name for name in names if not (self.folder / name).is_file()]
            if missing:
                raise CheckpointError(f"Shard {missing[0]} listed in {index} is missing from {self.folder}.")
            return [self.folder / name for name in names]
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"No .safetensors weights in {self.folder}.")
        return files

    def names(self) -> Iterable[str]:
        return self.owner.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.owner

    def shape(self, name: str) -> tuple[int, ...]:
        return self.owner[name].shape(name)

    def read(self, name: str) -> np.ndarray:
        return self.owner[name].read(name)

    def dtype_tag(self, name: str) -> str:
        return self.owner[name].dtype_tag(name)

    def stored_dtype(self) -> str:
        """The float dtype most of the weights were saved in (by element count)."""
        counts: dict[str, int] = {}
        for file in self.files:
            for entry in file.entries.values():
                tag = entry["dtype"]
                if tag in DTYPE_NAMES:
                    counts[tag] = counts.get(tag, 0) + int(np.prod(entry["shape"], dtype=np.int64))
        if not counts:
            return "float32"
        return DTYPE_NAMES[max(counts, key=counts.__getitem__)]

    def metadata_format(self) -> str | None:
        """The ``format`` tag writers put in the header metadata (``pt``, ``np``, ...), if any."""
        for file in self.files:
            if "format" in file.metadata:
                return file.metadata["format"]
        return None
