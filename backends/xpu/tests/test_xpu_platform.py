"""The xpu platform without the chip (fd_core.testing.paddle_device's checks): detection through
a faked paddlepaddle-xpu, the sentence when unavailable, the manifest, the emulated op table."""

from __future__ import annotations

import paddle
from fd_core.testing.paddle_device import PaddleDeviceChecks

from fd_backend_xpu import plugin
from fd_backend_xpu.platform import XpuPlatform


class TestXpuPlatform(PaddleDeviceChecks):
    platform_class = XpuPlatform
    plugin = plugin
    paddle_device = "xpu"
    visible_devices_env = "XPU_VISIBLE_DEVICES"
    collectives = ("bkcl", "bkcl")
    not_built = "is not built with XPU support; install paddlepaddle-xpu"
    dtypes = frozenset({"float32", "float16", "bfloat16"})

    def fake_paddle(self, monkeypatch, built: bool, count: int) -> None:
        monkeypatch.setattr(paddle, "is_compiled_with_xpu", lambda: built)
        monkeypatch.setattr(paddle.device.xpu, "device_count", lambda: count)
