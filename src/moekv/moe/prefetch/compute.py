"""Expert compute over device slots, bit-identical to the resident model (LocalExperts).

`LocalExperts` calls `ops.dispatch.moe_experts` on the stacked [E, ...] weights. An offloaded
layer only has S < E slots, and two things used to make its output differ from the resident one
in the last bits (bf16 on CUDA; enough to change greedy tokens of a random-weight model):

1. **Launch configuration keyed by the weight tensor's expert count.** The fused kernels pick
   their configuration from the shape of the weights they are given: the decode path's K-split of
   the down projection (`default_split_k` uses min(T*k, E) active experts; tuned files are keyed by
   E), the decode / grouped crossover and the grouped path's BLOCK_M. With [S, ...] slot tensors a
   16-token prefill ran the down projection in 4 K-splits instead of 1, so its fp32 sums were
   added in a different order.
2. **Several passes.** When a step needs more experts than there are slots (prefill), the experts
   are computed in groups. Each pass used to return its own weighted sum, rounded to the model
   dtype, and the passes were then added and rounded again (double rounding).

`SlotExpertCompute` fixes both: it takes the launch configuration of the *resident* shape (E
experts) and runs each pass only up to the per-(token, choice) expert outputs, which it gathers
into one buffer; the weighted sum over a token's choices runs once at the end, in the same kernel
and order as the resident path. Every per-row value is then computed by the same kernel binary on
the same weights (MMA results of a row do not depend on the other rows of a tile), so the result
is bit-identical to `LocalExperts` for any number of passes, tokens and slots.

Paths (the same choice as `ops.dispatch.moe_experts` for the resident shape):
    reference  per-expert F.linear, outputs in the model dtype, fp32 weighted index_add
    decode     Triton (T <= decode limit): act, down partials [split, T*k, H] fp32, combine
    grouped    Triton: align, act, down outputs [T*k, H] in the model dtype, combine
The path is `ops.dispatch.moe_experts_path` for the resident shape; the Triton paths are
`ops.dispatch.moe_expert_passes` (ops/triton/moe/passes.py: the launch pieces of ops.triton.moe.decode /
moe.grouped, the same functions and kernels `moe_experts_decode` / `moe_experts_grouped` use).
FP8 slots (core.fp8.Fp8Weight, host format "fp8" or an FP8 model): the W8A16 kernels with the FP8
tuned configuration, or on the reference path the fp32 matmuls on dequantized weights of
`moe_experts_reference` -- bit-identical to the resident FP8 model the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moekv.core.fp8 import Fp8Weight
from moekv.ops import dispatch


class SlotExpertCompute:
    """One MoE block's expert compute, assembled over one or more passes of slot-resident experts.

        compute = SlotExpertCompute(hidden, topk_ids, topk_weights, num_experts, inter, counts)
        for each pass: compute.add(slot_w_gate_up, slot_w_down, slot_of_expert, experts_in_pass)
        out = compute.result()                                  # [T, H], == LocalExperts' output

    topk_ids are the true expert ids (they fix the reference path's summation order and select
    each pass's rows); local_of_expert maps them to the layer's slots and slot_pool those to the
    pool's (rows of experts outside the pass may point anywhere: their values are discarded). counts: routed slots per expert (host ints,
    already read by the caller), used by the reference path to avoid another host sync.
    """

    def __init__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 num_experts: int, inter: int, counts: list[int] | None = None, weights: tuple | None = None):
        """weights: (w_gate_up, w_down) the passes will read (their format picks the FP8 configuration;
        None: 16-bit)."""
        self.hidden = hidden
        self.topk_ids = topk_ids
        self.topk_weights = topk_weights
        self.num_experts = num_experts
        num_tokens, hidden_size = hidden.shape
        self.top_k = topk_ids.shape[1]
        self.inter = inter
        # the same choice as ops.dispatch.moe_experts makes for the resident shape (E experts)
        self.path = dispatch.moe_experts_path(hidden, num_experts, inter, weights) if num_tokens > 0 else "reference"
        if self.path == "reference":
            num_rows = num_tokens * self.top_k
            flat_ids = topk_ids.reshape(-1)                                            # [T*k]
            self.order = torch.argsort(flat_ids, stable=True)                          # [T*k] slots by expert
            if counts is None:
                counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
            starts, total = [], 0
            for count in counts:
                starts.append(total)
                total += int(count)
            self.segments = {e: (starts[e], int(counts[e])) for e in range(num_experts) if counts[e] > 0}
            self.buffer = torch.empty((num_rows, hidden_size), dtype=hidden.dtype, device=hidden.device)  # sorted
        else:
            self.kernel = dispatch.moe_expert_passes(self.path, hidden, self.top_k, num_experts, inter, weights)
            self.buffer = self.kernel.buffer
        self.passes = 0

    # -- one pass ----------------------------------------------------------------------------------
    def add(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, local_of_expert, slot_pool,
            experts: list[int] | None = None) -> None:
        """Compute the rows routed to `experts` (None: every row) with the pool tensors
        w_gate_up [N, 2I, H], w_down [N, H, I]. local_of_expert [E] maps each expert to the layer's local
        slot (-1: not resident; rows of experts outside the pass may point anywhere, they are discarded),
        slot_pool [S] each local slot to its pool slot; both host lists or device int64 tensors."""
        self.passes += 1
        if self.hidden.shape[0] == 0:
            return
        device = self.topk_ids.device
        if isinstance(local_of_expert, torch.Tensor):                                  # [E] on the device
            local = local_of_expert.clamp(min=0)
        else:
            local = torch.tensor([max(slot, 0) for slot in local_of_expert], dtype=torch.int64, device=device)
        if not isinstance(slot_pool, torch.Tensor):
            slot_pool = torch.tensor(slot_pool, dtype=torch.int64, device=device)     # [S]
        if self.path == "reference":
            self._add_reference(w_gate_up, w_down, slot_pool.index_select(0, local), experts)
            return
        rows = None if experts is None else self._rows_of(experts)                     # [T*k] bool
        target = self.buffer if rows is None else torch.empty_like(self.buffer)
        self.kernel.run(w_gate_up, w_down, local[self.topk_ids], slot_pool, target)
        if rows is not None:
            self.kernel.keep_rows(target, rows)

    def put(self, expert: int, rows: list[int], values: torch.Tensor) -> None:
        """Rows computed outside the passes (a CPU-split miss, cpu_split.py): values [n, H] are `expert`'s outputs
        for the flat (token * k + choice) positions `rows` (ascending: all of the step's rows routed to it).
        The weighted sum in result() then treats them as any pass's rows."""
        if self.path == "reference":
            start, count = self.segments[expert]
            assert count == len(rows), (expert, count, rows)
            self.buffer[start:start + count] = values.to(self.buffer.dtype)    # sorted order = ascending rows
            return
        self.kernel.put_rows(torch.tensor(rows, dtype=torch.int64, device=self.buffer.device), values)

    def _rows_of(self, experts: list[int]) -> torch.Tensor:
        member = torch.zeros(self.num_experts, dtype=torch.bool, device=self.topk_ids.device)
        member[experts] = True
        return member[self.topk_ids.reshape(-1)]                                       # [T*k]

    def _add_reference(self, w_gate_up, w_down, slot_of_expert, experts) -> None:
        tokens = self.order // self.top_k                                              # [T*k]
        inter = self.inter
        for expert, (start, count) in self.segments.items():
            if experts is not None and expert not in experts:
                continue
            slot = int(slot_of_expert[expert])
            segment = self.hidden.index_select(0, tokens[start:start + count])         # [n, H]
            if isinstance(w_gate_up, Fp8Weight):        # W8A16 as moe_experts_reference: fp32 matmuls
                gate_up = F.linear(segment.float(), w_gate_up[slot].dequantize())      # [n, 2I] fp32
                act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(self.hidden.dtype)
            else:
                gate_up = F.linear(segment, w_gate_up[slot])                           # [n, 2I]
                act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]                  # [n, I]
            if isinstance(w_down, Fp8Weight):
                self.buffer[start:start + count] = F.linear(act.float(), w_down[slot].dequantize()).to(
                    self.buffer.dtype)
            else:
                self.buffer[start:start + count] = F.linear(act, w_down[slot])         # [n, H]

    # -- the weighted sum, once ----------------------------------------------------------------------
    def result(self) -> torch.Tensor:
        """[T, H] in hidden's dtype: sum_j w[t, j] * expert_out[t, j], as the resident path sums it."""
        hidden = self.hidden
        num_tokens, hidden_size = hidden.shape
        if num_tokens == 0:
            return torch.empty_like(hidden)
        if self.path == "reference":
            tokens = self.order // self.top_k                                          # [T*k]
            weight = self.topk_weights.reshape(-1).float().index_select(0, self.order)  # [T*k]
            weighted = self.buffer.float() * weight.unsqueeze(-1)                      # [T*k, H] fp32
            out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
            out.index_add_(0, tokens, weighted)
            return out.to(hidden.dtype)
        return self.kernel.result(self.topk_weights)                                    # [T, H]
