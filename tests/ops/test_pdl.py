"""Programmatic dependent launch of the decode step's Triton kernels (KernelConfig.pdl, ops/triton/pdl.py).

What keeps PDL exact is structural: a kernel launched with `launch_pdl` must wait for its predecessor
(`pdl.enter(USE_PDL)`) before touching memory, so the CPU tests check that every launch that passes
`pdl.launch_kwargs` targets a kernel whose first statement is that wait, that nothing else asks for `launch_pdl`,
and the switch's plumbing (config, environment, dispatch). On a Hopper GPU the bf16 model then gives the same
logits and greedy tokens with PDL on as off, eager and through captured CUDA graphs.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from moekv.ops import dispatch
from tests.helpers import check_kernel_switch

triton = pytest.importorskip("triton", reason="needs Triton")
from moekv.ops.triton import pdl  # noqa: E402

TRITON_DIR = pathlib.Path(pdl.__file__).parent


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        body = body[1:]                                       # a docstring
    return body[0]


def _pdl_launches(tree: ast.Module) -> list[str]:
    """Names of the kernels launched as name[grid](..., **pdl.launch_kwargs(...))."""
    names = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
            continue
        for kw in node.keywords:
            v = kw.value
            if (kw.arg is None and isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute)
                    and v.func.attr == "launch_kwargs" and isinstance(v.func.value, ast.Name) and v.func.value.id == "pdl"):
                assert isinstance(node.func.value, ast.Name), ast.dump(node.func)
                names.append(node.func.value.id)
    return names


def test_every_pdl_launch_waits_first():
    launched = 0
    for path in sorted(TRITON_DIR.rglob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        assert "launch_pdl=" not in source or path.name == "pdl.py", f"{path}: launch_pdl outside pdl.launch_kwargs"
        kernels = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                kernels[node.name] = node
        for name in _pdl_launches(tree):
            fn = kernels.get(name)
            if fn is None:                                    # imported from a sibling module
                continue
            params = [a.arg for a in fn.args.args]
            assert "USE_PDL" in params, f"{path.name}: {name} launched with PDL but takes no USE_PDL"
            first = _first_statement(fn)
            assert ast.unparse(first) == "pdl.enter(USE_PDL)", f"{path.name}: {name} starts with {ast.unparse(first)}"
            launched += 1
    # the decode step's kernels: norms, rotary + KV write, attention + combine, routing, MoE decode (dot and fma)
    # and its combine, the skinny / FP8 linears and their split-K reduce
    assert launched >= 17


def test_wait_precedes_every_global_access_in_ptx():
    """The decode attention kernel compiled for sm_90 as PDL launches it (Triton's compiler, no GPU; in a child
    without TRITON_INTERPRET, as test_attention_combine does): griddepcontrol.wait comes before any global load,
    store, atomic or async copy, the dependents are released after it, and without PDL neither appears."""
    from tests.ops.ptx_compile import ptx_in_child

    with_pdl, plain = ptx_in_child("[compile_decode(True, use_pdl=p).asm['ptx'] for p in (True, False)]")
    lines = [line.strip() for line in with_pdl.splitlines()]
    wait = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait"))
    launch = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.launch_dependents"))
    first_global = next(i for i, line in enumerate(lines)
                        if line.startswith(("ld.global", "st.global", "atom.global", "red.global", "cp.async")))
    assert wait < launch < first_global
    assert "griddepcontrol" not in plain


def test_config_and_environment(monkeypatch):
    check_kernel_switch(monkeypatch, "pdl", "MOEKV_PDL", False)


def test_dispatch_switches_the_launches():
    x = torch.zeros(2, 8)
    before = pdl.enabled()
    with dispatch.override(pdl=True):
        assert pdl.enabled()
        assert pdl.launch_kwargs(x) == {"USE_PDL": False}            # a CPU tensor never launches with PDL
    assert pdl.enabled() == before
    with dispatch.override(pdl=False):
        assert not pdl.enabled()


needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                  reason="needs a CUDA device of compute capability >= 9.0 (PDL)")


@needs_hopper
@pytest.mark.gpu
def test_launch_kwargs_on_hopper():
    x = torch.zeros(2, 8, device="cuda")
    with dispatch.override(pdl=True):
        assert pdl.launch_kwargs(x) == {"USE_PDL": True, "launch_pdl": True}
    with dispatch.override(pdl=False):
        assert pdl.launch_kwargs(x) == {"USE_PDL": False}


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_model_same_with_and_without_pdl(tmp_path, family):
    from moekv.models import load_model
    from tests.hf_fixtures import make_checkpoint, moekv_greedy

    path, _ = make_checkpoint(tmp_path, family)
    model = load_model(path, dtype=torch.bfloat16, device="cuda")
    prompts = [[5, 6, 7, 8, 9], [11], [3, 4, 10, 20, 30, 40, 50, 60, 70]]
    with dispatch.override(pdl=False):
        tokens_off, logits_off = moekv_greedy(model, prompts, 6)
    with dispatch.override(pdl=True):
        tokens_on, logits_on = moekv_greedy(model, prompts, 6)
    assert tokens_on == tokens_off
    for a, b in zip(logits_on, logits_off):
        assert torch.equal(a, b)


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "int3"])
def test_graph_decode_same_with_and_without_pdl(kv_cache_dtype):
    from tests.engine.test_graph_decode import _generate

    with dispatch.override(pdl=False):
        expected, _ = _generate(True, kv_cache_dtype, "bf16", page_size=16 if kv_cache_dtype == "bf16" else 128,
                                device="cuda", capture=True)
    with dispatch.override(pdl=True):
        got, llm = _generate(True, kv_cache_dtype, "bf16", page_size=16 if kv_cache_dtype == "bf16" else 128,
                             device="cuda", capture=True)
    assert got == expected
    assert llm.engine.runner.graph_steps > 0


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("warps", [4, 8])
def test_v7_kernel_same_with_and_without_pdl(warps):
    """The v7 low-bit CUDA kernel launched with cudaLaunchKernelEx + the programmatic attribute (Params::pdl) after a
    Triton kernel that releases it early: the same bits as an ordinary launch, eager and inside a captured graph."""
    from moekv.ops.cuda import lowbit_decode
    from moekv.ops.triton.layer.norm import rms_norm
    from tests.ops.test_lowbit_decode_v7 import SCALE, _case

    case = _case([1, 127, 129, 1000, 3000], group=4, bits=3)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(512, device="cuda", dtype=torch.bfloat16)

    def step():
        rms_norm(x, weight, 1e-6)                        # a PDL Triton kernel right before the attention kernel
        return lowbit_decode.paged_attention_lowbit_decode(*case.args(), SCALE, warps=warps)

    with dispatch.override(pdl=False):
        expected = step().clone()
    with dispatch.override(pdl=True):
        assert torch.equal(step(), expected)
        step()                                           # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
