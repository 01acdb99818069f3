"""What the cuda backend's tests share: this package importable uninstalled, Triton's
interpreter where no CUDA device is, and the models the GPU tests build once per session (the
ERNIE-0.3B shape takes ~20 s)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fd_backend_cuda, uninstalled


def _interpret_without_a_gpu() -> None:
    """Without a CUDA device the kernel tests run on CPU tensors through Triton's interpreter,
    whose switch must be set before triton (any ``@triton.jit``) is imported: here, before any
    test module is."""
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_interpret_without_a_gpu()


def _need_cuda(devices: int = 1):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    if not torch.cuda.is_available() or torch.cuda.device_count() < devices:
        pytest.skip(f"needs {devices} CUDA device(s)")


@pytest.fixture(scope="session")
def llama(tmp_path_factory):
    """The tests' tiny random-weight Llama."""
    _need_cuda()
    from tests import checkpoints

    return checkpoints.make_llama(tmp_path_factory.mktemp("llama-gpu"))


@pytest.fixture(scope="session")
def ernie(tmp_path_factory):
    """A random-weight model of ERNIE-4.5-0.3B's shape, float32 on disk."""
    _need_cuda()
    from tests import checkpoints

    return checkpoints.make_ernie45(tmp_path_factory.mktemp("ernie03b"), **checkpoints.ERNIE_45_03B)
