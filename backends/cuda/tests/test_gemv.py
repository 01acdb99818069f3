"""The few-row plain linear kernel (``kernels/gemv.py``) against a float64 product on the same
rounded inputs, held to the specification's ``linear`` tolerance for the dtype.

Without a CUDA device the kernel runs on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, set before Triton is imported), so shapes are kept small. Outputs are
of order 1 (weights scaled by ``K ** -0.5``), so the bounds (1.6e-2 in bfloat16, 2e-3 in
float16, 1e-4 in float32) are a few output roundings, far under a wrong element's error.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fd_core.testing import spec  # noqa: E402

from fd_backend_cuda.kernels.gemv import Config, choose_config, gemv, supports  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (N, K): N not a multiple of the block rows, K not a multiple of the step, both aligned
SHAPES = [(24, 40), (37, 300), (64, 128)]


def rand(shape, dtype, seed, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def check(x2, w, bias, got) -> None:
    want = x2.double() @ w.double().t()
    if bias is not None:
        want += bias.double()
    assert got.dtype == x2.dtype and got.shape == want.shape
    tol = spec.tolerance("linear", str(x2.dtype).removeprefix("torch."))
    torch.testing.assert_close(got.double().cpu(), want.cpu(), **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv(dtype, n, k, m, with_bias):
    x2 = rand((m, k), dtype, 1)
    w = rand((n, k), dtype, 2, scale=k**-0.5)
    bias = rand((n,), dtype, 3) if with_bias else None
    assert supports(x2, w)
    check(x2, w, bias, gemv(x2, w, bias))


CONFIGS = [
    Config(4, 64),  # several steps and a masked tail (K = 300)
    Config(8, 128, num_warps=2, prefetch=True),
    Config(1, 512, num_warps=8),  # one masked step
    Config(16, 32, prefetch=True),
    Config(16, 64, dot=True),
    Config(32, 512, dot=True, num_stages=2),
]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_configs(config, m):
    """Every launch configuration computes the same product."""
    n, k = 37, 300
    x2 = rand((m, k), torch.bfloat16, 4)
    w = rand((n, k), torch.bfloat16, 5, scale=k**-0.5)
    bias = rand((n,), torch.bfloat16, 6)
    check(x2, w, bias, gemv(x2, w, bias, config=config))


def test_gemv_strided_rows():
    """x's rows may be spaced wider than K (a slice of a wider activation)."""
    wide = rand((3, 96), torch.float32, 7)
    x2 = wide[:, 16:80]
    w = rand((40, 64), torch.float32, 8, scale=0.125)
    assert supports(x2, w)
    check(x2, w, None, gemv(x2, w))


@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_of_no_input_features_is_the_bias(with_bias):
    """K = 0: zeros (plus the bias), with no launch (the kernel would read a weight tile)."""
    x2 = torch.empty((2, 0), dtype=torch.bfloat16, device=DEVICE)
    w = torch.empty((24, 0), dtype=torch.bfloat16, device=DEVICE)
    bias = rand((24,), torch.bfloat16, 11) if with_bias else None
    got = gemv(x2, w, bias)
    want = torch.zeros((2, 24), dtype=torch.bfloat16, device=DEVICE) + (0 if bias is None else bias)
    assert torch.equal(got, want)


def test_supports():
    x2 = rand((2, 64), torch.bfloat16, 9)
    w = rand((32, 64), torch.bfloat16, 10)
    assert supports(x2, w)
    assert not supports(rand((5, 64), torch.bfloat16, 9), w)  # too many rows
    assert not supports(x2[:0], w)
    assert not supports(x2.float(), w)  # dtypes differ
    assert not supports(x2, w[:, :32])  # K differs (and not contiguous)
    assert not supports(x2, w.t().contiguous().t())  # not contiguous
    assert not supports(x2[:, ::2], w[:, :32].contiguous())  # x not unit-stride along K
    assert not supports(x2.to(torch.int32), w.to(torch.int32))


def test_choose_config():
    """At least one program per SM even at N = 1024, unmasked steps where K allows, tensor
    cores only for 16-bit operands of more than one row."""
    shapes = [(1024, 2048), (2560, 1024), (1024, 3072), (28672, 4096), (4096, 14336), (103424, 1024)]
    for m in (1, 2, 3, 4):
        for n, k in shapes:
            c = choose_config(m, n, k)
            assert -(-n // c.block_n) >= 132 and k % c.block_k == 0
            assert c.dot == (m > 1 and (2 if m == 2 else 4) * n >= 16384)
            assert not choose_config(m, n, k, tensor_cores=False).dot
    assert choose_config(1, 64, 40).block_k == 64  # one masked step


@pytest.mark.parametrize("method", ["wint8", "block_wise_fp8"])
@pytest.mark.parametrize("n,k", [(200, 384), (37, 320), (130, 128), (3, 4096)])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantized_linear_of_one_row_runs_the_8bit_kernels(method, n, k, m, dtype):
    """wint8 (one scale a row) and block_wise_fp8 (128 x 128 blocks, partial at the edges) at
    one row: the quantized ``linear`` takes these kernels (at two, the tiled kernel), and
    matches the specification (which dequantizes the weight, then multiplies)."""
    import numpy as np
    from fd_core.quantization.host import upload_quantized
    from fd_core.quantization.quantize import quantize
    from fd_core.runtimes.torch.memory import TorchMemory

    from fd_backend_cuda.kernels import gemv as gemv_module
    from fd_backend_cuda.kernels.quantized_linear import linear, pack_linear

    rng = np.random.default_rng(n + k + m)
    w = (rng.standard_normal((n, k)) * k**-0.5).astype(np.float32)
    qw = quantize(w, method, -1 if method == "wint8" else 128)
    packed = pack_linear(upload_quantized(qw, TorchMemory(str(DEVICE))))
    x2 = rand((m, k), dtype, 12)
    bias = rand((n,), dtype, 13)
    kind = gemv_module.ROW_SCALES if method == "wint8" else gemv_module.FP8_BLOCKS
    assert gemv_module.supports_8bit(x2, packed.qweight, packed.scales, kind) == (m == 1)
    calls = []
    original = gemv_module.gemv_8bit
    gemv_module.gemv_8bit = lambda *a, **kw: calls.append(1) or original(*a, **kw)
    try:
        got = linear(x2, packed, bias)
    finally:
        gemv_module.gemv_8bit = original
    assert bool(calls) == (m == 1) and got.dtype == dtype and got.shape == (m, n)
    if m > 1 and DEVICE.type == "cpu" and dtype == torch.bfloat16:
        return  # the tiled kernel's bfloat16 dots: Triton 3.6's interpreter computes them wrong
    want = spec.linear(x2.float().cpu().numpy(), qw, bias.float().cpu().numpy())
    np.testing.assert_allclose(got.float().cpu().numpy(), want,
                               **spec.tolerance("linear", "float32" if dtype == torch.float32 else "bfloat16", method))


def test_supports_8bit():
    from fd_backend_cuda.kernels.gemv import FP8_BLOCKS, ROW_SCALES, supports_8bit

    x2 = rand((1, 256), torch.bfloat16, 14)
    q8 = torch.zeros((300, 256), dtype=torch.int8, device=DEVICE)
    assert supports_8bit(x2, q8, torch.ones((300, 1), device=DEVICE), ROW_SCALES)
    assert not supports_8bit(x2, q8, torch.ones((300, 2), device=DEVICE)[:150], ROW_SCALES)  # a row per scale
    assert not supports_8bit(x2, q8, torch.ones((300, 1), device=DEVICE), FP8_BLOCKS)  # int8 is not float8
    bits = q8.view(torch.uint8)
    assert supports_8bit(x2, bits, torch.ones((3, 4), device=DEVICE), FP8_BLOCKS)  # K padded to 4 blocks
    assert not supports_8bit(x2, bits, torch.ones((2, 2), device=DEVICE), FP8_BLOCKS)  # too few row blocks
    assert not supports_8bit(x2, bits, torch.ones((3, 1), device=DEVICE), FP8_BLOCKS)  # too few column blocks
    assert not supports_8bit(rand((2, 256), torch.bfloat16, 14), bits, torch.ones((3, 2), device=DEVICE), FP8_BLOCKS)


@pytest.mark.parametrize("config", [Config(1, 128), Config(2, 256, prefetch=True), Config(4, 512, 2, prefetch=True)],
                         ids=str)
@pytest.mark.parametrize("k", [384, 320])
def test_fp8_one_row_configs(config, k):
    """Every float8 launch (steps of one block or several, a ragged last step, prefetched or
    not) computes the same product; steps that cut a 128-column block are refused."""
    import numpy as np
    from fd_core.quantization.host import upload_quantized
    from fd_core.quantization.quantize import quantize
    from fd_core.runtimes.torch.memory import TorchMemory

    from fd_backend_cuda.kernels.gemv import FP8_BLOCKS, gemv_8bit
    from fd_backend_cuda.kernels.quantized_linear import pack_linear

    w = (np.random.default_rng(k).standard_normal((150, k)) * k**-0.5).astype(np.float32)
    qw = quantize(w, "block_wise_fp8", 128)
    packed = pack_linear(upload_quantized(qw, TorchMemory(str(DEVICE))))
    x2 = rand((1, k), torch.bfloat16, 15)
    got = gemv_8bit(x2, packed.qweight, packed.scales, FP8_BLOCKS, config=config)
    want = spec.linear(x2.float().cpu().numpy(), qw)
    np.testing.assert_allclose(got.float().cpu().numpy(), want, **spec.tolerance("linear", "bfloat16", "block_wise_fp8"))
    with pytest.raises(ValueError, match="128-column blocks"):
        gemv_8bit(x2, packed.qweight, packed.scales, FP8_BLOCKS, config=Config(2, 64))
