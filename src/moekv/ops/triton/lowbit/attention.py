"""Attention over the low-bit paged KV cache (int4 / int3 / int2 codes + sparse fp16 outliers + fp
staging pages), the Triton twin of ops.reference.lowbit.paged_attention_lowbit.

Reads the packed pages directly; nothing dequantized is ever written. One program per (sequence,
block of new tokens, kv head, split of the context): its rows are BLOCK_Q new tokens x q_per_kv
query heads (decode: BLOCK_Q = 1, the GQA group padded to 16 rows for tl.dot), so each page's codes
are unpacked once for the whole group. Per page (BLOCK_N = page_size tokens):

  keys, channel axis: s = (q * S_key) . code + q . Z_key  -- the per-channel scale folds into q once
      per page, the zero point is one dot per row.
  values, token axis (one group): sum_t p_t v_t = (p_t S_t) . code + sum_t p_t Z_t  -- the per-token
      scale folds into the probabilities.
  other axes / groupings: scales applied after the dot, or (token groups) dequantized in registers.
  outliers: sparse corrections, BLOCK_C at a time, up to each page's count (lowbit.unpack).
  staged pages (staging_block_map[page, 0] >= 0; blocks of STAGE_BLOCK rows): read as full-precision rows.

16-bit queries: the low-bit dots run in fp16 whatever the model dtype, on normalised operands so
nothing overflows: q / max|q| of its row (once), times S / max S of the page (keys); p (<= 1) times
S_t / scale_base (values); the factors come back on the fp32 results. Codes become fp16 as
(code | 0x6400) read as fp16 (= 1024 + code) minus 1024, exact, instead of an int->float convert.
fp16 operands carry 3 more mantissa bits than bf16.

The step's new tokens (their keys/values are passed in full precision, not yet cached) are attended
by split 0, causally. With more than one split the partial results meet in split_k.combine_splits.
Decode steps with `meta.fixed_num_splits` (CUDA-graph decode) launch exactly that many splits and
each program derives its sequence's pages per split from the sequence's own context length
(DEVICE_SPLITS), reading no host length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.triton.common import LOG2E, check_launchable, dot_modes, mma, online_softmax_step, pow2
from moekv.ops.triton.lowbit.unpack import (UNPACK_FP16_CVT, UNPACK_FP16_MAGIC, UNPACK_FP32, code_operand,
                                            key_outlier_scores, token_scale_zero, unpack_codes, value_outlier_output)
from moekv.ops.triton.attention.split_k import combine_splits, plan_splits

# How keys / values of a page enter the dots (K_MODE, V_MODE):
FOLD_CHANNEL = 0    # per-channel scale/zero [D] per page: folded into q (keys) or applied after p.V (values)
FOLD_TOKEN = 1      # per-token scale/zero, one group per row: applied after q.k (keys) or folded into p (values)
DEQUANT_TOKEN = 2   # per-token groups (G > 1): dequantized in registers


@triton.jit
def _page_operand(codes_ptr, scale_ptr, zero_ptr, base_ptr, page_head, offs_n, n_valid, offs_d,
                  MODE: tl.constexpr, BITS: tl.constexpr, WORDS: tl.constexpr, GROUPS: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  UNPACK_MODE: tl.constexpr, GATHER: tl.constexpr):
    """Rows offs_n [BLOCK_N] of one page of one head as a [BLOCK_N, BLOCK_D] dot operand (codes,
    or for DEQUANT_TOKEN the dequantized values) and, token axis, per row S / scale_base, Z and scale_base."""
    ORDER: tl.constexpr = (HEAD_DIM == 128) * (PAGE_SIZE % 32 == 0) * (2 - (MODE == 0))   # code_order
    codes = unpack_codes(codes_ptr + page_head * (PAGE_SIZE * WORDS), offs_n, n_valid, BITS, WORDS, HEAD_DIM, BLOCK_N,
                         BLOCK_D, GATHER, ORDER)
    relative = offs_n.to(tl.float32)                                     # placeholders (channel axis)
    zero = relative
    base = 1.0
    if MODE == 0:
        operand = code_operand(codes, UNPACK_MODE)
    else:
        base = tl.load(base_ptr + page_head).to(tl.float32)
        token_rows = page_head * (PAGE_SIZE * GROUPS) + offs_n * GROUPS
        if MODE == 1:
            relative, _, zero = token_scale_zero(tl.load(scale_ptr + token_rows, mask=n_valid, other=0),
                                                 tl.load(zero_ptr + token_rows, mask=n_valid, other=0), base, BITS)
            operand = code_operand(codes, UNPACK_MODE)
        else:
            group_of = token_rows[:, None] + offs_d[None, :] // (HEAD_DIM // GROUPS)   # [N, BLOCK_D]
            mask = n_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
            _, group_scale, group_zero = token_scale_zero(tl.load(scale_ptr + group_of, mask=mask, other=0),
                                                          tl.load(zero_ptr + group_of, mask=mask, other=0), base,
                                                          BITS)
            operand = codes.to(tl.float32) * group_scale + group_zero
            if UNPACK_MODE != 0:
                operand = operand.to(tl.float16)
    return operand, relative, zero, base


@triton.jit
def _lowbit_attention_kernel(
    q_ptr, new_k_ptr, new_v_ptr, out_ptr, lse_ptr,
    k_codes, k_scale, k_zero, k_base, k_outlier_vals, k_outlier_idx, k_outlier_count,
    v_codes, v_scale, v_zero, v_base, v_outlier_vals, v_outlier_idx, v_outlier_count,
    staging_k, staging_v, block_map,
    block_tables, query_start_loc, context_lens,
    qk_scale, pages_per_split, num_splits,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_bt,
    NUM_KV_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_NEW: tl.constexpr,
    K_MODE: tl.constexpr, K_BITS: tl.constexpr, K_WORDS: tl.constexpr, K_GROUPS: tl.constexpr,
    K_CAP: tl.constexpr,
    V_MODE: tl.constexpr, V_BITS: tl.constexpr, V_WORDS: tl.constexpr, V_GROUPS: tl.constexpr,
    V_CAP: tl.constexpr,
    HALF: tl.constexpr, UPCAST: tl.constexpr, UNPACK_MODE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_C: tl.constexpr, SPLIT: tl.constexpr, GATHER: tl.constexpr, BLOCK_N: tl.constexpr,
    GATHER_P: tl.constexpr, DEVICE_SPLITS: tl.constexpr, STAGE_BLOCK: tl.constexpr, STAGE_NB: tl.constexpr,
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    q_start = tl.load(query_start_loc + seq)
    query_len = tl.load(query_start_loc + seq + 1) - q_start
    if q_block * BLOCK_Q >= query_len:
        return
    context_len = tl.load(context_lens + seq)
    half_dtype = q_ptr.dtype.element_ty
    if UNPACK_MODE == 0:
        low_dtype = tl.float32
    else:
        low_dtype = tl.float16

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    token = q_block * BLOCK_Q + offs_m // GROUP                          # [M] new-token index in the chunk
    head = kv_head * GROUP + offs_m % GROUP                              # [M] query head
    row_mask = (offs_m < BLOCK_Q * GROUP) & (token < query_len)
    d_mask = offs_d < HEAD_DIM
    q_rows = q_ptr + (q_start + token).to(tl.int64) * stride_qt + head * stride_qh   # [M] pointers
    q32 = tl.load(q_rows[:, None] + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :],
                  other=0.0).to(tl.float32) * qk_scale                   # [M, BLOCK_D]
    if HALF:
        q_op = q32.to(half_dtype)                                        # fp pages: as the fp kernel
    else:
        q_op = q32
    q_max = tl.max(tl.abs(q32), axis=1)
    q_max = tl.where(q_max > 0, q_max, 1.0)                              # [M]
    qn_op = (q32 / q_max[:, None]).to(low_dtype)                         # |qn| <= 1
    q_sum = tl.sum(q32, axis=1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables + seq.to(tl.int64) * stride_bt
    if DEVICE_SPLITS:                                                    # sized from this sequence's context
        pages_per_split = tl.cdiv(tl.cdiv(context_len, num_splits), PAGE_SIZE)
    SUBS: tl.constexpr = PAGE_SIZE // BLOCK_N                           # blocks of BLOCK_N tokens per page
    first_block = split * pages_per_split * SUBS
    last_block = tl.minimum(first_block + pages_per_split * SUBS, tl.cdiv(context_len, BLOCK_N))
    for block in range(first_block, last_block):
        page_index = block // SUBS
        page = tl.load(table + page_index).to(tl.int64)
        slot = tl.load(block_map + page * STAGE_NB)                      # the page's first staging block
        in_page = (block % SUBS) * BLOCK_N + offs_n                      # [N] token rows within the page
        n_valid = page_index * PAGE_SIZE + in_page < context_len
        kv_mask = n_valid[:, None] & d_mask[None, :]
        if STAGE_NB == 1:                                                # whole-page staging blocks
            staging_rows = (slot.to(tl.int64) * PAGE_SIZE + in_page) * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
        else:                                                            # each row's own block
            row_block = tl.load(block_map + page * STAGE_NB + in_page // STAGE_BLOCK, mask=n_valid, other=0)
            staging_rows = ((row_block.to(tl.int64) * STAGE_BLOCK + in_page % STAGE_BLOCK) * (NUM_KV_HEADS * HEAD_DIM)
                            + kv_head * HEAD_DIM)
        page_head = page * NUM_KV_HEADS + kv_head
        # ---- scores [M, N] ----
        if slot >= 0:
            k = tl.load(staging_k + staging_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            if HALF:
                k = k.to(half_dtype)
            s = mma(q_op, tl.trans(k), UPCAST)
        else:
            k_op, k_rel, k_z, k_b = _page_operand(k_codes, k_scale, k_zero, k_base, page_head, in_page, n_valid,
                                                  offs_d, K_MODE, K_BITS, K_WORDS, K_GROUPS, PAGE_SIZE, HEAD_DIM,
                                                  BLOCK_N, BLOCK_D, UNPACK_MODE, GATHER)
            if K_MODE == 0:
                k_scale_ch = tl.load(k_scale + page_head * HEAD_DIM + offs_d, mask=d_mask, other=0.0).to(tl.float32)
                k_zero_ch = tl.load(k_zero + page_head * HEAD_DIM + offs_d, mask=d_mask, other=0.0).to(tl.float32)
                s_max = tl.max(k_scale_ch, axis=0)
                s_max = tl.where(s_max > 0, s_max, 1.0)
                qs_op = (qn_op.to(tl.float32) * (k_scale_ch / s_max)[None, :]).to(low_dtype)
                s = mma(qs_op, tl.trans(k_op), UPCAST) * (q_max * s_max)[:, None] \
                    + tl.sum(q32 * k_zero_ch[None, :], axis=1)[:, None]
            elif K_MODE == 1:
                s = mma(qn_op, tl.trans(k_op), UPCAST) * (q_max[:, None] * (k_b * k_rel)[None, :]) \
                    + q_sum[:, None] * k_z[None, :]
            else:
                s = mma(qn_op, tl.trans(k_op), UPCAST) * q_max[:, None]
            if K_CAP > 0:
                s = key_outlier_scores(s, k_outlier_vals + page_head * K_CAP, k_outlier_idx + page_head * K_CAP,
                                       tl.load(k_outlier_count + page_head).to(tl.int32), q_rows, row_mask,
                                       qk_scale, in_page, HEAD_DIM, BLOCK_C, PRECISION)
        s = tl.where(n_valid[None, :], s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)                # p [M, N] in [0, 1]
        # ---- p . V [M, D] ----
        if slot >= 0:
            v = tl.load(staging_v + staging_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            if HALF:
                pv = mma(p.to(half_dtype), v.to(half_dtype), UPCAST)
            else:
                pv = mma(p, v, UPCAST)
        else:
            v_op, v_rel, v_z, v_b = _page_operand(v_codes, v_scale, v_zero, v_base, page_head, in_page, n_valid,
                                                  offs_d, V_MODE, V_BITS, V_WORDS, V_GROUPS, PAGE_SIZE, HEAD_DIM,
                                                  BLOCK_N, BLOCK_D, UNPACK_MODE, GATHER)
            if V_MODE == 1:
                ps_op = (p * v_rel[None, :]).to(low_dtype)               # p * S_t / scale_base <= 1
                pv = mma(ps_op, v_op, UPCAST) * v_b + tl.sum(p * v_z[None, :], axis=1)[:, None]
            else:
                p_op = p.to(low_dtype)
                pv = mma(p_op, v_op, UPCAST)
                if V_MODE == 0:
                    v_scale_ch = tl.load(v_scale + page_head * HEAD_DIM + offs_d, mask=d_mask, other=0.0).to(tl.float32)
                    v_zero_ch = tl.load(v_zero + page_head * HEAD_DIM + offs_d, mask=d_mask, other=0.0).to(tl.float32)
                    pv = pv * v_scale_ch[None, :] + tl.sum(p, axis=1)[:, None] * v_zero_ch[None, :]
            if V_CAP > 0:
                pv = value_outlier_output(pv, p, v_outlier_vals + page_head * V_CAP, v_outlier_idx + page_head * V_CAP,
                                          tl.load(v_outlier_count + page_head).to(tl.int32), in_page, offs_d,
                                          HEAD_DIM, BLOCK_C, PRECISION, GATHER_P)
        acc = acc * alpha[:, None] + pv

    # ---- the step's new tokens, full precision, causal (split 0 only) ----
    if split == 0:
        offs_j = tl.arange(0, BLOCK_NEW)
        new_end = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, query_len)     # tokens [0, new_end) are visible
        for j0 in range(0, new_end, BLOCK_NEW):
            j = j0 + offs_j
            j_valid = j < new_end
            j_mask = j_valid[:, None] & d_mask[None, :]
            k = tl.load(new_k_ptr + ((q_start + j).to(tl.int64) * stride_kt + kv_head * stride_kh)[:, None]
                        + offs_d[None, :], mask=j_mask, other=0.0)
            v = tl.load(new_v_ptr + ((q_start + j).to(tl.int64) * stride_vt + kv_head * stride_vh)[:, None]
                        + offs_d[None, :], mask=j_mask, other=0.0)
            if HALF:
                s = mma(q_op, tl.trans(k.to(half_dtype)), UPCAST)
            else:
                s = mma(q_op, tl.trans(k), UPCAST)
            s = tl.where(j_valid[None, :] & (j[None, :] <= token[:, None]), s, float("-inf"))
            p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
            if HALF:
                pv = mma(p.to(half_dtype), v.to(half_dtype), UPCAST)
            else:
                pv = mma(p, v, UPCAST)
            acc = acc * alpha[:, None] + pv

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    out_rows = (q_start + token).to(tl.int64)
    out_mask = row_mask[:, None] & d_mask[None, :]
    if SPLIT:
        tl.store(out_ptr + out_rows[:, None] * stride_ot + head[:, None] * stride_oh + split * stride_os
                 + offs_d[None, :], out, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + out_rows * stride_lt + head * stride_lh + split, lse, mask=row_mask)
    else:
        tl.store(out_ptr + out_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)


_MODES = {"channel": FOLD_CHANNEL, "token": FOLD_TOKEN}


def supports(key_spec, value_spec, query: torch.Tensor) -> bool:
    """Whether the kernel handles these page formats (else dispatch runs the reference)."""
    page_size = key_spec.page_size
    return (page_size == value_spec.page_size and page_size >= 16 and page_size & (page_size - 1) == 0
            and key_spec.head_dim == value_spec.head_dim == query.shape[-1] and page_size <= 256)


def _mode(spec) -> int:
    if spec.axis == "channel":
        return FOLD_CHANNEL
    return FOLD_TOKEN if spec.num_groups == 1 else DEQUANT_TOKEN


def _format_args(pages, spec, prefix: str) -> tuple[list[torch.Tensor], dict]:
    for name, tensor in pages.tensors().items():
        assert tensor.is_contiguous(), f"{prefix} {name} must be contiguous"
    base = pages.scale_base if pages.scale_base is not None else pages.scale
    tensors = [pages.codes, pages.scale, pages.zero, base, pages.outlier_vals, pages.outlier_idx,
               pages.outlier_count]
    consts = {f"{prefix}_MODE": _mode(spec), f"{prefix}_BITS": spec.bits, f"{prefix}_WORDS": spec.words_per_row,
              f"{prefix}_GROUPS": spec.num_groups if spec.axis == "token" else 1,
              f"{prefix}_CAP": spec.outlier_capacity}
    return tensors, consts


def unpack_mode(half: bool, unpack: str = "magic") -> int:
    """How codes become dot operands: fp16 (magic OR-and-subtract, or convert) for 16-bit queries, else fp32."""
    if not half:
        return UNPACK_FP32
    return UNPACK_FP16_CVT if unpack == "cvt" else UNPACK_FP16_MAGIC


def paged_attention_lowbit(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pages, value_pages,
                           key_spec, value_spec, staging_keys: torch.Tensor, staging_values: torch.Tensor,
                           staging_block_map: torch.Tensor, meta, scale: float, num_splits: int | None = None,
                           config: dict | None = None) -> torch.Tensor:
    """Same contract as ops.reference.lowbit.paged_attention_lowbit (query [T, Hq, D] -> [T, Hq, D]; staging
    [num_blocks, SB, Hkv, D] with staging_block_map [num_ids, P / SB], or [num_ids] when SB = P).

    `num_splits` None: chosen from the GPU size; `config` overrides launch parameters: num_warps,
    num_stages, BLOCK_M (prefill rows), BLOCK_N (tokens per step, <= page_size), BLOCK_C (outliers per
    step), unpack ("magic" | "cvt"), gather (bool), gather_p (value outliers pick p with tl.gather),
    waves (split planning).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    page_size = key_spec.page_size
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    batch = meta.num_seqs
    if num_tokens == 0 or batch == 0:
        return out
    check_launchable(_lowbit_attention_kernel, query)
    assert query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1
    assert staging_keys.is_contiguous() and staging_values.is_contiguous()
    block_map = staging_block_map if staging_block_map.dim() == 2 else staging_block_map[:, None]
    stage_block, stage_nb = staging_keys.shape[1], block_map.shape[1]
    if stage_block * stage_nb != page_size or not block_map.is_contiguous():
        raise ValueError(f"{stage_nb} staging blocks of {stage_block} rows per page do not make pages of {page_size} "
                         "(or the block map is not contiguous)")
    cfg = {"num_warps": 4, "num_stages": 1, "BLOCK_M": 64, "BLOCK_C": 16, "unpack": "magic", "gather": False,
           "BLOCK_N": page_size, "waves": 2, "gather_p": True}
    cfg.update(config or {})
    half, upcast = dot_modes(query, staging_keys.dtype)
    device_splits = meta.is_decode and meta.fixed_num_splits is not None
    if meta.is_decode:
        block_m, block_q = pow2(group), 1
    else:
        block_m = max(cfg["BLOCK_M"], pow2(group))
        block_q = block_m // group
    if device_splits:        # graph-capturable: no host length is read; splits sized in the kernel
        batch, q_blocks = meta.context_lens.shape[0], 1
        num_splits, tokens_per_split = int(meta.fixed_num_splits), 0
    else:
        q_blocks = triton.cdiv(max(meta.max_query_len, 1), block_q)
        max_context = max(meta.context_lens_host, default=0)
        if num_splits is None:
            num_splits, tokens_per_split = plan_splits(batch * q_blocks, num_kv_heads, max_context, page_size,
                                                       query.device, waves=cfg["waves"])
        else:
            tokens_per_split = triton.cdiv(triton.cdiv(max(max_context, 1), num_splits), page_size) * page_size
    key_tensors, key_consts = _format_args(key_pages, key_spec, "K")
    value_tensors, value_consts = _format_args(value_pages, value_spec, "V")
    if num_splits > 1:
        partial = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
        lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device)
        target, out_strides = partial, (partial.stride(0), partial.stride(1), partial.stride(2),
                                        lse.stride(0), lse.stride(1))
    else:
        lse, target, out_strides = out, out, (out.stride(0), out.stride(1), 0, 0, 0)
    grid = (batch, q_blocks, num_kv_heads * num_splits)
    _lowbit_attention_kernel[grid](
        query, key, value, target, lse, *key_tensors, *value_tensors,
        staging_keys, staging_values, block_map,
        meta.block_tables, meta.query_start_loc, meta.context_lens,
        scale * LOG2E, tokens_per_split // page_size, num_splits,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *out_strides, meta.block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_D=pow2(head_dim, 32),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_NEW=16, **key_consts, **value_consts,
        HALF=half, UPCAST=upcast, UNPACK_MODE=unpack_mode(half, cfg["unpack"]),
        PRECISION="tf32x3" if query.is_cuda else "ieee", BLOCK_C=cfg["BLOCK_C"], SPLIT=num_splits > 1,
        GATHER=cfg["gather"], BLOCK_N=min(cfg["BLOCK_N"], page_size),
        GATHER_P=cfg["gather_p"],
        DEVICE_SPLITS=device_splits, STAGE_BLOCK=stage_block, STAGE_NB=stage_nb, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    if num_splits > 1:
        combine_splits(partial, lse, out)
    return out
