"""The Iluvatar CoreX platform (BI-V150): Paddle's ``iluvatar_gpu`` custom device
(paddle-iluvatar-gpu), places ``iluvatar_gpu:N``, collectives on the custom-device XCCL."""

from __future__ import annotations

from fd_core.interfaces import Capabilities
from fd_core.runtimes.paddle.device import PaddleDevicePlatform, custom_device_count


class IluvatarPlatform(PaddleDevicePlatform):
    name = "iluvatar"
    device_type = "iluvatar"
    paddle_device = "iluvatar_gpu"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"  # Iluvatar's CUDA-compatible runtime reads it
    collective_backend = "xccl"
    collective_library = "xccl"
    requirement = "paddle-iluvatar-gpu"

    def probe(self) -> tuple[int, str]:
        import paddle

        if not paddle.is_compiled_with_custom_device(self.paddle_device):
            return self.not_built(paddle, "the iluvatar_gpu custom device")
        count = custom_device_count(self.paddle_device)
        return (count, "") if count else self.no_device(paddle)

    def chip_capabilities(self) -> Capabilities:
        # float16/bfloat16: the plugin registers rms_norm, swiglu and fused rope for float32,
        # float16 and bfloat16. No memory query: PaddleMemory has no custom-device branch.
        return self.manifest(("float32", "float16", "bfloat16"))
