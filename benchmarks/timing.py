"""Shared GPU timing for the benchmarks: the median of CUDA-graph replays.

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
