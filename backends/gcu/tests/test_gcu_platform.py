"""The gcu platform without the chip (fd_core.testing.paddle_device's checks): detection through
a faked gcu custom device, the sentence when unavailable, the manifest, the emulated op table."""

from __future__ import annotations

from fd_core.testing.paddle_device import CustomDeviceChecks

from fd_backend_gcu import plugin
from fd_backend_gcu.platform import GcuPlatform


class TestGcuPlatform(CustomDeviceChecks):
    platform_class = GcuPlatform
    plugin = plugin
    paddle_device = "gcu"
    visible_devices_env = "TOPS_VISIBLE_DEVICES"
    not_built = "is not built with the gcu custom device; install paddle-custom-gcu"
    dtypes = frozenset({"float32", "float16"})  # its swiglu has no bfloat16
