"""oneDNN's caches of compiled CPU matmuls are bounded (DeviceConfig.cpu_kernel_cache_entries; issue 20):
at their default 1024 entries of ~1 MB, batches of ever-new shapes grew a server's RSS by ~1 GB."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from moekv import envs
from moekv.config import DeviceConfig
from moekv.errors import ConfigError

SCRIPT = """
import json, sys
import torch
from moekv import envs
from moekv.config import DeviceConfig
applied = envs.limit_onednn_caches(DeviceConfig(cpu_kernel_cache_entries=16).cpu_kernel_cache_entries) \\
    if sys.argv[1] == "limit" else {}
torch.set_num_threads(1)
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
weight = torch.randn(512, 256, dtype=torch.bfloat16)
torch.nn.functional.linear(torch.randn(1, 256, dtype=torch.bfloat16), weight)
before = rss_mb()
for rows in range(2, 402):   # 400 new shapes, as a server's batches make them
    torch.nn.functional.linear(torch.randn(rows, 256, dtype=torch.bfloat16), weight)
print(json.dumps({"growth_mb": rss_mb() - before, "applied": applied}))
"""


def test_cpu_kernel_cache_entries_is_validated():
    assert DeviceConfig().cpu_kernel_cache_entries == 128
    assert DeviceConfig(cpu_kernel_cache_entries=None).cpu_kernel_cache_entries is None
    for bad in (0, -1, 1.5, "8"):
        with pytest.raises(ConfigError, match="cpu_kernel_cache_entries"):
            DeviceConfig(cpu_kernel_cache_entries=bad)


def test_a_user_setting_wins(monkeypatch):
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert envs.limit_onednn_caches(32) == {"LRU_CACHE_CAPACITY": "7", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "32"}


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs torch built with oneDNN")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_new_matmul_shapes_do_not_grow_memory_without_bound():
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, "limit"], capture_output=True, text=True, timeout=300,
                         env=env, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["applied"] == {"LRU_CACHE_CAPACITY": "16", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16"}
    # 16 entries of ~1 MB; oneDNN's default (1024 entries) grew 271 MB over these 400 shapes (measured)
    assert result["growth_mb"] < 100, result
