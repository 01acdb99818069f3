"""fd's conformance kit against the cuda backend, on the GPU (a subprocess: the kit is its own
pytest session, ``pytest --pyargs fd_core.conformance --fd-device cuda``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def test_conformance_kit_passes_on_cuda(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--pyargs",
                             "fd_core.conformance", "--fd-device", "cuda"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    print(result.stdout[-3000:])
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    assert "failed" not in last and "passed" in last
