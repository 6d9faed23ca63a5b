"""engine/cpu_threads.py: one thread for a small model's small steps, every core for long prefill chunks,
a fixed DeviceConfig.cpu_threads always."""

import torch

from moekv.engine.cpu_threads import BIG_STEP_TOKENS, CpuThreads


def test_small_model_threads_per_step():
    before = torch.get_num_threads()
    try:
        threads = CpuThreads(None, hidden_size=256)
        assert torch.get_num_threads() == 1
        threads.for_step(BIG_STEP_TOKENS)
        assert torch.get_num_threads() == threads.all == before
        threads.for_step(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_fixed_threads_win():
    before = torch.get_num_threads()
    try:
        threads = CpuThreads(1, hidden_size=256)
        threads.for_step(10 * BIG_STEP_TOKENS)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
