"""The iluvatar platform without the chip (fd_core.testing.paddle_device's checks): detection
through a faked iluvatar_gpu custom device, the sentence when unavailable, the manifest, the
emulated op table."""

from __future__ import annotations

from fd_core.testing.paddle_device import CustomDeviceChecks

from fd_backend_iluvatar import plugin
from fd_backend_iluvatar.platform import IluvatarPlatform


class TestIluvatarPlatform(CustomDeviceChecks):
    platform_class = IluvatarPlatform
    plugin = plugin
    paddle_device = "iluvatar_gpu"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"  # Iluvatar's CUDA-compatible runtime reads it
    not_built = "is not built with the iluvatar_gpu custom device; install paddle-iluvatar-gpu"
    dtypes = frozenset({"float32", "float16", "bfloat16"})
