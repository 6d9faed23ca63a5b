// Torch binding of the v7 low-bit decode kernel (built at first use by ops/cuda/lowbit_decode.py).
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include "lowbit_decode.cuh"

using namespace moekv_v7;

template <int B, int STACK, int W, bool CS>
void launch_bits(const Params& p, int batch, bool bf16, cudaStream_t stream);   // lowbit_decode_b<B>[s][w8|c].cu

int64_t smem_bytes(int64_t bits, int64_t k_cap, int64_t v_cap, int64_t warps) {
  if (warps == 8) {
    if (bits == 4) return smem_plan<4, 8>(k_cap, v_cap).total;
    if (bits == 3) return smem_plan<3, 8>(k_cap, v_cap).total;
    return smem_plan<2, 8>(k_cap, v_cap).total;
  }
  if (bits == 4) return smem_plan<4>(k_cap, v_cap).total;
  if (bits == 3) return smem_plan<3>(k_cap, v_cap).total;
  return smem_plan<2>(k_cap, v_cap).total;
}

template <int W>
static void launch_width(const Params& p, int64_t bits, int batch, bool bf16, cudaStream_t stream) {
  // GQA groups of at most 4: scores of both token tiles in one (STACK 2), every width (session 25: int2 stacked with
  // its value outliers as corrections, which need stacking, -2% at B=32, -3.4% at B=128; attention-ab-s25-stack.md)
  const bool stack = p.group <= NH / 2;
  if (bits == 4) { if (stack) launch_bits<4, 2, W, false>(p, batch, bf16, stream); else launch_bits<4, 1, W, false>(p, batch, bf16, stream); }
  else if (bits == 3) { if (stack) launch_bits<3, 2, W, false>(p, batch, bf16, stream); else launch_bits<3, 1, W, false>(p, batch, bf16, stream); }
  else if (bits == 2) { if (stack) launch_bits<2, 2, W, false>(p, batch, bf16, stream); else launch_bits<2, 1, W, false>(p, batch, bf16, stream); }
  else TORCH_CHECK(false, "lowbit decode v7: bits must be 2, 3 or 4, got ", bits);
}

// chunk-split CTAs of 4 warps (small batches): stacked scores only (GQA groups of at most 4)
static void launch_chunk_split(const Params& p, int64_t bits, int batch, bool bf16, cudaStream_t stream) {
  TORCH_CHECK(p.group <= NH / 2, "lowbit decode v7: chunk-split CTAs take GQA groups of at most 4, got ", p.group);
  if (bits == 4) launch_bits<4, 2, 4, true>(p, batch, bf16, stream);
  else if (bits == 3) launch_bits<3, 2, 4, true>(p, batch, bf16, stream);
  else if (bits == 2) launch_bits<2, 2, 4, true>(p, batch, bf16, stream);
  else TORCH_CHECK(false, "lowbit decode v7: bits must be 2, 3 or 4, got ", bits);
}

// The page's small arrays as uniform 16-byte pieces (Params::m_*): for each array its base, bytes, bytes per
// page-head (per page for the slots) and its offset in a meta stage; then the list of (array, piece) per page.
static void meta_pieces(Params& p, std::initializer_list<const torch::Tensor*> arrays) {
  using L = Layout<3>;                      // the meta stage's layout is the same for every width
  const int ocK = outlier_chunk_bytes(p.k_cap), ocV = outlier_chunk_bytes(p.v_cap);
  const int nk = ocK / 16, nv = ocV / 16;
  const int dst[MARRAYS] = {L::K_SCALE, L::K_ZERO, L::V_SCALE, L::V_ZERO, L::V_BASE, L::K_COUNT, L::V_COUNT, L::SLOT,
                            L::FIXED, L::FIXED + nk * 16, L::FIXED + 2 * ocK, L::FIXED + 2 * ocK + nv * 16};
  const int stride[MARRAYS] = {2 * D, 2 * D, P, P, 2, 2, 2, 4 * p.stage_nb, 2 * p.k_cap, 2 * p.k_cap, 2 * p.v_cap,
                               2 * p.v_cap};
  const int pieces[MARRAYS] = {16, 16, 8, 8, 1, 1, 1, 1, p.k_cap > 0 ? nk : 0, p.k_cap > 0 ? nk : 0,
                               p.v_cap > 0 ? nv : 0, p.v_cap > 0 ? nv : 0};
  int a = 0, q = 0;
  for (const torch::Tensor* t : arrays) {
    p.m_base[a] = reinterpret_cast<const uint8_t*>(t->data_ptr());
    p.m_total[a] = t->numel() * t->element_size();
    p.m_stride[a] = stride[a];
    p.m_dst[a] = dst[a];
    for (int k = 0; k < pieces[a]; ++k) {
      if (q < FIXED_PIECES) p.m_piece[q] = static_cast<uint16_t>((a << 8) | k);
      ++q;
    }
    ++a;
  }
  p.m_nk = p.k_cap > 0 ? nk : 0;
  p.m_nv = p.v_cap > 0 ? nv : 0;
  p.m_pieces = q;
}

void decode(torch::Tensor q, torch::Tensor new_k, torch::Tensor new_v, torch::Tensor out,
            torch::Tensor partial, torch::Tensor lse, torch::Tensor counters,
            torch::Tensor k_codes, torch::Tensor k_scale, torch::Tensor k_zero,
            torch::Tensor k_ovals, torch::Tensor k_oidx, torch::Tensor k_ocount,
            torch::Tensor v_codes, torch::Tensor v_scale, torch::Tensor v_zero, torch::Tensor v_base,
            torch::Tensor v_ovals, torch::Tensor v_oidx, torch::Tensor v_ocount,
            torch::Tensor staging_k, torch::Tensor staging_v, torch::Tensor block_map,
            torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor context_lens,
            double qk_scale, int64_t group, int64_t num_splits, int64_t pages_per_split,
            int64_t bits, int64_t warps, bool chunk_split, int64_t work_tail, bool pdl) {
  const c10::cuda::CUDAGuard guard(q.device());
  TORCH_CHECK(q.size(-1) == D && k_codes.size(2) == P, "lowbit decode v7: head_dim and page size must be 128");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && context_lens.dtype() == torch::kInt32 &&
              query_start_loc.dtype() == torch::kInt32 && block_map.dtype() == torch::kInt32,
              "lowbit decode v7: metadata must be int32");
  for (const torch::Tensor* t : {&k_codes, &k_scale, &k_zero, &v_codes, &v_scale, &v_zero, &k_oidx, &k_ovals, &v_oidx,
                                 &v_ovals}) {
    TORCH_CHECK(t->is_contiguous() && reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                "lowbit decode v7: page tensors must be contiguous and 16-byte aligned (16-byte copies)");
  }
  Params p{};
  p.q = q.data_ptr(); p.new_k = new_k.data_ptr(); p.new_v = new_v.data_ptr(); p.out = out.data_ptr();
  p.partial = partial.data_ptr<float>(); p.lse = lse.data_ptr<float>(); p.counters = counters.data_ptr<int>();
  p.k_codes = k_codes.data_ptr<int>();
  p.k_scale = reinterpret_cast<const __half*>(k_scale.data_ptr());
  p.k_zero = reinterpret_cast<const __half*>(k_zero.data_ptr());
  p.k_ovals = reinterpret_cast<const __half*>(k_ovals.data_ptr());
  p.k_oidx = reinterpret_cast<const int16_t*>(k_oidx.data_ptr());
  p.k_ocount = reinterpret_cast<const int16_t*>(k_ocount.data_ptr());
  p.v_codes = v_codes.data_ptr<int>();
  p.v_scale = v_scale.data_ptr<uint8_t>(); p.v_zero = v_zero.data_ptr<uint8_t>();
  p.v_base = reinterpret_cast<const __half*>(v_base.data_ptr());
  p.v_ovals = reinterpret_cast<const __half*>(v_ovals.data_ptr());
  p.v_oidx = reinterpret_cast<const int16_t*>(v_oidx.data_ptr());
  p.v_ocount = reinterpret_cast<const int16_t*>(v_ocount.data_ptr());
  p.staging_k = staging_k.data_ptr(); p.staging_v = staging_v.data_ptr();
  p.block_map = block_map.data_ptr<int>();
  // staging in blocks of P / stage_nb rows: staging_k [blocks, rows, Hkv, D], block_map [ids, stage_nb] (or [ids])
  p.stage_nb = block_map.dim() == 2 ? static_cast<int>(block_map.size(1)) : 1;
  const int64_t block_rows = staging_k.size(-3);
  TORCH_CHECK(block_map.is_contiguous() && (p.stage_nb == 1 || p.stage_nb == 2 || p.stage_nb == 4) &&
              block_rows * p.stage_nb == P, "lowbit decode v7: staging blocks of 32, 64 or 128 rows per page of ", P);
  p.stage_shift = block_rows == 128 ? 7 : block_rows == 64 ? 6 : 5;
  p.stage_mask = static_cast<int>(block_rows) - 1;
  p.slot_stride = 4 * p.stage_nb;
  p.last_lowbit_page = static_cast<int>(k_codes.size(0)) - 1;
  p.block_tables = block_tables.data_ptr<int>(); p.query_start_loc = query_start_loc.data_ptr<int>();
  p.context_lens = context_lens.data_ptr<int>();
  p.qk_scale = static_cast<float>(qk_scale);
  p.num_kv_heads = static_cast<int>(k_codes.size(1));
  p.group = static_cast<int>(group);
  TORCH_CHECK(num_splits >= 1 && num_splits <= MAX_SPLITS, "lowbit decode v7: 1 to ", MAX_SPLITS,
              " splits, got ", num_splits);
  p.num_splits = static_cast<int>(num_splits);
  p.pages_per_split = static_cast<int>(pages_per_split);
  TORCH_CHECK(work_tail >= 0 && work_tail <= 4 * TABLE_MAX && (work_tail == 0 || chunk_split),
              "lowbit decode v7: the work split (tail units 1 to ", 4 * TABLE_MAX, ") takes chunk-split CTAs, got ",
              work_tail);
  p.work_tail = static_cast<int>(work_tail);
  p.k_cap = static_cast<int>(k_ovals.size(-1));
  p.v_cap = static_cast<int>(v_ovals.size(-1));
  meta_pieces(p, {&k_scale, &k_zero, &v_scale, &v_zero, &v_base, &k_ocount, &v_ocount, &block_map, &k_oidx, &k_ovals,
                  &v_oidx, &v_ovals});
  p.stride_qt = q.stride(0); p.stride_qh = q.stride(1);
  p.stride_kt = new_k.stride(0); p.stride_kh = new_k.stride(1);
  p.stride_vt = new_v.stride(0); p.stride_vh = new_v.stride(1);
  p.stride_ot = out.stride(0); p.stride_oh = out.stride(1);
  p.stride_bt = block_tables.stride(0);
  p.pdl = pdl ? 1 : 0;
  const int batch = static_cast<int>(context_lens.size(0));
  if (batch == 0) return;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 || q.scalar_type() == torch::kHalf,
              "lowbit decode v7: query must be fp16 or bf16");
  const bool bf16 = q.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(warps == 4 || warps == 8, "lowbit decode v7: warps per CTA must be 4 or 8, got ", warps);
  TORCH_CHECK(!chunk_split || warps == 4, "lowbit decode v7: chunk-split CTAs have 4 warps");
  if (chunk_split) launch_chunk_split(p, bits, batch, bf16, stream);
  else if (warps == 8) launch_width<8>(p, bits, batch, bf16, stream);
  else launch_width<4>(p, bits, batch, bf16, stream);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &decode, "low-bit paged decode attention (v7)");
  m.def("smem_bytes", &smem_bytes, "dynamic shared memory of one CTA");
}
