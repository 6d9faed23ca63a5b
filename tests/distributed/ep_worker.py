"""Expert-parallel generation under torchrun, for tests/distributed (one process per rank, gloo).

    PYTHONPATH=src:. torchrun --standalone --nproc-per-node N tests/distributed/ep_worker.py SPEC.json OUT_DIR

SPEC = {"scenarios": [...]}; each scenario has a "name" and a "kind":
  "random": a tiny random Mixtral (helpers.tiny_arch(num_experts, top_k)), sharded after it is built ("fp8":
            its experts quantized to FP8 first);
            greedy generation of helpers.prompts_and_params(); with "rebalance", then rebalance() and
            generate again. "scheduler": SchedulerConfig keywords. "static": decode steps through the
            runner's graph buckets, run eagerly (enable_graphs(capture=False)); "no_host_reads": their
            forward must not read a tensor back; "fake_capture": the CUDA capture path with a stand-in
            for the capture itself (replay = the static forward), {"fail_rank": r} makes r's capture raise.
            Each rank's graph counters come back in "per_rank". "device": "cuda" (one GPU per rank, NCCL;
            a launch's scenarios must all use the same device), "cuda_graphs": False for eager steps,
            "arch": ArchConfig overrides (the GPU kernels want head_dim >= 16).
  "llm":    LLM(model, expert_parallel_size=N, **kwargs).generate(prompts) (the offline API path);
            with "rebalance", then LLM.rebalance() and generate again.
  "serve":  engine.leader without HTTP: rank 0 adds requests to a LeaderEngine and steps it.
  "exchange": one MoE layer's all-gather exchange against the single-device experts, and its launching
            ops per layer (tests/distributed/exchange_checks.py).
  "fail":   like "random" (or "serve" with "serve": true), but rank "fail_rank" raises inside its
            experts' compute after "fail_after" calls (mid-step, between two collectives); with
            "swallow", that rank catches the error and sleeps (a process that stays alive), else it
            propagates. The other ranks must stop at once (distributed.failure); nothing is written.
Every rank checks that its outputs equal rank 0's; rank 0 writes OUT_DIR/<name>.json.
"""

from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from moekv.distributed.groups import init_expert_parallel, shutdown  # noqa: E402
from moekv.sampling import SamplingParams  # noqa: E402
from tests.distributed.exchange_checks import run_exchange  # noqa: E402
from tests.distributed.helpers import engine_config, prompts_and_params, tiny_arch  # noqa: E402


def run_random(spec: dict, world: int) -> dict:
    from moekv.distributed.sharding import shard_experts
    from moekv.engine.factory import initial_placements, make_runtime
    from moekv.engine.lockstep import LockstepEngine
    from moekv.models.loader import build_random_model

    from dataclasses import replace

    arch = replace(tiny_arch(spec["num_experts"], spec.get("top_k", 2)), **spec.get("arch", {}))
    group = init_expert_parallel(world, spec.get("device", "cpu"))
    config = engine_config(world, scheduler=spec.get("scheduler"), num_redundant_experts=spec.get("redundant", 0),
                           expert_dispatch=spec.get("dispatch", "auto"),
                           allgather_max_tokens=spec.get("allgather_max_tokens"),
                           rebalance_interval=spec.get("rebalance_interval", 0), device=str(group.device),
                           cuda_graphs=spec.get("cuda_graphs", True))
    runtime = make_runtime(config.parallel, group)
    model = build_random_model(arch, dtype=torch.float32, seed=spec["seed"])
    if spec.get("fp8"):                          # FP8 experts (per output channel), as --quantization fp8
        from moekv.models.quantize import quantize_model

        quantize_model(model)
    model = shard_experts(model, runtime, initial_placements(arch, world, config.parallel.num_redundant_experts),
                          group.device)
    engine = LockstepEngine(config, model, None, runtime)
    if spec.get("static") or "fake_capture" in spec:
        assert engine.runner.enable_graphs(capture=False), engine.runner.graph_fallback_reason
    if spec.get("no_host_reads"):
        forbid_host_reads(runtime)
    if "fake_capture" in spec:
        fake_capture(engine.runner, group.rank, spec["fake_capture"].get("fail_rank"))
    prompts, params = prompts_and_params()
    result = {"tokens": _tokens(engine.generate(prompts, params)),
              "placement": {str(k): v.to_dict() for k, v in engine.placements().items()},
              "exchange_calls": dict(runtime.exchange_calls),
              "local_slots": {str(e.layer_idx): e.w_gate_up.shape[0] for e in runtime.layers},
              "fp8_experts": all(e.quantized for e in runtime.layers),
              "steps": engine.global_steps, "interval_rebalances": len(engine.last_rebalance)}
    if spec.get("rebalance"):
        # make one expert hot in the recorded load, so the balancer has to move or replicate it
        engine.model.expert_load[:, spec.get("hot_expert", 0)] += 1000
        reports = engine.rebalance()
        result["rebalance"] = [{"layer": r.layer, "before": r.imbalance_before, "after": r.imbalance_after,
                                "moved": r.experts_moved} for r in reports]
        result["placement_after"] = {str(k): v.to_dict() for k, v in engine.placements().items()}
        result["tokens_after"] = _tokens(engine.generate(prompts, params))
    runner = engine.runner
    result["rank_stats"] = {"graph_steps": runner.graph_steps, "idle_steps": runner.idle_steps,
                            "replays": runner.graph_replays, "captures": runner.captures,
                            "buckets": sorted(runner._buckets), "graph_mode": runner.graph_mode,
                            "fallback": runner.graph_fallback_reason, "step_kinds": dict(runtime.step_kinds),
                            "allgather_max_tokens": runtime.allgather_max_tokens,
                            "guarded_calls": getattr(runtime, "guarded_calls", 0)}
    return result


def forbid_host_reads(runtime) -> None:
    """Every host read of a tensor raises inside the experts' dispatch and combine of a graph step: what a
    capture would refuse. Not inside the expert compute (on the CPU the reference kernel reads its counts;
    the GPU kernels are the single-device graph path's) nor the rest of the forward (checked with the Triton
    kernels in tests/engine/test_graph_decode.py; on the CPU the reference attention reads host lists)."""
    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
    originals = {name: getattr(torch.Tensor, name) for name in names}
    original_tensor = torch.tensor
    active = [False]

    def guard(name, original):
        def method(*args, **kwargs):
            if active[0]:
                raise AssertionError(f"a graph step's expert exchange called {name}")
            return original(*args, **kwargs)
        return method

    for name, original in originals.items():
        setattr(torch.Tensor, name, guard(name, original))
    torch.tensor = guard("torch.tensor", original_tensor)
    runtime.guarded_calls = 0

    def unguarded(compute):
        def call(*args):
            saved, active[0] = active[0], False
            try:
                return compute(*args)
            finally:
                active[0] = saved
        return call

    for layer in runtime.layers:
        forward = layer.forward

        def guarded(hidden, topk_ids, topk_weights, forward=forward):
            active[0] = runtime.static_valid is not None
            runtime.guarded_calls += active[0]
            try:
                return forward(hidden, topk_ids, topk_weights)
            finally:
                active[0] = False

        layer.forward = guarded
        layer.compute, layer.compute_weighted = unguarded(layer.compute), unguarded(layer.compute_weighted)


class _FakeGraph:
    """Stands in for a captured CUDA graph on the CPU: replay runs the static forward into fixed logits."""

    def __init__(self, runner, bucket, logits):
        self.runner, self.bucket, self.logits = runner, bucket, logits

    def replay(self):
        self.logits.copy_(self.runner._static_forward(self.bucket))


def fake_capture(runner, rank: int, fail_rank: int | None) -> None:
    """Run the CUDA capture path on the CPU: warm-up (real, with its collectives), then a stand-in capture
    that raises on `fail_rank`; the ranks must agree to fall back together."""
    runner.graph_mode = "cuda"

    def record(bucket):
        if rank == fail_rank:
            raise RuntimeError("operation not permitted when stream is capturing (injected)")
        # a real capture launches nothing (no collective runs): neither does this stand-in
        logits = torch.zeros(bucket.size, runner.model.arch.vocab_size, dtype=torch.float32)
        return _FakeGraph(runner, bucket, logits), logits

    runner._record = record


def run_llm(spec: dict, world: int) -> dict:
    from moekv.entrypoints.llm import LLM

    llm = LLM(spec["model"], expert_parallel_size=world, device="cpu", **spec.get("kwargs", {}))
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    outputs = llm.generate(spec["prompts"], params)
    result = {"tokens": _tokens(outputs), "request_ids": [o.request_id for o in outputs]}
    if spec.get("rebalance"):
        reports = llm.rebalance()
        result["moved"] = sum(r.experts_moved for r in reports)
        result["tokens_after"] = _tokens(llm.generate(spec["prompts"], params))
    return result


def run_serve(spec: dict, world: int) -> dict:
    """The serving machinery without HTTP: rank 0 drives a LeaderEngine, the others follower_loop."""
    from moekv.engine.factory import build_serving_engine
    from moekv.entrypoints.llm import make_engine_config

    config = make_engine_config(spec["model"], device="cpu", expert_parallel_size=world)
    leader = build_serving_engine(config)
    tokens = None
    if leader is not None:
        params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
        ids = [leader.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(spec["prompts"][:2])]
        leader.step()                          # requests join while others run
        ids += [leader.add_request(p, params, request_id=f"r{i + 2}") for i, p in enumerate(spec["prompts"][2:])]
        aborted = leader.add_request(spec["prompts"][0], params, request_id="to-abort")
        leader.abort(aborted)
        while leader.has_unfinished():
            leader.step()
        tokens = [list(leader.requests[i].output_token_ids) for i in ids]
        owners = {i: leader.owner.get(i, 0) for i in ids}
        for request_id in ids + [aborted]:
            leader.release(request_id)
        leader.stop_followers()
        box = [{"tokens": tokens, "owners": owners, "left": len(leader.requests)}]
    else:
        box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def inject_failure(runtime, rank: int, spec: dict) -> None:
    """Make this rank's experts raise after spec["fail_after"] compute calls (between collectives)."""
    calls = {"n": 0}
    for layer in runtime.layers:
        original = layer.compute

        def failing(rows, local_ids, original=original):
            calls["n"] += 1
            if calls["n"] > spec.get("fail_after", 3):
                raise RuntimeError(f"injected failure on rank {rank}")
            return original(rows, local_ids)

        layer.compute = failing


def run_fail(spec: dict, world: int) -> dict:
    import time

    from moekv.distributed.sharding import shard_experts
    from moekv.engine.factory import initial_placements, make_runtime
    from moekv.engine.lockstep import LockstepEngine
    from moekv.models.loader import build_random_model

    arch = tiny_arch(5)
    config = engine_config(world, expert_dispatch=spec.get("dispatch", "all_to_all"))
    group = init_expert_parallel(world, "cpu")
    runtime = make_runtime(config.parallel, group)
    model = build_random_model(arch, dtype=torch.float32, seed=1)
    model = shard_experts(model, runtime, initial_placements(arch, world, 0), group.device)
    engine = LockstepEngine(config, model, None, runtime)
    if group.rank == spec["fail_rank"]:
        inject_failure(runtime, group.rank, spec)
    prompts, params = prompts_and_params()
    print(f"rank {group.rank}: generating", flush=True)
    try:
        if spec.get("serve"):
            from moekv.engine.leader import LeaderEngine, follower_loop

            if group.rank == 0:
                leader = LeaderEngine(engine)
                for i, prompt in enumerate(prompts):
                    leader.add_request(prompt, params[i], request_id=f"r{i}")
                while leader.has_unfinished():
                    leader.step()
                leader.stop_followers()
            else:
                follower_loop(engine)
        else:
            engine.generate(prompts, params)
    except RuntimeError as exc:
        if spec.get("swallow") and "injected failure" in str(exc):
            print(f"rank {group.rank}: caught {exc!r}; staying alive", flush=True)
            time.sleep(spec.get("sleep", 600))
        raise
    raise AssertionError(f"rank {group.rank}: the run finished although rank {spec['fail_rank']} should have failed")


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    faulthandler.enable()          # a crash inside a collective prints every rank's Python stack
    spec_path, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    world = int(__import__("os").environ["WORLD_SIZE"])
    for scenario in json.loads(spec_path.read_text())["scenarios"]:
        runner = {"random": run_random, "llm": run_llm, "serve": run_serve, "fail": run_fail,
                  "exchange": run_exchange}[scenario["kind"]]
        result = runner(scenario, world)
        gathered = [None] * world
        dist.all_gather_object(gathered, result["tokens"])
        result["ranks_agree"] = all(tokens == gathered[0] for tokens in gathered)
        if "rank_stats" in result:
            stats = [None] * world
            dist.all_gather_object(stats, result.pop("rank_stats"))
            result["per_rank"] = stats
        if dist.get_rank() == 0:
            (out_dir / f"{scenario['name']}.json").write_text(json.dumps(result))
    shutdown()


if __name__ == "__main__":
    main()
