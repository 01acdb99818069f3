"""fd's entry point for this package: the CUDA platform and its Triton ops."""

from __future__ import annotations

from fd_core.plugins import hookimpl

FD_API_VERSION = "1.21"  # advance_sample: a round's later steps made on the device (1.21); attach_sampler / with_sample: the draw in decode graphs (1.20); rotary_attention (1.19); attach_head / with_head: the LM head in decode graphs (1.18); the cuda_ipc device KV connector (1.16, hook of 1.14); graphs of verification steps (1.13); deferred_bitmask (1.12); its sampler adds logit biases (1.11) and applies grammar bitmasks (1.10), pack_experts (1.8), moe's expert_offset (1.7), quantized KV caches (1.6); pack_linear and per-method linear (1.5); sample_async (1.3); 1.2's noise


@hookimpl
def fd_platforms():
    from fd_backend_cuda.platform import CudaPlatform

    return [CudaPlatform()]


@hookimpl
def fd_kv_transfers():
    def cuda_ipc(timeout: float):
        from fd_backend_cuda.kv_ipc import CudaIpcTransfer  # torch only when chosen

        return CudaIpcTransfer(timeout)

    return {"cuda_ipc": cuda_ipc}


@hookimpl
def fd_register_ops(registry):
    from fd_backend_cuda.platform import CudaPlatform

    # The rest are this backend's on purpose: embedding and float32 linears are torch's own CUDA
    # kernels (cuBLAS for the matmuls), not a fallback.
    registry.use_reference("cuda", "torch")
    if not CudaPlatform().is_available()[0]:
        return  # no GPU here: the table is never selected, and the kernels would import torch and triton
    try:
        from fd_backend_cuda import ops
    except ImportError:  # no triton: the torch reference ops serve every op
        return

    def supports_for(op):
        def check(dtype=None, head_dim=None, **_):
            import torch

            return ops.supports(op, getattr(torch, dtype) if isinstance(dtype, str) else dtype, head_dim)

        return check

    for op, fn in ops.OPS.items():
        registry.register(op, "cuda", fn, name=f"triton-{op}", priority=10, supports=supports_for(op),
                          runtime="torch")

    def plain_half(quantization=None, dtype=None, **_):
        import torch

        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return quantization is None and dtype in (torch.float16, torch.bfloat16)

    plain_half.why = lambda **_: "it serves plain float16/bfloat16 weights (float32 ones: cuBLAS through torch)"
    # plain linear: the few-row kernel for decode steps of 1-4 sequences, cuBLAS otherwise
    registry.register("linear", "cuda", ops.linear, name="triton-gemv", priority=10, supports=plain_half,
                      runtime="torch")

    def quantized(quantization=None, **_):
        return quantization in ops.QUANTIZED_METHODS

    quantized.why = lambda **_: "it serves wint8, wint4 and block_wise_fp8 weights only"
    # weight-only quantized linear (kernels/quantized_linear.py): chosen per method, never for
    # plain weights, which cuBLAS serves
    for op, fn in (("linear", ops.quantized_linear), ("pack_linear", ops.pack_linear)):
        registry.register(op, "cuda", fn, name="triton-quantized", priority=10, supports=quantized,
                          runtime="torch")

    def experts(quantization=None, **context):
        return supports_for("moe")(**context) and quantization in (None, *ops.QUANTIZED_METHODS)

    experts.why = lambda **_: "it serves float32/float16/bfloat16 models with plain, wint8, wint4 or block_wise_fp8 experts"
    # the fused MoE (kernels/moe.py) reads the experts its own pack_experts stacked at load
    for op, fn in (("moe", ops.moe), ("pack_experts", ops.pack_experts)):
        registry.register(op, "cuda", fn, name="triton-moe", priority=10, supports=experts, runtime="torch")
