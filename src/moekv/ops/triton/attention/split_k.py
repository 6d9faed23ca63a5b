"""Split-K (flash-decoding) helpers shared by the decode kernels: how many splits to launch, and the
numerically stable combine of per-split partial results.

Each split of a sequence's context writes, per query head, its softmax-normalised partial output
o_s [D] (fp32) and its log-sum-exp in base 2, lse_s = m_s + log2(l_s) (-inf for an empty split).
The combine computes out = sum_s 2**(lse_s - M) o_s / sum_s 2**(lse_s - M) with M = max_s lse_s,
so no exponent ever exceeds 1 and empty splits weigh exactly 0.

Two ways to run the combine (KernelConfig.fused_attention_combine picks, ops.dispatch passes it down):
`combine_splits`, a second launch over the partials, or `combine_if_last`, called at the end of the decode
kernel itself: every program of a (sequence, kv head) counts its arrival on a per-(sequence, kv head) int32
counter and the last one to arrive combines all the splits (one launch per layer fewer). The counters live in
`arrival_counters`, allocated once per device and zero between launches (the last program resets its own), so
a captured CUDA graph replays with the same buffer and finds it zero every time.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moekv.ops.triton import pdl


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H100/H200); 4 off-GPU (interpreter)."""
    if device_index < 0:
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def plan_splits(batch: int, num_kv_heads: int, max_seq_len: int, block_n: int, device: torch.device,
                min_tokens_per_split: int = 256, waves: int = 2, max_splits: int = 128) -> tuple[int, int]:
    """(num_splits, tokens_per_split) so that batch * kv_heads * splits fills the GPU about `waves` times.

    tokens_per_split is a multiple of block_n; a split never gets fewer than min_tokens_per_split
    tokens (below that the combine costs more than the parallelism buys). Among split counts from
    the smallest that gives `waves` waves to twice that, the one whose last wave is fullest wins.
    Host-side only: uses the host max_seq_len, never a device value.
    """
    sms = num_sms(device.index if device.type == "cuda" and device.index is not None
                  else (torch.cuda.current_device() if device.type == "cuda" else -1))
    programs = max(batch * num_kv_heads, 1)
    length = max(max_seq_len, 1)
    by_length = max(1, length // max(min_tokens_per_split, block_n))
    want = max(1, min(-(-waves * sms // programs), by_length, max_splits))
    best, best_fill = None, -1.0
    for splits in range(want, min(2 * want, by_length, max_splits) + 1):
        tokens_per_split = -(-(-(-length // splits)) // block_n) * block_n       # round up to whole blocks
        splits = -(-length // tokens_per_split)                                  # drop splits left empty
        total = programs * splits
        fill = total / (-(-total // sms) * sms)                                  # share of the last wave used
        if fill > best_fill + 0.02:
            best, best_fill = (splits, tokens_per_split), fill
    return best


@triton.jit
def _combine_kernel(
    partial_ptr,            # [B, Hq, S, D] fp32 normalised partial outputs
    lse_ptr,                # [B, Hq, S] fp32 base-2 log-sum-exp (-inf: empty split)
    out_ptr,                # [B, Hq, D] output (query dtype)
    num_splits,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl.enter(USE_PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    lse = tl.load(lse_ptr + seq * stride_lb + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    weight = tl.exp2(lse - lse_max)                                      # [BLOCK_S], 0 for empty splits
    weight = tl.where(s_mask, weight, 0.0)
    partial = tl.load(partial_ptr + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps
                      + offs_d[None, :], mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(partial * weight[:, None], axis=0) / tl.sum(weight, axis=0)   # [BLOCK_D]
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def combine_splits(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """partial [B, Hq, S, D] fp32, lse [B, Hq, S] fp32 -> writes and returns out [B, Hq, D]."""
    batch, num_heads, num_splits, head_dim = partial.shape
    _combine_kernel[(batch, num_heads)](
        partial, lse, out, num_splits,
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_S=max(triton.next_power_of_2(num_splits), 2), num_warps=4, **pdl.launch_kwargs(out))
    return out


def combine_splits_torch(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The same combine in torch ops (the twin of combine_splits; used by tests), fp32."""
    lse_max = lse.max(dim=-1, keepdim=True).values                       # [B, Hq, 1]
    weight = torch.exp2(lse - lse_max)                                   # [B, Hq, S]
    return (partial * weight.unsqueeze(-1)).sum(2) / weight.sum(-1, keepdim=True)


# -- the in-kernel combine ---------------------------------------------------------------------------
# Memory ordering (the GPU runs the splits of a (sequence, kv head) on different SMs at the same time):
#   1. every thread of a program stores its share of the partial output and log-sum-exp (plain st.global);
#   2. tl.debug_barrier() (bar.sync): all of the CTA's stores precede, in the PTX memory model's causality
#      order, whatever its threads do after the barrier. A scalar atomic is issued by one elected thread, so
#      without a barrier another warp's stores could still be in flight when the count is bumped. Triton 3.9
#      emits a bar.sync before a scalar release atomic by itself (checked in the sm_90 PTX of this kernel:
#      bar.sync; @elected atom.global.gpu.acq_rel.add.u32; st.shared; bar.sync; ld.shared); older versions did
#      not, so the explicit one stays;
#   3. tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu"): its release half publishes the CTA's stores of
#      step 1 to every program that later acquires the counter at gpu scope; its acquire half makes the stores
#      published by all the programs that arrived before visible to the one that reads count == num_splits - 1
#      (atomic_add returns the count before the add);
#   4. tl.debug_barrier() again: the other threads of the last program read the partials only after the elected
#      thread's acquire (the result also comes back through shared memory behind a barrier; the explicit one
#      keeps the order independent of that lowering detail);
#   5. the last program reads every split's partial and lse with cache_modifier=".cg" (L2, never a stale L1
#      line) and combines them in split order, whichever split arrived last: the result does not depend on the
#      arrival order, so repeated calls are bit-identical;
#   6. it stores 0 to the counter: every program of this launch has arrived already, and the next launch (or
#      graph replay) is ordered after this one by the stream.
# This is a grid barrier's pattern (bar.sync, one thread's gpu-scope acq_rel atomic, bar.sync) without the
# wait: nobody spins, the last arrival does the work, so any split count and any occupancy is deadlock-free.
# Two launches must not use one counter buffer at the same time (one stream per device here: layers run one
# after another).
COMBINE_TILE = 4096          # fp32 partial values of one head the combining program loads per round trip: 32 per
                             # thread at 4 warps, so the decode kernel keeps its register count (sm_90: 94 with
                             # or without the combine at D=128, group 4; a [group, splits, D] tile of 8192 took 164)


def combine_chunk(head_dim: int, num_splits: int) -> int:
    """Splits per round trip of combine_if_last (BLOCK_SC): a [BLOCK_SC, pow2(head_dim)] tile of at most
    COMBINE_TILE values, no more than the splits there are (a power of two, at least 2)."""
    per_tile = max(COMBINE_TILE // triton.next_power_of_2(head_dim), 2)
    return max(2, min(triton.next_power_of_2(num_splits), per_tile))


@triton.jit
def combine_if_last(counter_ptr, partial_ptr, lse_ptr, out_ptr, first_head, num_splits,
                    stride_ph, stride_ps, stride_lh, stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_SC: tl.constexpr):
    """Count this program's arrival at counter_ptr (its (sequence, kv head)'s); the last of num_splits combines
    the GROUP query heads from first_head on.

    partial_ptr [Hq, S, D] fp32, lse_ptr [Hq, S] fp32 (split stride 1) and out_ptr [Hq, D] point at this
    sequence's rows. This program's own partial and lse must be stored before the call. Head by head, the combine
    walks the splits BLOCK_SC at a time with a running maximum (one chunk: exactly combine_splits' arithmetic)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    if arrived == num_splits - 1:
        offs_s = tl.arange(0, BLOCK_SC)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        for g in tl.static_range(GROUP):
            head = first_head + g
            m_i = float("-inf")
            l_i = 0.0
            acc = tl.zeros([BLOCK_D], tl.float32)
            for s0 in range(0, num_splits, BLOCK_SC):
                splits = s0 + offs_s                                                  # [SC]
                s_mask = splits < num_splits
                lse = tl.load(lse_ptr + head * stride_lh + splits, mask=s_mask, other=float("-inf"),
                              cache_modifier=".cg")                                   # [SC]
                part = tl.load(partial_ptr + head * stride_ph + splits[:, None] * stride_ps + offs_d[None, :],
                               mask=s_mask[:, None] & d_mask[None, :], other=0.0, cache_modifier=".cg")  # [SC, D]
                m_new = tl.maximum(m_i, tl.max(lse, axis=0))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_use)                                          # 0 on the first chunk
                weight = tl.exp2(lse - m_use)                                         # 0 for an empty split
                acc = acc * alpha + tl.sum(part * weight[:, None], axis=0)
                l_i = l_i * alpha + tl.sum(weight, axis=0)
                m_i = m_new
            out = acc / tl.where(l_i > 0, l_i, 1.0)
            tl.store(out_ptr + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)
        tl.store(counter_ptr, 0)


MIN_COUNTERS = 1 << 14           # 64 KB: every (sequence, kv head) of 2048 sequences x 8 kv heads
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []    # outgrown buffers stay allocated: a graph captured with one keeps its address


def arrival_counters(device: torch.device, needed: int) -> torch.Tensor:
    """The in-kernel combine's int32 arrival counters on `device`, at least `needed` of them, all zero.

    Allocated once per device (and grown, never shrunk, outside a CUDA-graph capture); each launch leaves
    them zero. Growing inside a capture is an error: the zeroing would be recorded into the graph and the
    buffer would change under graphs captured before (KVCache.reserve_graph_decode reserves first)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"attention split counters: {needed} needed while a CUDA graph is captured, "
                               f"{0 if counters is None else counters.numel()} reserved; call "
                               "split_k.arrival_counters(device, batch * kv_heads) before capturing")
        if counters is not None:
            _RETIRED.append(counters)
        with torch.inference_mode(False):        # a plain tensor even when first asked for in an inference step
            counters = torch.zeros(max(needed, MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters
