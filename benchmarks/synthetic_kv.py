"""Decode benchmarks at long context without a prefill: sequences whose first `context` tokens count
as cached, over KV pages filled with plausible synthetic contents (shared by bench_decode and
bench_expert_parallel). A 64 x 16k prefill would take minutes of GPU time and measure nothing the
decode step needs.

Contexts should be multiples of the page size: a partly filled page would need staging rows that
a synthetic fill does not write.
"""

from __future__ import annotations

import torch

from moekv.core.request import RequestStatus
from moekv.sampling import SamplingParams


def fill_kv_synthetic(kv_cache, generator_seed: int = 0, batch_pages: int = 64) -> None:
    """Every page gets plausible contents: random keys/values (full precision), or a few random pages
    quantized once and copied over all pages (low-bit), so attention reads real codes and scales."""
    torch.manual_seed(generator_seed)
    if hasattr(kv_cache, "key_spec"):                                     # low-bit pages
        from moekv.ops import dispatch

        spec = kv_cache.spec
        for layer in range(spec.num_layers):
            for pages, quant in ((kv_cache.key_pages[layer], kv_cache.key_spec),
                                 (kv_cache.value_pages[layer], kv_cache.value_spec)):
                count = min(batch_pages, pages.num_pages)
                x = torch.randn(count, spec.num_kv_heads, spec.page_size, spec.head_dim, device=kv_cache.device,
                                dtype=spec.dtype)
                packed, _ = dispatch.quantize_pages(x, quant)
                for start in range(0, pages.num_pages, count):
                    ids = torch.arange(start, min(start + count, pages.num_pages), device=kv_cache.device)
                    pages.store(ids, packed.select(torch.arange(len(ids), device=kv_cache.device)))
    else:
        kv_cache.key_pages.normal_()
        kv_cache.value_pages.normal_()


def admit_with_context(engine, num_seqs: int, context: int, max_tokens: int, vocab: int, seed: int) -> list[str]:
    """Queue `num_seqs` requests whose first `context` tokens count as already cached: pages are
    allocated and the requests enter the running set directly; the next step decodes."""
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = []
    for _ in range(num_seqs):
        prompt = torch.randint(3, vocab, (context + 1,), generator=generator).tolist()
        request_id = engine.add_request(prompt, params)
        scheduler = engine.scheduler
        request = scheduler.waiting.pop()
        request.status = RequestStatus.RUNNING
        scheduler.running.append(request)
        engine.kv_manager.grow(request_id, context)
        request.num_computed_tokens = context
        # its full pages are registered now, as a real prefill's are (else the first step that fills a page
        # would digest the whole context inside the timed steps: 1024 pages per sequence at 16k, page 16)
        engine.kv_manager.cache_computed(request_id, context, request.token_ids)
        ids.append(request_id)
    return ids
