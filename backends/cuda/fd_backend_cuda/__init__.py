"""fd-backend-cuda: Triton kernels for fd's hot ops on NVIDIA GPUs.

``fd_backend_cuda.ops`` exposes the kernels under the op contract's exact signatures
(``fd_core.interfaces.ops``); ``fd_backend_cuda.kernels`` holds one module per kernel family.
Every op falls back to nothing here: a backend routes what ``ops.supports`` refuses to the
reference implementation.
"""
