"""The CPU's block kernels for wint4/wint8 (fd_core/backends/cpu/blocks.py): the dequantized
weight's float32 product within summation-order rounding at every row count, the rule that
picks them (AVX2 without AVX-512, a compiler, FD_CPU_BLOCKS), a failed build that falls back to
ATen's kernels with one warning, and the quantized LM head the capability keeps."""

from __future__ import annotations

import logging

import pytest

from fd_core.backends.cpu import blocks
from fd_core.host import cpu_flags
from fd_core.interfaces import QuantizedWeight

torch = pytest.importorskip("torch")

needs_kernels = pytest.mark.skipif(
    not ({"avx2", "fma"} <= (cpu_flags() or frozenset()) and blocks.compiler()),
    reason="the block kernels need AVX2, FMA and a C++ compiler")


def _weight(method: str, out: int, inp: int, group: int, zeros: bool, seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    low, high = (-8, 8) if method == "wint4" else (-128, 128)
    q = torch.randint(low, high, (out, inp), generator=g, dtype=torch.int8)
    scales = torch.rand(out, inp // group, generator=g) * 0.02 + 1e-3
    z = (torch.rand(out, inp // group, generator=g) - 0.5) * 0.1 if zeros else None
    return QuantizedWeight(method, q, scales, group, (out, inp), z)


@needs_kernels
@pytest.mark.parametrize("method,group,zeros", [("wint4", 32, True), ("wint4", 32, False), ("wint4", 128, True),
                                                ("wint8", 32, False), ("wint8", 64, True)])
def test_block_product_is_the_dequantized_weights(method, group, zeros):
    from fd_core.runtimes.torch.ops import dequantize

    weight = _weight(method, 48, 256, group, zeros)
    packed = blocks.pack(weight)
    assert packed.layout == blocks.LAYOUTS[method] and packed.group_size == blocks.BLOCK
    dense = dequantize(weight, torch.float64)
    for rows in (1, 2, 7, 8, 9, 16, 17):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        got = blocks.linear(x, packed)
        want = x.double() @ dense.T
        scale = (x.double().abs() @ dense.abs().T).max().item()  # the size of the sums' terms
        assert got.dtype == torch.float32 and got.shape == (rows, 48)
        assert (got.double() - want).abs().max().item() <= 1e-6 * scale, (method, group, zeros, rows)
    # no rows, and leading dimensions kept
    assert blocks.linear(torch.zeros(0, 256), packed).shape == (0, 48)
    assert blocks.linear(torch.randn(2, 3, 256), packed).shape == (2, 3, 48)


@needs_kernels
@pytest.mark.parametrize("method", ["wint4", "wint8"])
def test_a_wide_input_goes_in_slices(method):
    """1,056 inputs (33 blocks): eight rows take the input in slices of 16 blocks, the last one
    block long; three rows take it whole."""
    from fd_core.runtimes.torch.ops import dequantize

    weight = _weight(method, 40, 1056, 32, True, seed=1)
    packed, dense = blocks.pack(weight), dequantize(weight, torch.float64)
    for rows in (3, 8, 9, 16, 17):
        x = torch.randn(rows, 1056, generator=torch.Generator().manual_seed(rows))
        want = x.double() @ dense.T
        scale = (x.double().abs() @ dense.abs().T).max().item()
        assert (blocks.linear(x, packed).double() - want).abs().max().item() <= 1e-6 * scale, (method, rows)


def test_the_rule(monkeypatch):
    monkeypatch.delenv("FD_CPU_BLOCKS", raising=False)
    monkeypatch.setattr(blocks, "compiler", lambda: "/usr/bin/c++")
    monkeypatch.setattr(blocks, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma"}))
    assert blocks.wanted()
    monkeypatch.setenv("FD_CPU_BLOCKS", "0")
    assert not blocks.wanted()
    monkeypatch.delenv("FD_CPU_BLOCKS")
    # ATen's int4 kernel is vectorised for AVX-512: it stays there
    monkeypatch.setattr(blocks, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    assert not blocks.wanted()
    monkeypatch.setattr(blocks, "cpu_flags", lambda: frozenset({"avx", "sse4_2"}))
    assert not blocks.wanted()
    monkeypatch.setattr(blocks, "cpu_flags", lambda: None)  # not Linux
    assert not blocks.wanted()
    monkeypatch.setattr(blocks, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setattr(blocks, "compiler", lambda: None)
    assert not blocks.wanted()
    # what fits: groups of whole blocks
    assert blocks.fits(_weight("wint4", 16, 64, 32, True)) and blocks.fits(_weight("wint8", 16, 128, 64, False))
    assert not blocks.fits(_weight("wint4", 16, 48, 16, True))
    assert not blocks.fits(QuantizedWeight("wint8", torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, 1), -1,
                                           (16, 64)))


@needs_kernels
def test_a_failed_build_warns_once_and_aten_runs(tmp_path, monkeypatch, caplog):
    from fd_core.backends.cpu import torch_quantized

    broken = tmp_path / "blocks_avx2.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(blocks, "SOURCE", broken)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(blocks, "wanted", lambda: True)
    blocks.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="fd.cpu"):
            packed = torch_quantized.pack_linear(_weight("wint4", 32, 64, 32, True))
            torch_quantized.pack_linear(_weight("wint4", 32, 64, 32, True))
        warnings = [r.getMessage() for r in caplog.records if "did not build" in r.getMessage()]
        assert len(warnings) == 1 and "ATen" in warnings[0], warnings
        assert packed.layout == "cpu_int4pack"
        assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-built is cached
    finally:
        blocks.library.cache_clear()


@needs_kernels
def test_the_build_is_cached_and_shared(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    blocks.library.cache_clear()
    try:
        assert blocks.library() is not None
        built = list((tmp_path / "fd" / "kernels").glob("blocks_avx2-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        blocks.library.cache_clear()
        assert blocks.library() is not None and built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    finally:
        blocks.library.cache_clear()


def test_the_platform_declares_a_quantized_head_only_with_the_kernels(monkeypatch):
    from fd_core.backends.cpu import CpuPlatform

    monkeypatch.setattr(blocks, "wanted", lambda: True)
    assert CpuPlatform("torch").capabilities().quantized_lm_head == {"wint8"}
    assert CpuPlatform("paddle").capabilities().quantized_lm_head == frozenset()
    monkeypatch.setattr(blocks, "wanted", lambda: False)
    assert CpuPlatform("torch").capabilities().quantized_lm_head == frozenset()
