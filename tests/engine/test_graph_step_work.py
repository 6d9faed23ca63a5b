"""The eager work of a graph decode step outside its (captured) forward, counted on the CPU in static graph
mode: device ops (views and other metadata-only ops left out) and host reads, per phase. At B=1 on a GPU
every launch and every host read outside the graph is time the GPU idles, so these are count bounds, not
timings: the low-bit cache's step hooks add one host->device copy to an ordinary decode step and no host
read (the runner reads the cache's non-finite flags back with its own status row, in the step's one read).
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moekv import LLM, SamplingParams
from moekv.engine.step_result import usable_rows
from moekv.paths import default_model_dir

PAGE = 16
# aten ops that launch nothing (views, aliasing, conj/neg resolution, a no-op `to`)
_NO_KERNEL = {"detach", "detach_", "resolve_conj", "resolve_neg", "lift_fresh", "to", "alias", "slice", "select",
              "view", "unsqueeze", "expand", "t", "transpose", "as_strided", "_reshape_alias", "squeeze", "unbind",
              "split", "narrow", "reshape", "_unsafe_view", "flatten", "unflatten", "permute"}
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


def _llm(kv_cache_dtype: str, max_num_seqs: int = 1) -> LLM:
    llm = LLM(model=default_model_dir(), dtype="fp32", kv_cache_dtype=kv_cache_dtype, device="cpu", page_size=PAGE,
              max_model_len=256, max_num_seqs=max_num_seqs, cuda_graphs=False)
    assert llm.engine.runner.enable_graphs(capture=False)
    return llm


def _count_steps(monkeypatch, llm: LLM, prompts: list[list[int]], num_steps: int):
    """Runs the prompts' prefill and first decode, then `num_steps` decode steps; returns per step
    (kind, device ops by phase, host reads by phase), kind "ordinary" or "page" (a page starts or fills)."""
    engine = llm.engine
    runner, cache = engine.runner, engine.kv_cache
    phase = ["engine"]
    ops: dict = collections.defaultdict(collections.Counter)
    reads: collections.Counter = collections.Counter()

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

        def read(self, *args, _original=original, _name=name, **kwargs):
            if phase[-1] != "forward":
                reads[phase[-1]] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, read)

    params = SamplingParams(max_tokens=num_steps + 8, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    engine.step()
    engine.step()
    steps = []
    for _ in range(num_steps):
        positions = [r.num_computed_tokens for r in engine.scheduler.running]
        kind = "page" if any(p % PAGE in (0, PAGE - 1) for p in positions) else "ordinary"
        ops.clear()
        reads.clear()
        graph_steps = runner.graph_steps
        with _Ops(phase, ops):
            engine.step()
        assert runner.graph_steps == graph_steps + 1
        steps.append((kind, {k: dict(v) for k, v in ops.items() if k != "forward"}, dict(reads)))
    return steps


def test_lowbit_step_hooks_add_one_copy_and_no_host_read(monkeypatch):
    steps = _count_steps(monkeypatch, _llm("int3"), [[5, 17, 33]], 2 * PAGE)
    ordinary = [s for s in steps if s[0] == "ordinary"]
    page = [s for s in steps if s[0] == "page"]
    assert len(ordinary) >= PAGE and len(page) >= 2
    for _, ops, reads in ordinary:
        # begin_step: one host->device copy of the index rows + cleared flags; end_step: nothing on the device
        assert ops.get("cache", {}) == {"copy_": 1}, ops
        assert "cache" not in reads, reads
        assert reads == {"runner": 1}, reads          # the step's one host read: the runner's status row
        assert "engine" not in ops, ops               # no logits check, no greedy sampling op of its own
    for _, ops, reads in page:
        # a page starts (slot taken: map update) or fills (slot returned at commit): a map update on top
        assert sum(ops.get("cache", {}).values()) <= 2, ops
        assert "cache" not in reads and reads == {"runner": 1}, reads


def test_lowbit_step_costs_at_most_one_op_more_than_full_precision(monkeypatch):
    prompts = [[5, 17, 33], [7], [40, 41, 42, 43]]
    lowbit = _count_steps(monkeypatch, _llm("int3", max_num_seqs=4), prompts, 6)
    monkeypatch.undo()
    full = _count_steps(monkeypatch, _llm("fp32", max_num_seqs=4), prompts, 6)
    for (kind, ops, reads), (_, full_ops, full_reads) in zip(lowbit, full):
        if kind != "ordinary":
            continue
        total = sum(sum(c.values()) for c in ops.values())
        full_total = sum(sum(c.values()) for c in full_ops.values())
        assert total <= full_total + 1, (ops, full_ops)
        assert sum(reads.values()) == sum(full_reads.values()) == 1, (reads, full_reads)


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
    original = cache.attention
    poison = {"armed": False}

    def attention(layer, query, key, value, meta, scale):
        if poison["armed"] and layer == 1 and meta.fixed_num_splits is not None:
            key = key.clone()
            key[0, 0, 0] = float("nan")                  # the first sequence's new key, in a graph step
            poison["armed"] = False
        return original(layer, query, key, value, meta, scale)
    cache.attention = attention
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
    splits = lowbit_decode.plan_splits(8, 2, 4096 // 128, 132)
    assert splits == 4                           # 32 pages: at least 8 per split
    assert lowbit - plain == 8 * 2 * splits * 8 * (8 + 1) * 4
