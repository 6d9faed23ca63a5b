"""The bundled trained model: greedy output with expert offloading (and prefetch) is token-identical
to all experts resident, and one-layer-ahead prediction is good on real text."""

from __future__ import annotations

import pytest

from moekv.paths import default_model_dir
from moekv.sampling import SamplingParams


@pytest.fixture(scope="module")
def bundled():
    from pathlib import Path

    folder = Path(default_model_dir())
    if not (folder / "model.safetensors").is_file():
        pytest.skip("the bundled model is not in this checkout")
    return str(folder)


def test_offloaded_greedy_matches_resident(bundled):
    from moekv.entrypoints.llm import LLM

    prompts = ["ROMEO:\nBut soft, what light", "First Citizen:\n"]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    common = dict(dtype="fp32", device="cpu", max_model_len=256, num_pages=64)
    expected = [o.outputs[0].token_ids for o in LLM(bundled, **common).generate(prompts, params)]
    llm = LLM(bundled, cpu_offload_experts=True, expert_cache_size="50%", lookahead=2, **common)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.engine.routing_stats()
    assert stats["offload"]["prefetch_hits"] > 0
    # top-2 guesses on 2 x 24 tokens; the whole validation split gives about 86% (docs/expert-offload.md)
    assert stats["prediction"]["overall"][1] > 0.7
    assert stats["prediction"]["overall"][1] > stats["prediction"]["overall"][2] - 0.05
