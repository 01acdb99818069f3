"""The Kunlunxin XPU platform (P800): paddlepaddle-xpu, places ``xpu:N``, collectives on BKCL."""

from __future__ import annotations

from fd_core.interfaces import Capabilities
from fd_core.runtimes.paddle.device import PaddleDevicePlatform


class XpuPlatform(PaddleDevicePlatform):
    name = "xpu"
    device_type = "xpu"
    paddle_device = "xpu"
    visible_devices_env = "XPU_VISIBLE_DEVICES"
    collective_backend = "bkcl"
    collective_library = "bkcl"
    requirement = "paddlepaddle-xpu"
    device_nodes = ("/dev/xpu[0-9]*",)  # the Kunlunxin driver's /dev/xpu0.. (containers are started with --device=/dev/xpuN)

    def probe(self) -> tuple[int, str]:
        import paddle

        if not paddle.is_compiled_with_xpu():
            return self.not_built(paddle, "XPU support")
        count = paddle.device.xpu.device_count()
        return (count, "") if count else self.no_device(paddle)

    def chip_capabilities(self) -> Capabilities:
        # float16/bfloat16: Paddle's XPU rms_norm, swiglu and fused rope kernels are registered
        # for float32, float16 and bfloat16. No memory query: PaddleMemory.memory_info answers
        # for the CPU and CUDA places only.
        return self.manifest(("float32", "float16", "bfloat16"))
