"""The Enflame GCU platform (S60): Paddle's ``gcu`` custom device (paddle-custom-gcu), places
``gcu:N``, collectives on the custom-device XCCL."""

from __future__ import annotations

from fd_core.interfaces import Capabilities
from fd_core.runtimes.paddle.device import PaddleDevicePlatform, custom_device_count


class GcuPlatform(PaddleDevicePlatform):
    name = "gcu"
    device_type = "gcu"
    paddle_device = "gcu"
    visible_devices_env = "TOPS_VISIBLE_DEVICES"
    collective_backend = "xccl"
    collective_library = "xccl"
    requirement = "paddle-custom-gcu"

    def probe(self) -> tuple[int, str]:
        import paddle

        if not paddle.is_compiled_with_custom_device(self.paddle_device):
            return self.not_built(paddle, "the gcu custom device")
        count = custom_device_count(self.paddle_device)
        return (count, "") if count else self.no_device(paddle)

    def chip_capabilities(self) -> Capabilities:
        # No bfloat16: the plugin's swiglu (which Paddle's reference silu_and_mul calls too) is
        # registered for float32 and float16 only. No memory query: no custom-device branch in
        # PaddleMemory.
        return self.manifest(("float32", "float16"))
