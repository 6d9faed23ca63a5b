"""bench_decode's byte counts: the weights and KV a decode step must read (its "floor") and KV bits per value.

The floor of a step is the time it would take to read every byte it needs exactly once at the read bandwidth
measured in the same run (benchmarks/timing.read_bandwidth: a read-only reduction, nothing written back). Not
the copy bandwidth: torch's copy_ moves each byte twice (read + write), and its (read + write) / time rate of
~2.77 TB/s on an H200 sits far below what a pure read reaches (~4.3-4.45 TB/s), so a floor at it (9.99 ms for
Mixtral-8x7B B=1 16k bf16) was no floor at all.
"""

from __future__ import annotations


def weight_bytes(model) -> tuple[int, int]:
    """(bytes of the routed experts of one MoE layer's one expert, bytes of everything else read per step): FP8
    codes count 1 byte, their fp32 scales 4; the embedding counts one row per token (not here: negligible)."""
    arch = model.arch
    experts = next(layer.mlp.experts for layer in model.layers if layer.is_moe)
    expert_ids = {id(t) for layer in model.layers if layer.is_moe for t in layer.mlp.experts.parameters()}
    per_expert = sum(t.numel() * t.element_size() for t in experts.parameters()) // arch.num_experts
    rest = sum(t.numel() * t.element_size() for name, t in model.named_parameters()
               if id(t) not in expert_ids and not name.startswith("embed_tokens"))
    return per_expert, rest


def touched_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts one MoE layer reads for `batch` tokens under uniform routing: E (1 - (1 - k/E)^B)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def step_bytes(arch, per_expert: int, rest: int, moe_layers: int, batch: int, context: int, kv_bits: float) -> float:
    """Bytes one decode step of `batch` sequences at `context` tokens must read: the non-expert weights, the
    touched routed experts of every MoE layer, and K and V of every layer at kv_bits per value."""
    kv = batch * context * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2 * kv_bits / 8
    return rest + moe_layers * touched_experts(arch.num_experts, arch.top_k, batch) * per_expert + kv


def floor_from_bytes(nbytes: float, read_tbps: float | None) -> float | None:
    """Milliseconds to read nbytes at read_tbps TB/s (None without a measured bandwidth, e.g. on a CPU)."""
    return None if not read_tbps else nbytes / (read_tbps * 1e9)


def floor_ms(model, batch: int, context: int, kv_bits: float, read_tbps: float | None) -> float | None:
    """The step's time at the read bandwidth if it read every byte it needs once (step_bytes of this model)."""
    if not read_tbps:
        return None
    per_expert, rest = weight_bytes(model)
    moe_layers = sum(1 for layer in model.layers if layer.is_moe)
    return floor_from_bytes(step_bytes(model.arch, per_expert, rest, moe_layers, batch, context, kv_bits), read_tbps)


def pct_of_floor(floor: float | None, tpot_ms: float) -> float | None:
    """The share of the floor a measured step reaches, in % (100 = at the floor)."""
    return None if floor is None else 100 * floor / tpot_ms


def kv_bits_at(cache, batch: int, context: int) -> dict:
    """All-in KV bits per value at the scenario's nominal context: at exactly `context` tokens per sequence (a
    multiple of the page size holds no full-precision staging page), the mean over one page's fill cycle
    (context .. context + P - 1 tokens: a partly filled page costs a whole staging page in the model dtype) and
    the low-bit pages alone. `kv_bits_per_value` is the same accounting at the lengths the engine held."""
    page = cache.spec.page_size
    cycle = [cache.bits_per_value([n] * batch) for n in range(context, context + page)]
    return {"kv_bits_at_context": cache.bits_per_value([context] * batch),
            "kv_bits_page_cycle_mean": sum(cycle) / len(cycle), "kv_page_bits_per_value": cache.page_bits_per_value()}
