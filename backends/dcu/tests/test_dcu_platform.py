"""The dcu platform without the chip (fd_core.testing.paddle_device's checks): detection through
a faked ROCm (DTK) Paddle, the sentences when unavailable (the CUDA build named), the manifest,
the emulated op table."""

from __future__ import annotations

import paddle
from fd_core.testing.paddle_device import PaddleDeviceChecks

from fd_backend_dcu import plugin
from fd_backend_dcu.platform import DcuPlatform


class TestDcuPlatform(PaddleDeviceChecks):
    platform_class = DcuPlatform
    plugin = plugin
    paddle_device = "gpu"
    visible_devices_env = "HIP_VISIBLE_DEVICES"
    collectives = ("nccl", "rccl")
    not_built = "is not built with ROCm (Hygon DCU) support; install paddlepaddle-dcu (Paddle's ROCm build)"
    dtypes = frozenset({"float32", "float16", "bfloat16"})
    memory_query = True
    pinned_host_memory = True

    def fake_paddle(self, monkeypatch, built: bool, count: int, cuda: bool | None = None) -> None:
        """The ROCm build also says it is compiled with CUDA; ``cuda`` fakes the CUDA build."""
        monkeypatch.setattr(paddle, "is_compiled_with_rocm", lambda: built)
        monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: built if cuda is None else cuda)
        monkeypatch.setattr(paddle.device.cuda, "device_count", lambda: count)

    def test_the_cuda_build_is_named(self, monkeypatch, driver):
        self.fake_paddle(monkeypatch, built=False, count=2, cuda=True)
        ok, why = DcuPlatform().is_available()
        assert not ok and "is the CUDA build, not the ROCm one" in why and "install paddlepaddle-dcu" in why
