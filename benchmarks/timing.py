"""Shared GPU timing for the benchmarks: the median of CUDA-graph replays, and the read bandwidth (a read-only
reduction, cold L2) that the benchmarks' floors stand on.

Imported as `benchmarks.timing` (run the benchmarks with `PYTHONPATH=src:.`: see benchmarks/__init__.py).
"""

from __future__ import annotations

import statistics

import torch


def cuda_graph_ms(body, reps: int, trials: int) -> float:
    """Median milliseconds of one `body()` call: warm up on a side stream, capture `reps` calls in
    one CUDA graph, replay it `trials` times timed with CUDA events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()                                            # compiles, warms the allocator
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            body()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    del graph
    return statistics.median(times)


L2_FLUSH_BYTES = 256 * 2**20                  # zeroed before each timed read: nothing of the buffer stays in L2
READ_PROBE_BYTES = 2 * 2**30


def tbps(nbytes: float, ms: float) -> float:
    """TB/s of nbytes moved in ms milliseconds."""
    return nbytes / ms / 1e9


def read_bandwidth(device: torch.device, nbytes: int = READ_PROBE_BYTES, reps: int = 5, trials: int = 7) -> float | None:
    """Read-only bandwidth in TB/s: torch.sum of an nbytes bf16 buffer into one fp32 scalar (nbytes read, 4
    bytes written), the median of `trials` CUDA-graph replays of `reps` sums, each sum after zeroing a 256 MiB
    buffer (cold L2); the zeroing alone is timed the same way and subtracted. None on a CPU.

    The bandwidth a kernel that reads its bytes once can reach, unlike torch's copy_ ((read + write) / time):
    the floors of bench_decode ("% of floor"), bench_attention and bench_gemv ("% read") stand on it."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    acc = torch.empty((), dtype=torch.float32, device=device)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)

    def body():
        flush.zero_()
        torch.sum(src, dim=0, dtype=torch.float32, out=acc)

    ms = cuda_graph_ms(body, reps, trials) - cuda_graph_ms(flush.zero_, reps, trials)
    del src, acc, flush
    return tbps(nbytes, ms)
