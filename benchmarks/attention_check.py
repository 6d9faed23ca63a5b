"""`bench_attention.py --check`: the kernels against the references at real shapes (full-precision decode and
prefill, every low-bit implementation and width, the page quantizer), and a dump of the compiled kernels'
registers, spills and shared memory (plus two TTGIR files) after the checks."""

from __future__ import annotations

import os

import torch

from benchmarks import attention_setup as setup
from benchmarks.attention_setup import D, HQ, FP_PAGE, LOWBIT_PAGE, SCALE, lowbit_impls, lowbit_specs, random_kv
from moekv.core.lowbit_layout import PackedPages
from moekv.ops.reference import lowbit as lowbit_reference
from moekv.ops.reference.attention import paged_attention_full_precision as fp_reference
from moekv.ops.triton.lowbit import attention as lowbit_attention
from moekv.ops.triton.lowbit import quantize as lowbit_quantize


def run_check(log, sweep_configs: bool = True) -> bool:
    from moekv.testing.attention_cases import build_case, build_fp_case
    from moekv.ops.triton.attention.full_precision import paged_attention_full_precision as fp_kernel

    ok = True

    def report(name, out, ref, tol):
        nonlocal ok
        err = (out.float() - ref.float()).abs()
        rel_max = (err.max() / ref.float().abs().max()).item()
        rel_mean = (err.mean() / ref.float().abs().mean()).item()
        passed = bool(torch.isfinite(out.float()).all()) and rel_max <= tol[0] and rel_mean <= tol[1]
        ok &= passed
        log(f"{'PASS' if passed else 'FAIL'} {name}: max err/max {rel_max:.2e} (tol {tol[0]:.0e}), "
            f"mean err/mean {rel_mean:.2e} (tol {tol[1]:.0e})")

    tol = {torch.bfloat16: (2e-2, 1e-2), torch.float16: (2e-3, 1e-3), torch.float32: (1e-5, 1e-5)}
    small = setup.DEVICE == "cpu"                             # --dry
    fp_lens = [0, 99, 300, 100] if small else [0, 99, 4096, 16383]
    lowbit_lens = [0, 130, 300] if small else [0, 200, 5000, 16383]
    impls = lowbit_impls()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        case = build_fp_case(fp_lens, [1] * len(fp_lens), setup.HKV, HQ // setup.HKV, D, FP_PAGE, dtype, setup.DEVICE)
        report(f"fp decode {dtype} context {fp_lens}", fp_kernel(*case, SCALE), fp_reference(*case, SCALE), tol[dtype])
        case = build_fp_case([0, 300, 1000], [70 if small else 700, 129, 1], setup.HKV, HQ // setup.HKV, D, FP_PAGE, dtype,
                             setup.DEVICE, seed=1)
        report(f"fp prefill {dtype} chunks {70 if small else 700}/129/1", fp_kernel(*case, SCALE), fp_reference(*case, SCALE), tol[dtype])
    for bits in setup.BITS:
        for dtype, kind in ((torch.bfloat16, "normal"), (torch.bfloat16, "outlier_channels"), (torch.float16, "large"),
                            (torch.float32, "outlier_channels")):
            case = build_case(lowbit_lens, [1] * len(lowbit_lens), setup.HKV, HQ // setup.HKV, D, bits, LOWBIT_PAGE, dtype=dtype,
                              kind=kind, outlier_fraction=0.01, device=setup.DEVICE)
            ref = lowbit_reference.paged_attention_lowbit(*case.args(), SCALE)
            for name, (fn, configs) in impls.items():
                for cfg in (configs if sweep_configs and (dtype, kind) == (torch.bfloat16, "normal") else configs[:1]):
                    try:
                        out = fn(*case.args(), SCALE, **cfg)
                    except Exception as exc:                  # a failing variant is a failed check, not a crash
                        ok = False
                        log(f"FAIL {name} int{bits} decode {dtype} {kind} {cfg}: {type(exc).__name__}: {exc}")
                        continue
                    report(f"{name} int{bits} decode {dtype} {kind} context {lowbit_lens} {cfg}", out, ref, tol[dtype])
            if (dtype, kind) == (torch.bfloat16, "outlier_channels"):   # graph mode: splits sized on the device
                case.meta.fixed_num_splits = 5
                for name, (fn, configs) in impls.items():
                    try:
                        report(f"{name} int{bits} decode fixed_num_splits=5", fn(*case.args(), SCALE, **configs[0]),
                               ref, tol[dtype])
                    except Exception as exc:
                        ok = False
                        log(f"FAIL {name} int{bits} fixed_num_splits: {type(exc).__name__}: {exc}")
                case.meta.fixed_num_splits = None
        case = build_case([0, 300, 1000], [40 if small else 300, 129, 1], setup.HKV, HQ // setup.HKV, D, bits, LOWBIT_PAGE, dtype=torch.bfloat16,
                          outlier_fraction=0.01, device=setup.DEVICE, seed=1)
        report(f"int{bits} prefill bf16", lowbit_attention.paged_attention_lowbit(*case.args(), SCALE),
               lowbit_reference.paged_attention_lowbit(*case.args(), SCALE), tol[torch.bfloat16])
        for spec in lowbit_specs(bits):
            x = random_kv((16 if setup.DEVICE == "cpu" else 64, setup.HKV, LOWBIT_PAGE, D), spec.axis == "channel").float()
            got, got_q = lowbit_quantize.quantize_pages(x, spec)
            # the oracle is the reference on the CPU: torch's CUDA division by a scalar multiplies by the
            # reciprocal (not IEEE), which moves fp16 round-up scales by one step now and then
            on_gpu, _ = lowbit_reference.quantize_pages(x, spec)
            want, want_q = lowbit_reference.quantize_pages(x.cpu(), spec)
            want = PackedPages(**{n: t.to(setup.DEVICE) for n, t in want.tensors().items()},
                               **({"scale_base": None} if want.scale_base is None else {}))
            want_q = want_q.to(setup.DEVICE)
            log(f"     reference on {setup.DEVICE} vs on cpu: " + ", ".join(
                f"{n} {'same' if torch.equal(t, want.tensors()[n]) else 'differs'}" for n, t in on_gpu.tensors().items()))
            same = {name: bool(torch.equal(t, got.tensors()[name])) for name, t in want.tensors().items()}
            step = (want.scale.float().max().item() if spec.axis == "channel" else
                    lowbit_reference.token_scale_zero(want.scale, want.zero, want.scale_base, spec)[1].abs().max().item())
            diff = (lowbit_reference.dequantize_pages(got, spec) - lowbit_reference.dequantize_pages(want, spec)).abs()
            exact = all(same.values()) and bool(torch.equal(got_q, want_q))
            passed = exact or (spec.axis == "token" and diff.max().item() <= 1.01 * step + 1e-3)
            ok &= passed
            log(f"{'PASS' if passed else 'FAIL'} quantize int{bits} {spec.axis}: bit-exact {exact} {same}, "
                f"max dequantized diff {diff.max().item():.3e}, codes equal {(got.codes == want.codes).float().mean().item():.5f}")
    return ok


def dump_kernels(out_dir: str, log) -> None:
    """Registers, spills and shared memory of every kernel variant this process compiled, plus the
    TTGIR of the first low-bit attention and full-precision decode kernels (to read their layouts)."""
    from moekv.ops.triton.attention import decode as attention_decode
    from moekv.ops.triton.attention import prefill as attention_prefill
    written = set()
    for name, fn in [("lowbit_attention", lowbit_attention._lowbit_attention_kernel),
                     ("fp_decode", attention_decode._fp_decode_kernel),
                     ("fp_prefill", attention_prefill._fp_prefill_kernel),
                     ("quantize", lowbit_quantize._quantize_kernel)]:
        try:      # triton keeps, per device, a tuple whose first dict maps specialisation keys to kernels
            compiled = [item for caches in getattr(fn, "device_caches", {}).values()
                        for item in next(c for c in caches if isinstance(c, dict)).items()]
        except Exception as exc:
            log(f"{name}: no kernel cache to read ({exc})")
            continue
        for key, kernel in compiled:
            try:
                md = kernel.metadata
                log(f"{name}: regs {kernel.n_regs} spills {kernel.n_spills} shared {md.shared} warps "
                    f"{md.num_warps} stages {md.num_stages} key {str(key)[-260:]}")
                if name in ("lowbit_attention", "fp_decode") and name not in written:
                    with open(os.path.join(out_dir, f"{name}.ttgir"), "w") as f:
                        f.write(f"// key {key}\n" + kernel.asm["ttgir"])
                    written.add(name)
            except Exception as exc:
                log(f"{name}: could not read ({exc})")
