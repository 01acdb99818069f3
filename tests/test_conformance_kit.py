"""The conformance kit (``pytest --pyargs fd_core.conformance --fd-device NAME``): it passes for
every in-tree backend, and it catches a backend whose numbers or manifest are wrong, naming
what is wrong."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fd_core.testing.opcases import OpCase, OpMismatch, compare
from tests.plugins import fake_dists
from tests.plugins.bf16_accumulator import BF16_ACCUMULATOR
from tests.plugins.vendors import VENDOR_BACKENDS, require_installed

REPO = Path(__file__).resolve().parents[1]


def run_kit(cwd: Path, *args: str, pythonpath: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("FD_EMULATE", "FD_BACKENDS")}
    if pythonpath is not None:
        environ["PYTHONPATH"] = os.pathsep.join([str(pythonpath), str(REPO)])
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--pyargs", "fd_core.conformance",
         *args],
        cwd=cwd, env=environ, capture_output=True, text=True, timeout=600,
    )


def summary(result: subprocess.CompletedProcess) -> str:
    return result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]


@pytest.mark.parametrize("device,runtime", [("cpu", None), ("cpu", "torch")])
def test_kit_passes_for_the_cpu_backend(tmp_path, device, runtime):
    result = run_kit(tmp_path, "--fd-device", device, *(["--fd-runtime", runtime] if runtime else []))
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "failed" not in summary(result) and "passed" in summary(result)


def visible_devices_env(device: str) -> str:
    from fd_core.plugins import get_registry

    return next(p for p in get_registry().platforms() if p.name == device).visible_devices_env


@pytest.mark.parametrize("device", VENDOR_BACKENDS)
def test_kit_passes_for_each_vendor_backend_in_emulation(tmp_path, device):
    require_installed(device)
    # two emulated devices, so that the collectives run across two ranks too
    result = run_kit(tmp_path, "--fd-device", device, "--fd-emulate", env={visible_devices_env(device): "0,1"})
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    # emulated, every test runs: without the mode the chip is missing and device tests would skip
    assert "failed" not in summary(result) and "skipped" not in summary(result), summary(result)


# -- a backend whose numbers or manifest are wrong ------------------------------------------------

WRONG = """
    from fd_core.interfaces import Capabilities
    from fd_core.plugins import hookimpl

    FD_API_VERSION = "1.3"

    class Wrong:
        name = "wrongchip"
        device_type = "wrongchip"
        runtime = "paddle"

        def is_available(self):
            return True, ""

        def device_count(self):
            return 1

        def capabilities(self):
            return Capabilities(chunked_prefill=True, memory_query=True, graph_capture=GRAPHS)

        def memory(self, device_index=0):
            from fd_core.runtimes.paddle import PaddleMemory
            return PaddleMemory("cpu")

        def communicator(self, rank=0, world_size=1, rendezvous=None):
            from fd_core.runtimes.paddle import PaddleCommunicator
            return PaddleCommunicator(rank, world_size)

        def runner_hooks(self):
            return None

    def rms_norm(x, weight, eps, residual=None):
        from fd_core.runtimes.paddle import REFERENCE_OPS
        out = REFERENCE_OPS["rms_norm"](x, weight, eps, residual)
        if residual is None:
            return out * 1.001  # a 0.1% error: far outside the spec's tolerance
        return out

    @hookimpl
    def fd_platforms():
        return [Wrong()]

    @hookimpl
    def fd_register_ops(registry):
        registry.register("rms_norm", "wrongchip", rms_norm, name="bad-rms-norm", priority=10)
        registry.use_reference("wrongchip", "paddle")
"""


def _install_wrong(tmp_path: Path, graphs: bool = False) -> Path:
    site = tmp_path / "site"
    fake_dists.install(site, "fd-backend-wrongchip", "fd_backend_wrongchip",
                       WRONG.replace("GRAPHS", str(graphs)), "wrongchip")
    return site


def test_kit_names_the_op_the_shape_and_the_error(tmp_path):
    site = _install_wrong(tmp_path)
    result = run_kit(tmp_path, "--fd-device", "wrongchip", "-k", "rms_norm", pythonpath=site)
    assert result.returncode == 1, result.stdout[-4000:]
    out = result.stdout
    assert "op rms_norm (implementation 'bad-rms-norm') on x[7, 576], float32: y differs from the spec: " \
           "max abs error" in out, out[-4000:]
    # the same op with a residual is right, and passes
    assert "4 failed, 4 passed" in summary(result), summary(result)


def test_kit_catches_a_manifest_the_backend_does_not_back(tmp_path):
    site = _install_wrong(tmp_path, graphs=True)
    result = run_kit(tmp_path, "--fd-device", "wrongchip", "-k", "manifest", pythonpath=site)
    assert result.returncode == 1
    assert "graph_capture is declared but runner_hooks() provides no wrap_forward" in result.stdout


# A two-device backend whose all_gather puts the ranks' parts in the wrong order.
SWAPPED_GATHER = """
    from fd_core.interfaces import Capabilities
    from fd_core.plugins import hookimpl

    FD_API_VERSION = "1.3"

    class Swapped:
        name = "swapchip"
        device_type = "swapchip"
        runtime = "paddle"

        def is_available(self):
            return True, ""

        def device_count(self):
            return 2

        def capabilities(self):
            return Capabilities(device_count=2, collective_library="gloo")

        def memory(self, device_index=0):
            from fd_core.runtimes.paddle import PaddleMemory
            return PaddleMemory("cpu")

        def communicator(self, rank=0, world_size=1, rendezvous=None):
            import paddle
            from fd_core.runtimes.paddle import PaddleCommunicator, init_process_group

            class Comm(PaddleCommunicator):
                def all_gather(self, tensor, axis=-1):
                    return paddle.flip(super().all_gather(tensor, axis), [axis])

            if world_size > 1:
                init_process_group(rank, world_size, rendezvous)
            return Comm(rank, world_size)

        def runner_hooks(self):
            return None

    @hookimpl
    def fd_platforms():
        return [Swapped()]

    @hookimpl
    def fd_register_ops(registry):
        registry.use_reference("swapchip", "paddle")
"""


def test_kit_runs_the_collectives_across_two_ranks_and_names_a_wrong_one(tmp_path):
    site = tmp_path / "site"
    fake_dists.install(site, "fd-backend-swapchip", "fd_backend_swapchip", SWAPPED_GATHER, "swapchip")
    result = run_kit(tmp_path, "--fd-device", "swapchip", "-k", "collective", pythonpath=site)
    assert result.returncode == 1, result.stdout[-4000:]
    assert "swapchip, float32: all_gather(axis=0) on rank 0 of 2 gave [[1.0, 1.0], [0.0, 0.0]], expected " \
           "[[0, 0], [1, 1]]" in result.stdout, result.stdout[-4000:]


def test_a_raising_is_available_is_one_failure_not_a_crash(tmp_path):
    site = tmp_path / "site"
    source = WRONG.replace("GRAPHS", "False").replace(
        'def is_available(self):\n            return True, ""',
        'def is_available(self):\n            raise OSError("the status file is unreadable")')
    assert "the status file is unreadable" in source
    fake_dists.install(site, "fd-backend-wrongchip", "fd_backend_wrongchip", source, "wrongchip")
    result = run_kit(tmp_path, "--fd-device", "wrongchip", pythonpath=site)
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-2000:]
    assert "1 failed" in summary(result) and "error" not in summary(result), summary(result)
    assert "_ test_platform_answers _" in result.stdout, result.stdout[-4000:]
    assert "OSError: the status file is unreadable" in result.stdout


# Each long-reduction case (opcases.LONG_*) with the output the kit names
LONG_CASES = [
    ("linear", "x[16, 4096] weight[256, 4096], a long reduction", "output"),
    ("linear", "x[4, 16384] weight[64, 16384], a long reduction", "output"),
    ("rms_norm", "x[4, 8192], a long reduction", "y"),
    ("rms_norm", "x[4, 8192] + residual, a long reduction", "y"),
    ("attention", ("long-context decode step [(4095, 1), (2047, 1)] q heads 8 kv heads 2 head_dim 128 "
                   "block_size 16, values of mean 1"), "output"),
]


@pytest.mark.parametrize("block", ["1", "16"], ids=["rounded-every-term", "rounded-every-16-terms"])
def test_kit_catches_sums_kept_in_bfloat16(tmp_path, block):
    """linear, rms_norm and attention keeping their sums in bfloat16 (a scalar loop's running sum;
    a kernel's bfloat16 accumulator over 16-deep tensor-core steps) fail every long-reduction
    case in bfloat16, naming op, implementation and case; in float32 the same code passes."""
    site = tmp_path / "site"
    fake_dists.install(site, "fd-backend-bf16chip", "fd_backend_bf16chip", BF16_ACCUMULATOR, "bf16chip")
    result = run_kit(tmp_path, "--fd-device", "bf16chip", "-k", "test_op_matches_the_spec and (reduction or mean)",
                     pythonpath=site, env={"FD_TEST_ACCUMULATE_BLOCK": block})
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-2000:]
    for op, label, what in LONG_CASES:
        assert f"op {op} (implementation '{op}-bf16-sum') on {label}, bfloat16: {what} differs from the spec" \
               in result.stdout, (op, label, result.stdout[-4000:])
    # the same cases in float32, where the same code is right, pass
    assert summary(result).startswith(f"{len(LONG_CASES)} failed, {len(LONG_CASES)} passed"), summary(result)


def test_kit_without_a_device_is_a_usage_error(tmp_path):
    result = run_kit(tmp_path)
    assert result.returncode == 4 and "needs --fd-device NAME" in result.stderr, result.stderr[-2000:]


def test_kit_reports_a_missing_backend(tmp_path):
    result = run_kit(tmp_path, "--fd-device", "nosuchchip", "-k", "discovered")
    assert result.returncode == 1 and "no installed backend provides it" in result.stdout


def test_compare_message():
    case = OpCase("linear", "x[2, 3] weight[4, 3]", "bfloat16")
    want = np.zeros((2, 4), np.float32)
    got = want.copy()
    got[1, 2] = 0.5
    with pytest.raises(OpMismatch) as err:
        compare(case, "mine", "output", got, want)
    assert str(err.value) == (
        "op linear (implementation 'mine') on x[2, 3] weight[4, 3], bfloat16: output differs from the spec: "
        "max abs error 0.5 at index [1, 2] (got 0.5, spec 0); 1 of 8 elements outside rtol=0.016, atol=0.016")
    compare(case, "mine", "output", want + 0.01, want)  # within bfloat16's tolerance
    with pytest.raises(OpMismatch, match="has shape \\[4, 2\\], the spec's has \\[2, 4\\]"):
        compare(case, "mine", "output", want.T, want)


# -- fd backend new -------------------------------------------------------------------------------


@pytest.mark.parametrize("runtime", ["paddle", "torch"])
def test_backend_new_installs_and_passes_the_kit_unedited(tmp_path, runtime):
    made = subprocess.run([sys.executable, "-m", "fd_core.entrypoints.cli", "backend", "new", "mychip",
                           "--output", str(tmp_path), *(["--runtime", runtime] if runtime != "paddle" else [])],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    package = tmp_path / "fd-backend-mychip"
    site = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                                "--target", str(site), str(package)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    result = run_kit(tmp_path, "--fd-device", "mychip", "--fd-emulate", pythonpath=site,
                     env={"MYCHIP_VISIBLE_DEVICES": "0,1"})
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "failed" not in summary(result) and "skipped" not in summary(result), summary(result)
    # its own op, in every dtype it declares (torch: bfloat16 too, the long reductions included)
    dtypes = {"paddle": ["float32"], "torch": ["bfloat16", "float32"]}[runtime]
    op = {"paddle": "silu_and_mul", "torch": "rms_norm"}[runtime]
    ran = run_kit(tmp_path, "--fd-device", "mychip", "--fd-emulate", "--co", "-k", f"mychip-{op.replace('_', '-')}",
                  pythonpath=site).stdout
    assert sorted({line.split("-")[1] for line in ran.splitlines() if f"[{op}-" in line}) == dtypes, ran[-3000:]
    # its own suite (the kit wired in through its pyproject, plus its platform tests)
    environ = {k: v for k, v in os.environ.items() if k != "FD_EMULATE"}
    environ["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    own = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--fd-emulate"],
                         cwd=package, env=environ, capture_output=True, text=True, timeout=600)
    assert own.returncode == 0, own.stdout[-6000:]
    assert "passed" in summary(own) and "failed" not in summary(own)


def test_the_guide_quotes_the_torch_scaffold_as_generated():
    """docs/WRITING_A_BACKEND.md shows ``fd backend new mychip --runtime torch``'s code: each block
    under a ``<!-- scaffold RUNTIME NAME: PATH -->`` line is that file as scaffold.py writes it."""
    from fd_core.entrypoints.scaffold import _files

    guide = (REPO / "docs" / "WRITING_A_BACKEND.md").read_text()
    quoted = re.findall(r"<!-- scaffold (\w+) (\w+): (\S+) -->\n```python\n(.*?)```", guide, re.DOTALL)
    assert [path for *_, path, _ in quoted] == [f"fd_backend_mychip/{f}.py" for f in ("platform", "ops", "plugin")]
    for runtime, name, path, text in quoted:
        assert text == _files(name, runtime)[path], f"the guide's {path} is not what fd backend new writes"


def test_backend_new_refuses_bad_or_taken_names(tmp_path, capsys):
    from fd_core.entrypoints.cli import main

    assert main(["backend", "new", "Bad-Name", "--output", str(tmp_path)]) == 2
    assert main(["backend", "new", "cpu", "--output", str(tmp_path)]) == 2
    assert main(["backend", "new", "okchip", "--output", str(tmp_path)]) == 0
    assert main(["backend", "new", "okchip", "--output", str(tmp_path)]) == 2  # the folder exists
    assert not (tmp_path / "fd-backend-bad-name").exists()
    capsys.readouterr()
    assert main(["backend", "new", "jaxchip", "--runtime", "jax", "--output", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "fd: error: --runtime jax: fd backend new writes a backend on paddle or torch\n"
    assert not (tmp_path / "fd-backend-jaxchip").exists()
