"""LowBitCache on the bundled trained checkpoint (models/tiny-shakespeare-moe), and the README snippet of
docs/transformers-cache.md executed exactly as written."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

from moekv import datasets  # noqa: E402
from moekv.integrations.transformers import LowBitCache  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "tiny-shakespeare-moe"
DOC = REPO / "docs" / "transformers-cache.md"

pytestmark = pytest.mark.skipif(not (MODEL / "model.safetensors").is_file(),
                                reason=f"bundled checkpoint not found at {MODEL}")


@pytest.fixture(scope="module")
def bundled():
    model = AutoModelForCausalLM.from_pretrained(str(MODEL)).eval()        # the checkpoint's dtype (bf16)
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    return model, tokenizer


def _greedy(model, input_ids, cache, new_tokens):
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), past_key_values=cache,
                         do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    return out[0, input_ids.shape[1]:]


def test_greedy_at_4_bits_matches_dynamic_cache(bundled):
    """A 300-token prompt (two quantized pages after the prefill): the first 32 greedy tokens are identical."""
    model, tokenizer = bundled
    prompt = tokenizer(datasets.validation_slice(), return_tensors="pt").input_ids[:, :300]
    reference = _greedy(model, prompt, DynamicCache(config=model.config), 32)
    cache = LowBitCache(model.config, bits=4)
    ours = _greedy(model, prompt, cache, 32)
    assert torch.equal(ours, reference), (ours.tolist(), reference.tolist())
    assert cache.layers[0].store.quantized == 256
    settings = cache.settings
    expected = settings.expected_lowbit_bits_per_value(head_dim=64)
    assert cache.lowbit_bits_per_value == pytest.approx(expected, abs=0.01)
    assert 4.3 < cache.lowbit_bits_per_value < 4.7


def _readme_snippet() -> str:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## README snippet", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert match, "no python block under '## README snippet'"
    return match.group(1)


def test_readme_snippet_runs_as_written(monkeypatch):
    snippet = _readme_snippet()
    assert len(snippet.strip().splitlines()) <= 5
    monkeypatch.chdir(REPO)
    torch.manual_seed(0)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(snippet, str(DOC), "exec"), {"__name__": "__readme__"})
    output = printed.getvalue()
    assert output.startswith("ROMEO:") and len(output) > 40, output
