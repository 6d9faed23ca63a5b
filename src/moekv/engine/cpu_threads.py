"""torch's intra-op thread count on the CPU, per step (DeviceConfig.cpu_threads None: automatic).

Small models (hidden < 2048) run decode-sized steps on one thread: thread hand-offs cost more than they save
(~20x slower on a loaded 2-core machine). A step of at least BIG_STEP_TOKENS tokens (a long prefill chunk) has
enough work per op to use every core: a 4k-token prompt of the bundled model prefills at ~5.5k tokens/s on 2
cores against ~3k on one (benchmarks/results/cpu-prefill-tiny-shakespeare-moe.md). A fixed cpu_threads wins.
"""

from __future__ import annotations

import torch

BIG_STEP_TOKENS = 1024


class CpuThreads:
    def __init__(self, fixed: int | None, hidden_size: int):
        self.all = torch.get_num_threads()
        self.fixed = fixed
        self.small = fixed if fixed is not None else (1 if hidden_size < 2048 else self.all)
        self.current = None
        self.set(self.small)

    def set(self, threads: int) -> None:
        if threads != self.current:
            torch.set_num_threads(threads)
            self.current = threads

    def for_step(self, num_tokens: int) -> None:
        """Before a step of `num_tokens` tokens."""
        if self.fixed is None:
            self.set(self.all if num_tokens >= BIG_STEP_TOKENS else self.small)
