"""The Enflame GCU platform (S60): Paddle's ``gcu`` custom device (paddle-custom-gcu), places
``gcu:N``, collectives on the custom-device XCCL."""

from __future__ import annotations

from fd_core.interfaces import Capabilities
from fd_core.runtimes.paddle.device import PaddleCustomDevicePlatform


class GcuPlatform(PaddleCustomDevicePlatform):
    name = "gcu"
    device_type = "gcu"
    paddle_device = "gcu"
    visible_devices_env = "TOPS_VISIBLE_DEVICES"
    requirement = "paddle-custom-gcu"
    device_nodes = ("/dev/gcu[0-9]*",)  # the Enflame driver's /dev/gcu0..

    def chip_capabilities(self) -> Capabilities:
        # No bfloat16: the plugin's swiglu (which Paddle's reference silu_and_mul calls too) is
        # registered for float32 and float16 only. No memory query: no custom-device branch in
        # PaddleMemory.
        return self.manifest(("float32", "float16"))
