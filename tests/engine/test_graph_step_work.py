"""The eager work of a graph decode step outside its (captured) forward, counted on the CPU in static graph
mode: device ops (views and other metadata-only ops left out), host-to-device copies, tensors built from host
data, host reads and waits on CUDA events, per phase. At B=1 on a GPU every launch, copy and host wait outside
the graph is time the GPU idles, so these are count bounds, not timings. The CUDA events a step waits on do
not exist on the CPU: counting stand-ins take their place (the bucket's upload event as on CUDA, and the low-bit
cache's own copy event, which a graph step must not touch). An ordinary low-bit step costs exactly what a
full-precision one costs: its step rows ride in the bucket's one copy (KVCache.bind_graph_step) and its
non-finite flags come back in the runner's one status read.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moekv import LLM, SamplingParams
from moekv.engine.graph_buckets import GraphBucket
from moekv.engine.step_result import usable_rows
from moekv.paths import default_model_dir
from tests.helpers import poison_graph_key

PAGE = 16
# aten ops that launch nothing (views, aliasing, conj/neg resolution, a no-op `to`)
_NO_KERNEL = {"detach", "detach_", "resolve_conj", "resolve_neg", "lift_fresh", "to", "alias", "slice", "select",
              "view", "unsqueeze", "expand", "t", "transpose", "as_strided", "_reshape_alias", "squeeze", "unbind",
              "split", "narrow", "reshape", "_unsafe_view", "flatten", "unflatten", "permute"}
_COPIES = {"copy_", "_to_copy"}       # on CUDA, a host buffer copied to the device (or device to device)
_READS = ("tolist", "item", "cpu")


class _Ops(TorchDispatchMode):
    def __init__(self, phase, ops):
        super().__init__()
        self.phase, self.ops = phase, ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _NO_KERNEL and not func.is_view:
            self.ops[self.phase[-1]][name] += 1
        return func(*args, **(kwargs or {}))


class _Event:
    """A CUDA event stand-in that counts host waits and records, by phase."""

    def __init__(self, phase, waits):
        self.phase, self.waits = phase, waits

    def synchronize(self):
        self.waits[self.phase[-1]] += 1

    def record(self, stream=None):
        self.waits[f"{self.phase[-1]}:record"] += 1


def _llm(kv_cache_dtype: str, max_num_seqs: int = 1) -> LLM:
    llm = LLM(model=default_model_dir(), dtype="fp32", kv_cache_dtype=kv_cache_dtype, device="cpu", page_size=PAGE,
              max_model_len=256, max_num_seqs=max_num_seqs, cuda_graphs=False)
    assert llm.engine.runner.enable_graphs(capture=False)
    return llm


def _count_steps(monkeypatch, llm: LLM, prompts: list[list[int]], num_steps: int):
    """Runs the prompts' prefill and first decode, then `num_steps` decode steps; returns per step a dict:
    kind ("ordinary", or "page": a page starts or fills), ops (device ops by phase), copies (copy ops by phase),
    tensors (torch.tensor from host data, by phase), reads (host reads by phase), waits (event waits by phase),
    tokens (the step's new tokens)."""
    engine = llm.engine
    runner, cache = engine.runner, engine.kv_cache
    phase = ["engine"]
    ops: dict = collections.defaultdict(collections.Counter)
    reads: collections.Counter = collections.Counter()
    tensors: collections.Counter = collections.Counter()
    waits: collections.Counter = collections.Counter()

    def within(obj, name, label):
        original = getattr(obj, name)

        def wrapped(*args, **kwargs):
            phase.append(label)
            try:
                return original(*args, **kwargs)
            finally:
                phase.pop()
        monkeypatch.setattr(obj, name, wrapped)

    within(cache, "begin_step", "cache")
    within(cache, "end_step", "cache")
    within(runner, "execute", "runner")
    within(runner, "_static_forward", "forward")
    for name in _READS:
        original = getattr(torch.Tensor, name)

        def read(self, *args, _original=original, **kwargs):
            if phase[-1] != "forward":
                reads[phase[-1]] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, read)
    original_tensor = torch.tensor

    def tensor(*args, **kwargs):
        if phase[-1] != "forward":
            tensors[phase[-1]] += 1
        return original_tensor(*args, **kwargs)
    monkeypatch.setattr(torch, "tensor", tensor)
    original_upload = GraphBucket.upload

    def upload(bucket):                          # as on CUDA: the copy records an event fill() waits on next
        original_upload(bucket)
        bucket.copied = _Event(phase, waits)
        bucket.copied.record()
    monkeypatch.setattr(GraphBucket, "upload", upload)
    if hasattr(cache, "_index_copied"):          # the low-bit cache's own copy event (CUDA only)
        monkeypatch.setattr(cache, "_index_copied", _Event(phase, waits))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)

    params = SamplingParams(max_tokens=num_steps + 8, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    engine.step()
    engine.step()
    steps = []
    for _ in range(num_steps):
        positions = [r.num_computed_tokens for r in engine.scheduler.running]
        kind = "page" if any(p % PAGE in (0, PAGE - 1) for p in positions) else "ordinary"
        for counter in (ops, reads, tensors, waits):
            counter.clear()
        graph_steps = runner.graph_steps
        with _Ops(phase, ops):
            outputs = engine.step()
        assert runner.graph_steps == graph_steps + 1
        device_ops = {k: dict(v) for k, v in ops.items() if k != "forward"}
        copies = {k: sum(n for op, n in v.items() if op in _COPIES) for k, v in device_ops.items()}
        steps.append({"kind": kind, "ops": device_ops, "copies": {k: n for k, n in copies.items() if n},
                      "tensors": dict(tensors), "reads": dict(reads), "waits": dict(waits),
                      "tokens": [o.new_token_ids for o in outputs]})
    return steps


def _total(counts: dict) -> int:
    return sum(sum(v.values()) if isinstance(v, dict) else v for v in counts.values())


def test_lowbit_step_hooks_cost_nothing_on_an_ordinary_step(monkeypatch):
    steps = _count_steps(monkeypatch, _llm("int3"), [[5, 17, 33]], 2 * PAGE)
    ordinary = [s for s in steps if s["kind"] == "ordinary"]
    page = [s for s in steps if s["kind"] == "page"]
    assert len(ordinary) >= PAGE and len(page) >= 2
    for s in ordinary:
        # begin_step writes the rows into the bucket's host buffer (the runner's upload copies them), end_step
        # takes the flags the runner read back: no device op, copy, host tensor, read or event of the cache's own
        assert "cache" not in s["ops"] and "cache" not in s["tensors"], s
        assert "cache" not in s["reads"] and not any(k.startswith("cache") for k in s["waits"]), s
        # the bucket's upload is the one device op outside the forward: the load tracker's window fold (six
        # launches before the replay until session 19) runs inside it
        assert s["ops"] == {"runner": {"copy_": 1}} and s["copies"] == {"runner": 1}, s
        assert s["reads"] == {"runner": 1}, s        # the step's one host read: the runner's status row
        assert s["waits"] == {"runner": 1, "runner:record": 1}, s    # the previous upload, this upload's event
        assert "engine" not in s["ops"], s           # no logits check, no greedy sampling op of its own
    for s in page:
        # a page starts (slot taken: map update) or fills (slot returned at commit): a map update on top,
        # its index and slot lists built on the host; still no read or event wait of the cache's own
        assert sum(s["ops"].get("cache", {}).values()) <= 1 and s["tensors"].get("cache", 0) <= 2, s
        assert "cache" not in s["reads"] and s["reads"] == {"runner": 1}, s
        assert not any(k.startswith("cache") for k in s["waits"]), s


def test_lowbit_step_costs_no_more_than_full_precision(monkeypatch):
    prompts = [[5, 17, 33], [7], [40, 41, 42, 43]]
    lowbit = _count_steps(monkeypatch, _llm("int3", max_num_seqs=4), prompts, 6)
    monkeypatch.undo()
    full = _count_steps(monkeypatch, _llm("fp32", max_num_seqs=4), prompts, 6)
    ordinary = 0
    for low, fp in zip(lowbit, full):
        if low["kind"] != "ordinary":
            continue
        ordinary += 1
        for what in ("ops", "copies", "tensors", "reads", "waits"):
            assert _total(low[what]) <= _total(fp[what]), (what, low, fp)
        assert _total(low["ops"]) == _total(fp["ops"]) == 1 and _total(low["copies"]) == _total(fp["copies"]) == 1
        assert _total(low["reads"]) == _total(fp["reads"]) == 1
        assert _total(low["waits"]) == _total(fp["waits"]) == 2
    assert ordinary >= 3


def test_page_fill_quantize_runs_inside_the_forward(monkeypatch):
    """The low-bit page quantizer of a graph decode step is one masked launch for all layers inside the forward
    (what a CUDA graph captures), on every step, doing work only where a page filled; none runs outside it and
    none per layer. Outside, a page start or fill costs only the staging map update (test above)."""
    from moekv.ops import dispatch

    llm = _llm("int3")
    engine, runner = llm.engine, llm.engine.runner
    phase, calls = ["outside"], collections.Counter()
    forward, quantize = runner._static_forward, dispatch.quantize_staged_kv_counted_layers

    def inside(*args, **kwargs):
        phase.append("forward")
        try:
            return forward(*args, **kwargs)
        finally:
            phase.pop()

    def counted(*args, **kwargs):
        calls[phase[-1]] += 1
        return quantize(*args, **kwargs)
    monkeypatch.setattr(runner, "_static_forward", inside)
    monkeypatch.setattr(dispatch, "quantize_staged_kv_counted_layers", counted)
    llm.generate([[5, 17, 33]], SamplingParams(max_tokens=2 * PAGE + 2, temperature=0.0, ignore_eos=True))
    assert runner.graph_steps == 2 * PAGE + 1
    assert engine.arch.num_layers > 1 and calls == {"forward": runner.graph_steps}
    assert engine.kv_cache.stats()["pages_quantized"] == 2          # pages 0 and 1 filled while decoding


def test_the_counts_see_the_cache_s_own_copy(monkeypatch):
    """The counting catches a low-bit step that copies its own rows: the same engine with the bucket's step
    bytes refused (graph_step_bytes 0) pays a copy, an event wait and a record per step in the cache."""
    llm = _llm("int3")
    monkeypatch.setattr(llm.engine.kv_cache, "graph_step_bytes", lambda batch: 0)
    steps = _count_steps(monkeypatch, llm, [[5, 17, 33]], 4)
    for s in (s for s in steps if s["kind"] == "ordinary"):
        assert s["copies"].get("cache") == 1 and s["waits"].get("cache") == 1 and s["waits"].get("cache:record") == 1


def test_bucket_rows_and_own_rows_give_the_same_tokens(monkeypatch):
    """Where the low-bit step rows live (the bucket's buffer or the cache's own) changes no output."""
    prompts = [[5, 17, 33], [7], list(range(1, 15))]
    params = SamplingParams(max_tokens=2 * PAGE + 3, temperature=0.0, ignore_eos=True)
    bound = _llm("int3", max_num_seqs=4)
    own = _llm("int3", max_num_seqs=4)
    monkeypatch.setattr(own.engine.kv_cache, "graph_step_bytes", lambda batch: 0)
    got = [o.outputs[0].token_ids for o in bound.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in own.generate(prompts, params)]
    assert got == want and all(len(t) == 2 * PAGE + 3 for t in got)
    assert bound.engine.runner.graph_steps > 2 * PAGE and own.engine.runner.graph_steps > 2 * PAGE
    assert all(b.step_buffers is not None for b in bound.engine.runner._buckets.values())
    assert all(b.step_buffers is None for b in own.engine.runner._buckets.values())
    assert bound.engine.kv_cache.stats() == own.engine.kv_cache.stats()


def test_non_greedy_and_logprob_requests_still_sample_in_graph_steps():
    llm = _llm("int3", max_num_seqs=2)
    outs = llm.generate([[5, 17, 33], [7, 8]],
                        [SamplingParams(max_tokens=5, temperature=0.8, seed=3, ignore_eos=True),
                         SamplingParams(max_tokens=5, temperature=0.0, logprobs=2, ignore_eos=True)])
    assert llm.engine.runner.graph_steps > 0
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
    logprobs = outs[1].outputs[0].logprobs
    assert logprobs is not None and len(logprobs) == 5 and all(len(d) >= 2 for d in logprobs)


def test_usable_rows_is_the_engine_rule():
    inf, nan = float("inf"), float("nan")
    rows = [[1.0, 2.0, 3.0], [-inf, 2.0, -inf], [-inf, -inf, -inf], [nan, 1.0, 2.0], [1.0, inf, 2.0],
            [nan, -inf, -inf], [-inf, inf, nan], [inf, inf, inf], [0.0, -inf, 5.0]]
    logits = torch.tensor(rows)
    broken = torch.isnan(logits).any(dim=-1) | torch.isposinf(logits).any(dim=-1) | ~torch.isfinite(logits).any(dim=-1)
    assert usable_rows(logits).tolist() == (~broken).tolist()


def test_enable_graphs_twice_holds_one_scratch_page():
    llm = LLM(model=default_model_dir(), dtype="fp32", kv_cache_dtype="int3", device="cpu", page_size=PAGE,
              max_model_len=128, max_num_seqs=2, cuda_graphs=False)
    runner, manager = llm.engine.runner, llm.engine.kv_manager
    free = manager.num_free_pages
    assert runner.enable_graphs(capture=False)
    scratch = runner.scratch_page
    assert runner.enable_graphs(capture=False)
    assert runner.scratch_page == scratch and runner.reserved_pages == 1
    assert manager.num_free_pages == free - 1
    outs = llm.generate([[5, 17, 33], [7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert manager.num_free_pages == free - 1            # only the scratch page is held after the requests


def test_non_finite_kv_in_a_graph_step_ends_only_that_request():
    """The cache's flags come back through the runner's status row (end_step reads nothing itself): a NaN
    key of one sequence in a graph decode step ends that request; the other is recomputed and matches a
    clean run token for token."""
    prompts = [[5, 17, 33], [7, 8]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    clean = [o.outputs[0].token_ids for o in _llm("int3", max_num_seqs=2).generate(prompts, params)]
    llm = _llm("int3", max_num_seqs=2)
    engine = llm.engine
    cache, runner = engine.kv_cache, engine.runner
    poison = poison_graph_key(cache)
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(3):
        engine.step()
    steps = runner.graph_steps
    poison["armed"] = True
    while engine.has_unfinished():
        engine.step()
    assert runner.graph_steps > steps and not poison["armed"]
    first, second = engine.requests[ids[0]], engine.requests[ids[1]]
    assert first.finish_reason == "error" and "non-finite keys or values" in first.error
    assert second.finish_reason == "length" and second.output_token_ids == clean[1]


def test_graph_pool_estimate_counts_the_decode_workspace():
    """With a low-bit cache the estimate adds the v7 decode kernel's split-K buffers of the largest bucket:
    bucket x Hkv x splits x 8 x (D + 1) x 4 bytes, splits as the kernel plans them for the bucket."""
    from moekv.config import ArchConfig, CacheConfig
    from moekv.engine.graph_buckets import graph_buckets, graph_pool_bytes
    from moekv.kvcache import KVCacheSpec, kv_cache_class
    from moekv.ops.cuda import lowbit_decode

    arch = ArchConfig(architecture="mixtral", vocab_size=128, hidden_size=32, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, num_experts=4, top_k=2, expert_intermediate_size=16,
                      norm_topk_prob=True, max_position_embeddings=4096)
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, page_size=128, dtype=torch.bfloat16)

    def workspace(kv_cache_dtype: str) -> int:
        return kv_cache_class(kv_cache_dtype).graph_workspace_bytes(
            spec, CacheConfig(kv_cache_dtype=kv_cache_dtype), arch.num_heads, graph_buckets(8)[-1], 4096)

    assert workspace("bf16") == 0
    plain = graph_pool_bytes(arch, 8, torch.bfloat16, workspace("bf16"))
    lowbit = graph_pool_bytes(arch, 8, torch.bfloat16, workspace("int3"))
    splits = lowbit_decode.graph_split_count(8, 2, 4096 // 128, 132)
    if lowbit_decode.CHUNK_SPLIT_MAX_PAGES > 0:
        assert splits == 32                      # 16 pairs: chunk-split CTAs, one wave of 4 a SM, a page per split
    else:
        assert splits == lowbit_decode.plan_splits(8, 2, 32, 132)   # page-per-warp CTAs (chunk splits off)
    assert lowbit_decode.graph_split_count(16, 2, 4096 // 128, 132) == lowbit_decode.plan_splits(16, 2, 32, 132) == 4
    assert lowbit - plain == 8 * 2 * splits * 8 * (8 + 1) * 4
