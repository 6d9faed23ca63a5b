"""`torchrun --nproc-per-node 2 -m moekv serve --expert-parallel-size 2`: rank 0 serves HTTP, both ranks
step in lockstep, and greedy completions equal a single process's."""

from __future__ import annotations

import concurrent.futures
import sys

import pytest

from moekv import LLM, SamplingParams
from tests.entrypoints.openai.subprocess_server import ServerProcess
from tests.helpers import bundled_model

openai = pytest.importorskip("openai")
MODEL = bundled_model()
pytestmark = pytest.mark.skipif(MODEL is None, reason="needs the bundled model models/tiny-shakespeare-moe")


def test_expert_parallel_server_matches_one_process(tmp_path):
    # --max-model-len 64: a small KV pool, not the CPU default of 1 GiB on each rank (and in the local LLM)
    server = ServerProcess(MODEL, tmp_path / "ep-serve.log", "--device", "cpu", "--expert-parallel-size", "2",
                           "--max-model-len", "64")
    server.command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                      *server.command[1:]]
    prompts = ["ROMEO:", "JULIET:\nO", "First Citizen:", "KING"]
    server.start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")

        def complete(prompt):
            response = client.completions.create(model=MODEL.name, prompt=prompt, max_tokens=10, temperature=0,
                                                 extra_body={"ignore_eos": True})
            return response.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:   # spread over both ranks
            served = list(pool.map(complete, prompts))
    finally:
        server.stop()
    local = LLM(model=str(MODEL), device="cpu", max_model_len=64).generate(
        prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert served == [out.outputs[0].text for out in local]
