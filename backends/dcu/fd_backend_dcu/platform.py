"""The Hygon DCU platform (K100AI): Paddle's ROCm (DTK) build, which addresses the DCU as a GPU
(places ``gpu:N``); collectives on ``paddle.distributed``'s nccl backend, RCCL in that build."""

from __future__ import annotations

from fd_core.interfaces import Capabilities
from fd_core.runtimes.paddle.device import PaddleDevicePlatform


class DcuPlatform(PaddleDevicePlatform):
    name = "dcu"
    device_type = "dcu"
    paddle_device = "gpu"
    visible_devices_env = "HIP_VISIBLE_DEVICES"
    collective_backend = "nccl"
    collective_library = "rccl"
    requirement = "paddlepaddle-dcu (Paddle's ROCm build)"
    device_nodes = ("/dev/kfd",)  # ROCm's (and Hygon DTK's) kernel driver interface

    def probe(self) -> tuple[int, str]:
        import paddle

        if not paddle.is_compiled_with_rocm():
            if paddle.is_compiled_with_cuda():  # true for ROCm builds too, so this one is CUDA's
                return 0, (f"paddle {paddle.__version__} is the CUDA build, not the ROCm one a Hygon DCU "
                           f"needs; install {self.requirement}")
            return self.not_built(paddle, "ROCm (Hygon DCU) support")
        count = paddle.device.cuda.device_count()
        return (count, "") if count else self.no_device(paddle)

    def chip_capabilities(self) -> Capabilities:
        # The ROCm build's place is a CUDAPlace: PaddleMemory reports free/total memory from
        # the device properties and its allocator, and pins host KV blocks for swapping.
        return self.manifest(("float32", "float16", "bfloat16"), memory_query=True, pinned_host_memory=True)
