"""moekv: an inference engine for Mixture-of-Experts language models with an outlier-aware
low-bit paged KV cache.

    from moekv import LLM, SamplingParams
    llm = LLM(model="models/tiny-shakespeare-moe", kv_cache_dtype="int3")
    out = llm.generate(["ROMEO:"], SamplingParams(max_tokens=32, temperature=0.8))
    print(out[0].outputs[0].text)

Imports are lazy: `import moekv` does not import torch.
"""

from __future__ import annotations

from moekv.version import __version__
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from moekv.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from moekv.sampling import SamplingParams

        return SamplingParams
    if name == "kv":
        import importlib

        return importlib.import_module("moekv.kv")
    raise AttributeError(f"module 'moekv' has no attribute {name!r}")
