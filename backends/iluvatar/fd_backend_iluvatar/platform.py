"""The Iluvatar CoreX platform (BI-V150): Paddle's ``iluvatar_gpu`` custom device
(paddle-iluvatar-gpu), places ``iluvatar_gpu:N``, collectives on the custom-device XCCL."""

from __future__ import annotations

from fd_core.interfaces import Capabilities
from fd_core.runtimes.paddle.device import PaddleCustomDevicePlatform


class IluvatarPlatform(PaddleCustomDevicePlatform):
    name = "iluvatar"
    device_type = "iluvatar"
    paddle_device = "iluvatar_gpu"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"  # Iluvatar's CUDA-compatible runtime reads it
    requirement = "paddle-iluvatar-gpu"
    device_nodes = ("/dev/iluvatar*",)  # the CoreX driver's /dev/iluvatar0..

    def chip_capabilities(self) -> Capabilities:
        # float16/bfloat16: the plugin registers rms_norm, swiglu and fused rope for float32,
        # float16 and bfloat16. No memory query: PaddleMemory has no custom-device branch.
        return self.manifest(("float32", "float16", "bfloat16"))
