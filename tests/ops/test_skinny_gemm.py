"""The skinny (decode-size) GEMM, ops.triton.layer.skinny_gemm, against ops.reference.skinny_gemm, and its
dispatch (dispatch.skinny_linear, layers.linear.Linear).

On CPU the kernels run under Triton's interpreter (bf16 rounding emulated on the bits, fp32 dots for
bf16: see skinny_gemm.rounding_modes); on CUDA compiled, and then also against F.linear (cuBLAS).

Tolerance. Both sides sum the same exact products (16-bit x 16-bit products are exact in fp32) in fp32,
in different orders (the kernel by BLOCK_K tiles and K-splits, the reference by its matmul's blocking).
Each fp32 sum of K terms is within K * u * S of the exact value (u = 2^-24, S = sum_k |x_k w_k| + |b|;
the worst-case bound of recursive summation, +1 term for the bias), so the two differ by at most
2 (K + 1) u S; the one rounding to the output dtype then adds at most one ulp of the output:
|kernel - reference| <= 2 (K + 1) u S + ulp(reference), element by element. A missing tile, a wrong
mask, stride or bias, or a 16-bit accumulator breaks that bound by orders of magnitude. For 16-bit
outputs most elements must also be bit-equal: the two fp32 sums straddle a rounding boundary only
where they lie within ~K u S of one (measured over 20 seeds of these cases: at most 0.06% of the
elements in bf16 and one element of 100 in fp16, 0.006% / 0.08% on average); the limits, 1% / 3% (at
least 2 elements), still fail rounding at the wrong point (before the bias, or twice).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from moekv.ops import dispatch
from moekv.ops.reference.skinny_gemm import skinny_gemm as reference
from moekv.ops.triton.layer import skinny_gemm as sk

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_SIGNIFICAND_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
_MAX_DIFFERING = {torch.bfloat16: 0.01, torch.float16: 0.03}      # see the module docstring

# (variant, config), "fma" at M == 1 only (M > 1 runs "dot"): defaults (K = 200 < BLOCK_K: the masked
# tail step alone), then small tiles with several programs, a clamped last column block, full K steps
# + a tail, and 3 K-splits (+ the reduce kernel).
SMALL = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 3}
CASES = [("dot", None), ("dot", SMALL), ("fma", None), ("fma", dict(SMALL, BLOCK_N=4, UNROLL=2))]


def _rand(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)


def _ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `dtype` at each value (float64; normal range)."""
    _, exponent = torch.frexp(values.double())
    return torch.exp2((exponent - 1 - _SIGNIFICAND_BITS[dtype]).double())


def assert_matches(actual, x, weight, bias, expected=None, count_differing=True, rounded_product=False):
    """actual ~ the reference within 2 (K + 1) u S + 1 ulp, and (count_differing) mostly bit-equal for
    16-bit outputs -- not where the sum cancels to far below S (the fp32 orders then differ by many
    output ulps). `rounded_product`: `expected` rounded x w^T to the output dtype before adding the
    bias (cuBLAS does at M = 1, measured on an H200), so one ulp of the product is added to the bound."""
    expected = reference(x, weight, bias) if expected is None else expected
    assert actual.shape == expected.shape and actual.dtype == expected.dtype == x.dtype
    assert torch.isfinite(actual).all()
    k = x.shape[1]
    scale = x.double().abs() @ weight.double().abs().t()
    if bias is not None:
        scale = scale + bias.double().abs()
    bound = 2 * (k + 1) * 2.0 ** -24 * scale + _ulp(expected, x.dtype)
    if rounded_product:
        bound = bound + _ulp(x.double() @ weight.double().t(), x.dtype)
    error = (actual.double() - expected.double()).abs()
    worst = (error / bound).max()
    assert worst <= 1, f"error {error.max():.3e} exceeds its bound (worst ratio {worst:.2f})"
    if count_differing and x.dtype in _MAX_DIFFERING:
        differing = int((actual != expected).sum())
        assert differing <= max(2, _MAX_DIFFERING[x.dtype] * actual.numel()), (
            f"{differing} of {actual.numel()} elements differ")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("M,variant,config", [(M, v, c) for M in (1, 3, 16, 17, 40, 64) for v, c in CASES if v == "dot" or M == 1],
                         ids=lambda p: p if isinstance(p, (int, str)) else "small-split" if p else "default")
def test_matches_reference(device, dtype, M, has_bias, variant, config):
    gen = torch.Generator().manual_seed(M * 7 + has_bias)
    K, N = 200, 100                                        # neither a multiple of any block size
    x = _rand((M, K), dtype, device, gen)
    weight = _rand((N, K), dtype, device, gen, 0.05)
    bias = _rand((N,), dtype, device, gen) if has_bias else None
    out = sk.skinny_gemm(x, weight, bias, config=config, variant=variant)
    assert_matches(out, x, weight, bias)
    if out.is_cuda:        # and cuBLAS, by the same argument; at M = 1 it rounds x w^T before the bias
        double = has_bias and M == 1 and dtype != torch.float32
        assert_matches(out, x, weight, bias, expected=F.linear(x, weight, bias), count_differing=not double,
                       rounded_product=double)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["dot", "fma"])
def test_even_k_and_strided_views(device, dtype, variant):
    """K a multiple of BLOCK_K (no tail step), N < BLOCK_N, a weight row stride larger than K and a
    non-contiguous x (copied)."""
    gen = torch.Generator().manual_seed(3)
    K, N = 128, 10
    base = _rand((N, K + 16), dtype, device, gen)
    weight = base[:, 8:8 + K]                             # row stride K + 16, K contiguous
    x = _rand((1, 2 * K), dtype, device, gen)[:, ::2]     # [1, K], K stride 2: the wrapper copies it
    config = {"BLOCK_K": 32} if variant == "dot" else {"BLOCK_K": 32, "BLOCK_N": 4}
    out = sk.skinny_gemm(x, weight, None, config=config, variant=variant)
    assert_matches(out, x, weight, None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small-split"])
def test_huge_values(device, dtype, config):
    """Values near the top of the dtype's range. fp32 / bf16: products ~2^120 and sums ~2^124 (of a
    maximum 2^128), bias ~2^123. fp16: partial sums far past 65504 (x ~ 200, w ~ +-200 with the second
    half of K cancelling the first) whose total fits -- a 16-bit accumulator overflows to inf, the
    fp32 one does not."""
    gen = torch.Generator().manual_seed(11)
    M, K, N = 3, 200, 40
    if dtype == torch.float16:
        half = K // 2
        xh = 150 + 100 * torch.rand((M, half), generator=gen, dtype=torch.float64)
        wh = 150 + 100 * torch.rand((N, half), generator=gen, dtype=torch.float64)
        delta = torch.randn((N, half), generator=gen, dtype=torch.float64)
        x = torch.cat([xh, xh], 1).to(dtype).to(device)
        weight = torch.cat([wh, -wh + delta], 1).to(dtype).to(device)
        bias = _rand((N,), dtype, device, gen, 1000.0)
        partial = (x[:, :half].double() @ weight[:, :half].double().t()).abs().max()
        assert partial > 30 * 65504                       # far past fp16's range before cancelling
    else:
        x = _rand((M, K), dtype, device, gen, 2.0 ** 60)
        weight = _rand((N, K), dtype, device, gen, 2.0 ** 60)
        bias = _rand((N,), dtype, device, gen, 2.0 ** 123)
    out = sk.skinny_gemm(x, weight, bias, config=config)
    assert_matches(out, x, weight, bias, count_differing=dtype != torch.float16)


def test_split_k_is_deterministic_and_zero_k(device):
    gen = torch.Generator().manual_seed(5)
    x = _rand((2, 300), torch.bfloat16, device, gen)
    weight = _rand((24, 300), torch.bfloat16, device, gen)
    first = sk.skinny_gemm(x, weight, None, config=SMALL)
    assert torch.equal(first, sk.skinny_gemm(x, weight, None, config=SMALL))
    empty_x, empty_w = x[:, :0], weight[:, :0]
    bias = _rand((24,), torch.bfloat16, device, gen)
    assert torch.equal(sk.skinny_gemm(empty_x, empty_w, bias), bias.expand(2, 24))


@pytest.mark.parametrize("M", [1, 16, 33, 64])
def test_default_config_fills_the_gpu(M):
    cpu = torch.device("cpu")                             # plans for DEFAULT_SMS (an H200's 132)
    for N, K in [(6144, 4096), (4096, 4096), (32000, 4096), (14336, 4096), (8, 4096)]:
        for variant in ("dot", "fma") if M == 1 else ("dot",):
            cfg = sk.default_config(M, N, K, cpu, variant)
            programs = -(-N // cfg["BLOCK_N"]) * cfg["SPLIT_K"]
            assert programs >= sk.DEFAULT_SMS or cfg["SPLIT_K"] * 2 * cfg["BLOCK_K"] >= K, (N, K, variant, cfg)
            assert cfg["SPLIT_K"] == 1 or -(-N // cfg["BLOCK_N"]) < sk.DEFAULT_SMS
            if variant == "dot" and M > sk.ONE_BINARY_ROWS:   # x read from L2 by every column tile: <= half W's bytes
                assert cfg["BLOCK_N"] >= 2 * M and sk.block_rows(M) >= M


def test_block_rows():
    assert [sk.block_rows(m) for m in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    assert not sk.supports(torch.zeros(65, 8), torch.zeros(4, 8))


# -- dispatch ---------------------------------------------------------------------------------------

@pytest.fixture
def kernel_calls(monkeypatch):
    """Records the skinny_gemm calls that dispatch makes (and still runs them)."""
    calls = []
    original = sk.skinny_gemm

    def recording(x, weight, bias=None, **kwargs):
        calls.append(tuple(x.shape))
        return original(x, weight, bias, **kwargs)
    monkeypatch.setattr(sk, "skinny_gemm", recording)
    return calls


@pytest.fixture
def skinny_on():
    with dispatch.override(backend="triton", skinny_gemm_rows=16):   # CPU tensors take the interpreted kernel
        yield


def _linear(K, N, bias, dtype, device, seed=0):
    from moekv.layers.linear import Linear

    gen = torch.Generator().manual_seed(seed)
    layer = Linear(K, N, bias, dtype, device)
    layer.weight.copy_(_rand((N, K), dtype, device, gen))
    if bias:
        layer.bias.copy_(_rand((N,), dtype, device, gen))
    return layer


def _env_flag(value: str | None) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if k != "MOEKV_SKINNY_GEMM"}
    if value is not None:
        env["MOEKV_SKINNY_GEMM"] = value
    code = "from moekv.ops import dispatch; print(dispatch.skinny_gemm_enabled(), dispatch.skinny_gemm_max_rows())"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return result.stdout.strip() if result.returncode == 0 else "error: " + result.stderr.strip().splitlines()[-1]


def test_env_flag_is_opt_in(monkeypatch):
    """Default off (no end-to-end gain measured); auto: one-row inputs only; 1: every M <= 16; 64: every M <= 64.
    A fresh process each for the default and one value (the switch is read at import); the rest via
    envs.kernel_overrides, what that import reads."""
    from moekv import envs
    from moekv.errors import ConfigError

    assert _env_flag(None) == "False 64"
    assert _env_flag("auto") == "True 1"
    for value, rows in (("0", 0), ("1", 16), ("64", 64), ("auto", 1)):
        monkeypatch.setenv("MOEKV_SKINNY_GEMM", value)
        assert envs.kernel_overrides()["skinny_gemm_rows"] == rows
    monkeypatch.setenv("MOEKV_SKINNY_GEMM", "yes")
    with pytest.raises(ConfigError, match="MOEKV_SKINNY_GEMM"):
        envs.kernel_overrides()


def test_one_row_limit(device, kernel_calls, skinny_on):
    from moekv.config import KernelConfig

    layer = _linear(64, 40, True, torch.float16, device)
    gen = torch.Generator().manual_seed(5)
    x1, x2 = _rand((1, 64), torch.float16, device, gen), _rand((2, 64), torch.float16, device, gen)
    with dispatch.override(skinny_gemm_rows=1):
        assert_matches(layer(x1), x1, layer.weight, layer.bias)
        assert torch.equal(layer(x2), F.linear(x2, layer.weight, layer.bias))
    assert kernel_calls == [(1, 64)]
    with pytest.raises(ValueError, match="skinny_gemm_rows"):
        KernelConfig(skinny_gemm_rows=65)


def test_off_is_f_linear(device, kernel_calls):
    """Off (the default in this process unless MOEKV_SKINNY_GEMM is set): skinny_linear and Linear are
    F.linear, bit for bit, even with the Triton backend forced."""
    with dispatch.override(skinny_gemm_rows=0, backend="triton"):
        layer = _linear(64, 48, True, torch.bfloat16, device)
        x = _rand((3, 64), torch.bfloat16, device, torch.Generator().manual_seed(1))
        assert torch.equal(dispatch.skinny_linear(x, layer.weight, layer.bias), F.linear(x, layer.weight, layer.bias))
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert kernel_calls == []


def test_on_runs_the_kernel_up_to_16_rows(device, kernel_calls, skinny_on):
    layer = _linear(64, 40, True, torch.float16, device)
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 16):
        x = _rand((rows, 64), torch.float16, device, gen)
        assert_matches(layer(x), x, layer.weight, layer.bias)
    x3 = _rand((2, 3, 64), torch.float16, device, gen)    # leading dims flattened: M = 6
    out = layer(x3)
    assert out.shape == (2, 3, 40)
    assert_matches(out.reshape(6, 40), x3.reshape(6, 64), layer.weight, layer.bias)
    assert kernel_calls == [(1, 64), (16, 64), (6, 64)]
    big = _rand((17, 64), torch.float16, device, gen)     # above 16 rows: F.linear
    assert torch.equal(layer(big), F.linear(big, layer.weight, layer.bias))
    fp32 = _linear(64, 40, False, torch.float32, device)  # fp32: not taken (unmeasured), F.linear
    x32 = _rand((2, 64), torch.float32, device, gen)
    assert torch.equal(fp32(x32), F.linear(x32, fp32.weight))
    assert len(kernel_calls) == 3


def test_on_up_to_64_rows(device, kernel_calls):
    """skinny_gemm_rows = 64 (MOEKV_SKINNY_GEMM=64): decode batches up to 64 rows take the kernel (BLOCK_M 32 / 64),
    65 rows F.linear."""
    layer = _linear(96, 48, True, torch.bfloat16, device)
    gen = torch.Generator().manual_seed(4)
    with dispatch.override(backend="triton", skinny_gemm_rows=64):
        for rows in (20, 64):
            x = _rand((rows, 96), torch.bfloat16, device, gen)
            assert_matches(layer(x), x, layer.weight, layer.bias)
        big = _rand((65, 96), torch.bfloat16, device, gen)
        assert torch.equal(layer(big), F.linear(big, layer.weight, layer.bias))
    assert kernel_calls == [(20, 96), (64, 96)]


def test_on_but_reference_or_cpu_auto_is_f_linear(kernel_calls, skinny_on):
    layer = _linear(32, 24, False, torch.bfloat16, "cpu")
    x = _rand((2, 32), torch.bfloat16, "cpu", torch.Generator().manual_seed(4))
    for backend in ("reference", "auto"):                 # auto on CPU tensors: no kernel
        with dispatch.override(backend=backend):
            assert torch.equal(layer(x), F.linear(x, layer.weight))
    assert kernel_calls == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_capture(skinny_on):
    with dispatch.override(backend="auto"):
        layer = _linear(4096, 1024, True, torch.bfloat16, "cuda")
        x = torch.randn(4, 4096, dtype=torch.bfloat16, device="cuda")
        eager = layer(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, layer(x)) and not torch.equal(static_out, eager)


def test_default_variant_by_rows(device, monkeypatch):
    """Without a variant the kernel takes the one measured faster: "fma" at M == 1, "dot" from M = 2 (what
    dispatch.skinny_linear gets, since it passes none)."""
    chosen = []
    original = sk.default_config

    def spy(M, N, K, dev, variant="dot"):
        chosen.append((M, variant))
        return original(M, N, K, dev, variant)
    monkeypatch.setattr(sk, "default_config", spy)
    gen = torch.Generator().manual_seed(6)
    weight = _rand((24, 64), torch.float16, device, gen)
    for rows in (1, 2):
        x = _rand((rows, 64), torch.float16, device, gen)
        assert_matches(sk.skinny_gemm(x, weight), x, weight, None)
    assert chosen == [(1, "fma"), (2, "dot")]
