"""The CUDA-graph decode path (engine/cuda_graphs.py, engine/graph_buckets.py): per-bucket static buffers, padding rows, fixed
split-K, begin/end step hooks.

On the CPU the static-buffer code runs eagerly (`enable_graphs(capture=False)`), which is exactly what a
graph captures; it must give the same greedy tokens as the normal path on the bundled model, with ragged
batches padded to buckets, batches shrinking across bucket edges and sequences crossing page boundaries
while decoding. The static forward must never read a tensor back to the host. On CUDA, real capture and
replay must match eager execution token for token.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from moekv import LLM, SamplingParams
from moekv.engine.graph_buckets import graph_buckets
from moekv.kvcache.formats.lowbit import LowBitKVCache
from moekv.ops import dispatch
from moekv.paths import default_model_dir
from moekv.scheduler.output import SchedulerOutput

# ragged prompts (1 to 14 tokens) and ragged lengths: sequences finish at different steps, so the decode
# batch shrinks 6 -> 1 across the buckets 8, 4, 2, 1
PROMPTS = [[5, 17, 33, 9, 100, 3, 44], [7], [12, 13, 14], list(range(1, 15)), [40, 41], [300, 301, 302, 303, 304]]
MAX_TOKENS = [9, 14, 3, 7, 11, 5]


def _generate(static: bool, kv_cache_dtype: str, dtype: str, page_size: int, prompts=PROMPTS,
              max_tokens=MAX_TOKENS, device: str = "cpu", capture: bool = False, max_num_seqs: int = 8,
              num_splits: int | None = None, model=None, **kwargs):
    llm = LLM(model=str(model or default_model_dir()), dtype=dtype, kv_cache_dtype=kv_cache_dtype, device=device,
              page_size=page_size, max_model_len=128, max_num_seqs=max_num_seqs, cuda_graphs=False, **kwargs)
    runner = llm.engine.runner
    if static:
        if num_splits is not None:
            runner._num_splits = lambda size: num_splits
        assert runner.enable_graphs(capture=capture), runner.graph_fallback_reason
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], llm


def test_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(6) == [1, 2, 4, 6]
    assert graph_buckets(256)[-3:] == [64, 128, 256]


@pytest.mark.parametrize("kv_cache_dtype,dtype", [("fp32", "fp32"), ("bf16", "bf16")])
def test_static_path_matches_eager(kv_cache_dtype, dtype):
    expected, _ = _generate(False, kv_cache_dtype, dtype, page_size=4)
    got, llm = _generate(True, kv_cache_dtype, dtype, page_size=4)
    assert got == expected
    runner = llm.engine.runner
    assert runner.graph_steps > 0
    assert sorted(runner._buckets) == [1, 2, 4, 8]        # 6 sequences pad to 8, then the batch shrinks
    assert runner.scratch_page is not None
    assert llm.engine.kv_manager.num_free_pages == llm.engine.kv_manager.pool.num_pages - 1   # only scratch held


def test_padding_rows_do_not_count_as_expert_load():
    _, eager = _generate(False, "fp32", "fp32", page_size=4)
    _, static = _generate(True, "fp32", "fp32", page_size=4)
    assert torch.equal(eager.engine.expert_load(), static.engine.expert_load())
    # the load window: folded by the model's pre-hook before each eager step, inside the forward of a graph step
    # (its host half counts the step): the same window, bit for bit, and the same step count
    eager_load, static_load = eager.engine.routing.load, static.engine.routing.load
    assert torch.equal(eager_load.window, static_load.window) and eager_load.steps == static_load.steps > 10
    assert eager.engine.routing_stats()["expert_load"] == static.engine.routing_stats()["expert_load"]


@pytest.mark.skipif(not LowBitKVCache.supports_graph_decode,
                    reason="the low-bit cache does not implement the graph-decode step hooks yet")
def test_static_path_matches_eager_int3():
    # page_size 16: the 14-token prompt crosses into its second page while decoding, pages fill and quantize
    expected, _ = _generate(False, "int3", "fp32", page_size=16)
    got, llm = _generate(True, "int3", "fp32", page_size=16)
    assert got == expected
    assert llm.engine.runner.graph_steps > 0


def _forbid_host_reads(monkeypatch, runner):
    """Make every host read of a tensor raise while the static forward runs."""
    forward = runner._static_forward
    calls = []

    def guarded(bucket):
        def forbidden(*args, **kwargs):
            raise AssertionError("the decode forward read a tensor back to the host")

        with monkeypatch.context() as patch:
            for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
                patch.setattr(torch.Tensor, name, forbidden)
            patch.setattr(torch, "tensor", forbidden)
            out = forward(bucket)
        calls.append(bucket.size)
        return out

    runner._static_forward = guarded
    return calls


def test_static_forward_does_no_host_sync(monkeypatch, tmp_path):
    """Triton kernels (the CPU interpreter without CUDA) with a fixed split count of 3: no .item()/.tolist()/
    .cpu()/torch.tensor/bool() inside the forward, and the tokens match the eager Triton path. A tiny random
    Mixtral with the bundled model's attention shape (8 query / 2 KV heads of 64, 8 experts top-2) but 2 layers
    and hidden size 64: the interpreter runs every kernel of the step in a fraction of the bundled model's time."""
    pytest.importorskip("triton")
    pytest.importorskip("transformers")
    from tests.hf_fixtures import make_checkpoint

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, _ = make_checkpoint(tmp_path, "mixtral", num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64,
                               num_experts=8, top_k=2)
    with dispatch.override(backend="triton"):
        # short ragged prompts (the prefill is not what is checked): 3 sequences pad to bucket 4, then buckets 2 and
        # 1; the first one's second decode step starts its second page
        prompts, max_tokens = [[5, 17, 33], [7], [12, 13]], [3, 4, 2]
        expected, _ = _generate(False, "fp32", "fp32", page_size=4, prompts=prompts, max_tokens=max_tokens,
                                max_num_seqs=4, device=device, model=model)
        llm = LLM(model=str(model), dtype="fp32", kv_cache_dtype="fp32", device=device, page_size=4,
                  max_model_len=128, max_num_seqs=4, cuda_graphs=False)
        runner = llm.engine.runner
        runner._num_splits = lambda size: 3
        assert runner.enable_graphs(capture=False)
        calls = _forbid_host_reads(monkeypatch, runner)
        outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                                      for n in max_tokens])
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert calls == [4, 2, 1] and sorted(runner._buckets) == [1, 2, 4]
        assert all(b.meta.fixed_num_splits == 3 for b in runner._buckets.values())


def test_falls_back_to_eager_for_offloaded_experts():
    llm = LLM(model=default_model_dir(), dtype="fp32", device="cpu", max_model_len=64, cuda_graphs=False,
              cpu_offload_experts=True)
    runner = llm.engine.runner
    assert not runner.enable_graphs(capture=False)
    assert "LocalExperts" in runner.graph_fallback_reason
    assert runner.graph_mode is None and runner.scratch_page is None


def test_enforce_eager_config():
    llm = LLM(model=default_model_dir(), dtype="fp32", device="cpu", max_model_len=64, cuda_graphs=False)
    assert llm.engine.config.device.cuda_graphs is False
    assert llm.engine.runner.graph_mode is None


# -- CUDA: real capture and replay ------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("kv_cache_dtype,dtype,page_size", [("fp32", "fp32", 4), ("bf16", "bf16", 16),
                                                            ("int3", "bf16", 16)])
def test_cuda_graph_replay_matches_eager(kv_cache_dtype, dtype, page_size):
    if kv_cache_dtype == "int3" and not LowBitKVCache.supports_graph_decode:
        pytest.skip("the low-bit cache does not implement the graph-decode step hooks yet")
    # the same static buffers and kernels run eagerly: replay must be bit-identical, so the tokens are equal
    static, _ = _generate(True, kv_cache_dtype, dtype, page_size, device="cuda", capture=False)
    replayed, llm = _generate(True, kv_cache_dtype, dtype, page_size, device="cuda", capture=True)
    runner = llm.engine.runner
    assert runner.captures == 4 and runner.graph_steps > 0
    assert replayed == static
    if dtype == "fp32":
        # fp32 end to end: plain eager (host-planned splits, unpadded batches) gives the same tokens
        eager, _ = _generate(False, kv_cache_dtype, dtype, page_size, device="cuda")
        assert replayed == eager


@needs_cuda
def test_cuda_engine_uses_graphs_by_default():
    llm = LLM(model=default_model_dir(), device="cuda", max_model_len=256, max_num_seqs=4)
    assert llm.engine.runner.graph_mode == "cuda", llm.engine.runner.graph_fallback_reason
    out = llm.generate([[5, 6, 7], [8]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 6 for o in out)
    assert llm.engine.runner.graph_steps > 0
    eager = LLM(model=default_model_dir(), device="cuda", max_model_len=256, max_num_seqs=4, cuda_graphs=False)
    assert eager.engine.runner.graph_mode is None


# -- review regressions ---------------------------------------------------------------------------------------
def _int3_llm(**kwargs):
    llm = LLM(model=default_model_dir(), dtype="fp32", kv_cache_dtype="int3", device="cpu", page_size=16,
              max_model_len=128, cuda_graphs=False, **kwargs)
    assert llm.engine.runner.enable_graphs(capture=False), llm.engine.runner.graph_fallback_reason
    return llm


def test_padding_only_step_then_chunked_prefill_with_one_seq():
    """On CUDA a bucket's capture runs padding-only warm-up steps (here: _execute_graph with no chunks), and the
    scratch page keeps the staging slot its padding rows took. With max_num_seqs=1 a prefill chunk from a partial
    page into the next partial page needs two more: the default staging pool (2 per sequence) ran out
    (OutOfKVCacheError) unless it counts the scratch page's slot too."""
    llm = _int3_llm(max_num_seqs=1, max_num_batched_tokens=20)
    runner = llm.engine.runner
    with torch.inference_mode():
        runner._execute_graph(SchedulerOutput())          # what _capture's warm-up runs: padding rows only
    assert llm.engine.kv_cache.slots.num_used == 1        # the scratch page's, kept for good
    expected, _ = _generate(False, "int3", "fp32", page_size=16, prompts=[list(range(1, 51))], max_tokens=[4],
                            max_num_seqs=1, max_num_batched_tokens=20)
    out = llm.generate([list(range(1, 51))], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in out] == expected


def test_empty_request_id_is_rejected():
    """"" is the request id of a bucket's padding rows: the low-bit cache never reports non-finite keys/values
    under it, so a real request named "" would have its corruption silently zeroed and committed."""
    from moekv.errors import InvalidRequestError

    llm = _int3_llm(max_num_seqs=4)
    with pytest.raises(InvalidRequestError):
        llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id="")
    assert not llm.engine.requests and not llm.engine.has_unfinished()


def test_failed_capture_falls_back_to_eager_once(monkeypatch):
    expected, _ = _generate(False, "fp32", "fp32", page_size=4)
    llm = LLM(model=default_model_dir(), dtype="fp32", kv_cache_dtype="fp32", device="cpu", page_size=4,
              max_model_len=128, max_num_seqs=8, cuda_graphs=False)
    runner = llm.engine.runner
    assert runner.enable_graphs(capture=False)
    runner.graph_mode = "cuda"                                  # as on a GPU: the next new bucket captures
    attempts = []

    def failing_capture(bucket):
        attempts.append(bucket.size)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runner, "_capture", failing_capture)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert got == expected
    assert attempts == [8]                                      # tried once, then eager for good
    assert runner.graph_mode is None and "capture failed" in runner.graph_fallback_reason


# -- collective steps (expert parallelism) through a step coordinator -----------------------------------------
class _Coordinator:
    """Stands in for distributed.expert_parallel.ExpertParallelRuntime: forces every decode step into the
    largest bucket, as when another rank has more sequences, and records what the runner asks of it."""

    def __init__(self):
        self.graph_bucket = None
        self.configured = []
        self.static_forwards = 0

    def graph_ineligibility(self):
        return None

    def configure_graphs(self, buckets, capture):
        self.configured.append((list(buckets), capture))

    def static_forward(self, meta):
        self.static_forwards += 1
        return contextlib.nullcontext()

    def any_rank(self, flag):
        return flag


def test_agreed_bucket_and_idle_steps_keep_tokens():
    """The bucket a step runs in is the coordinator's (here always 8, larger than the local batch), and a
    padding-only step between steps (a rank without sequences replaying the agreed bucket) changes nothing."""
    expected, _ = _generate(False, "fp32", "fp32", page_size=4)
    llm = LLM(model=default_model_dir(), dtype="fp32", kv_cache_dtype="fp32", device="cpu", page_size=4,
              max_model_len=128, max_num_seqs=8, cuda_graphs=False)
    engine, runner = llm.engine, llm.engine.runner
    coordinator = _Coordinator()
    runner.coordinator = coordinator
    assert runner.enable_graphs(capture=False)
    assert coordinator.configured == [([1, 2, 4, 8], False)]
    schedule = engine.scheduler.schedule

    def agreed_schedule():
        out = schedule()
        batch = runner.graph_batch(out)
        coordinator.graph_bucket = 8 if batch else None       # decode-only steps: every rank's bucket is 8
        return out

    engine.scheduler.schedule = agreed_schedule
    step = engine.step

    def step_then_idle():
        outputs = step()
        coordinator.graph_bucket = 8
        runner.execute_idle()
        coordinator.graph_bucket = None
        return outputs

    engine.step = step_then_idle
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert got == expected
    assert sorted(runner._buckets) == [8] and runner.idle_steps > 0
    assert coordinator.static_forwards == runner.graph_steps
    assert runner.graph_batch(SchedulerOutput()) == 0


def test_first_cause_names_the_first_error_and_respects_from_none():
    from moekv.engine.cuda_graphs import _first_cause

    def capture():
        try:
            raise RuntimeError("operation not permitted when stream is capturing")
        except RuntimeError:
            raise RuntimeError("operation failed due to a previous error during capture")

    with pytest.raises(RuntimeError) as info:
        capture()
    text = _first_cause(info.value)
    assert "first error: RuntimeError: operation not permitted" in text and "test_graph_decode.py" in text

    def suppressed():
        try:
            raise KeyError("handled")
        except KeyError:
            raise ValueError("unrelated") from None

    with pytest.raises(ValueError) as info:
        suppressed()
    assert _first_cause(info.value) == ""


def test_bucket_fill_writes_block_tables_incrementally():
    """A row keeping its table list writes only the entries appended since the last fill; a new list (a freed
    and re-admitted sequence), a shorter one or another row's is written whole; padding rows read the scratch
    page. What the bucket holds always equals a from-scratch fill."""
    from moekv.engine.graph_buckets import GraphBucket

    def fresh(rows):
        bucket = GraphBucket(4, 6, 9, 4, None, torch.device("cpu"))
        bucket.fill(rows)
        return bucket

    def tables(bucket, rows):
        held = bucket._tables
        return [held[i, :len(r[2])].tolist() for i, r in enumerate(rows)] + \
            [held[i, :1].tolist() for i in range(len(rows), bucket.size)]

    def check(bucket, rows):
        want = fresh(rows)
        assert tables(bucket, rows) == tables(want, rows) == [list(r[2]) for r in rows] + [[9]] * (4 - len(rows))
        assert torch.equal(bucket.host[:6 * 4 * 4], want.host[:6 * 4 * 4])    # the per-row fields

    bucket = GraphBucket(4, 6, 9, 4, None, torch.device("cpu"))
    a, b = [3, 5], [7]
    bucket.fill([(1, 5, a, "a"), (2, 2, b, "b")])
    check(bucket, [(1, 5, a, "a"), (2, 2, b, "b")])
    a.append(11)                                  # a opens a page: one entry to write
    bucket.fill([(1, 8, a, "a"), (2, 3, b, "b")])
    assert bucket._written[0] == (a, 3)
    check(bucket, [(1, 8, a, "a"), (2, 3, b, "b")])
    bucket.fill([(2, 3, b, "b"), (1, 9, a, "a")])            # rows swap: both written whole
    check(bucket, [(2, 3, b, "b"), (1, 9, a, "a")])
    rows = [(2, 4, [8, 1], "b"), (1, 9, [4, 6, 2], "a"), (3, 0, [0], "c")]    # re-admitted: new lists
    bucket.fill(rows)
    check(bucket, rows)
    bucket.fill([])
    assert bucket._tables[:, 0].tolist() == [9, 9, 9, 9] and bucket.meta.request_ids == [""] * 4
    assert bucket.meta.block_tables_host == [[9]] * 4 and bucket.meta.max_seq_len == 1
