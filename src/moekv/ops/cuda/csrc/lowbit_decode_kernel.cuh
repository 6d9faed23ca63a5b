// The decode kernel (v9; see lowbit_decode.cuh for the design). Every warp streams its own pages of the CTA's
// split; the CTA only meets before the page loop (query tables) and after it (merge, staged pages, combine).
#pragma once
#include "lowbit_decode_merge.cuh"
#include "lowbit_decode_page.cuh"
#include "lowbit_decode_staged.cuh"

namespace moekv_v7 {

// MOEKV_TRACE (diagnostic builds only, e.g. an A/B folder built with -DMOEKV_TRACE; the library never defines it):
// per CTA 32 u64 after the split-K lse buffer, which the caller then allocates for every launch: slots 0..15
// %globaltimer, 16..31 clock64 at 0 entry, 1 query loaded, 2 tables built, 3 the SM id, 4 + w warp w done with its
// pages, 12 all warps done, 13 staged pages done, 14 warps combined, 15 exit (the last split after its combine).
#ifdef MOEKV_TRACE
__device__ __forceinline__ void trace_at(const Params& p, int slot) {
  const int ctas = gridDim.x * gridDim.y * gridDim.z;
  const int cta = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  unsigned long long* t = reinterpret_cast<unsigned long long*>(p.lse + ((ctas * NH + 1) & ~1)) + 32 * cta;
  unsigned long long g, c = clock64();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
  unsigned int sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  t[slot] = g; t[16 + slot] = c;
  if (slot == 0) t[3] = sm;
}
#define MOEKV_TRACE_CTA(slot) do { if (threadIdx.x == 0) trace_at(p, slot); } while (0)
#define MOEKV_TRACE_WARP(slot) do { if ((threadIdx.x & 31) == 0) trace_at(p, slot); } while (0)
#else
#define MOEKV_TRACE_CTA(slot) do {} while (0)
#define MOEKV_TRACE_WARP(slot) do {} while (0)
#endif

// MINB: resident CTAs per SM the registers are capped for (4: <= 128 registers; int4's larger rings fit 3).
// STACK: 2 for GQA groups of at most 4 (columns 4..7 repeat heads 0..3, lowbit_decode_page.cuh), else 1.
// W: warps per CTA (4; 8 for small batches: one page per warp at one CTA per SM). The query tables, the staged
// pages and the combines run on the first QWARPS warps' 128 threads (thread = token or channel).
template <int B, typename QT, int MINB, int STACK, int W, bool CS>
__global__ void __launch_bounds__(32 * W, MINB) decode_kernel(const Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  using L = Layout<B>;
  MOEKV_TRACE_CTA(0);
  // programmatic dependent launch (Params::pdl): wait for the grid before this one -- its completion and its memory
  // -- before any global access, then let the next kernel be scheduled (a no-op for an ordinary launch)
  if (p.pdl) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
  const SmemPlan plan = smem_plan<B, W>(p.k_cap, p.v_cap);
  const int ocK = outlier_chunk_bytes(p.k_cap), ocV = outlier_chunk_bytes(p.v_cap);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
  const int split = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z;
  const int G = p.group;
  const long long q_row = p.query_start_loc[seq];
  const int ctx = p.context_lens[seq];
  const int num_pages = (ctx + P - 1) / P;
  const SplitRange sr = split_range<CS>(p, ctx, split);
  const int first = sr.first, n = sr.n;

  int* table = reinterpret_cast<int*>(smem + plan.table);
  __half* qn_tab = reinterpret_cast<__half*>(smem + plan.qn);      // natural order (smem_plan: where it lives)
  float* qmax_tab = reinterpret_cast<float*>(smem + plan.qmax);
  const int* bt = p.block_tables + (long long)seq * p.stride_bt;
  for (int i = tid; i < n; i += 32 * W) table[i] = bt[first + i];
  int* ptab = reinterpret_cast<int*>(smem + plan.ptab);
  for (int q = tid; q < min(p.m_pieces, PTAB); q += 32 * W) ptab[q] = piece_entry(p, q);

  // ---- query: heads kvh * G + h, normalised per head (|qn| <= 1); thread: head tid / 16, channels 8 (tid % 16) + 0..7
  const int qh = tid >> 4, qd = (tid & 15) * 8;
  if (W == QWARPS || warp < QWARPS) load_query<QT>(p, q_row, kvh, G, qh, qd, qn_tab, qmax_tab, true);
  __syncthreads();
  MOEKV_TRACE_CTA(1);
  // query pair tables in B-fragment order: lane fl (head fl / 4, key block fl % 4), registers 4 jb .. 4 jb + 3
  if (W == QWARPS || warp < QWARPS) {
    const int fl = lane, jb = warp;
    uint32_t qf[4], qp[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int j = 4 * jb + r, o = key_off<B>(j);
      const int lo = 32 * (fl & 3) + key_lo<B>(j), hi = lo + key_gap<B>();
      const float unit = __int_as_float((127 - o) << 23);               // 2^-o
      const int head = STACK == 2 ? (fl >> 2) & 3 : fl >> 2;         // the B operand's column fl / 4
      const __half a = qn_tab[head * D + lo], b = qn_tab[head * D + hi];
      qf[r] = pack_half2(__half2float(a) * unit, __half2float(b) * unit);
      const __half2 pr = __halves2half2(a, b);
      qp[r] = *reinterpret_cast<const uint32_t*>(&pr);
    }
    *reinterpret_cast<uint4*>(smem + plan.qf + (jb * 32 + fl) * 16) = make_uint4(qf[0], qf[1], qf[2], qf[3]);
    *reinterpret_cast<uint4*>(smem + plan.qp + (jb * 32 + fl) * 16) = make_uint4(qp[0], qp[1], qp[2], qp[3]);
  }
  const int h0 = STACK == 2 ? (2 * c) & 3 : 2 * c;                 // the heads of this lane's score columns
  const float qms0 = qmax_tab[h0] * p.qk_scale, qms1 = qmax_tab[h0 + 1] * p.qk_scale;   // score scale
  StagedTile pre;                  // 8-warp CTAs: the tail page's tile `warp`, loaded now, folded after the loop
  const int pre_index = preload_tail<QT, W>(p, table, first, n, num_pages, ctx, kvh, pre);
  __syncthreads();                 // tables complete; the warps' rings now overwrite the natural-order query
  MOEKV_TRACE_CTA(2);

  // ---- the warp's pages: w, w + WARPS, ... of the split
  uint8_t* wb = smem + warp * plan.warp_bytes;
  int* wstaged = reinterpret_cast<int*>(wb + plan.staged);
  if (lane == 0) wstaged[0] = 0;
  if (p.k_cap > 0 || p.v_cap > 0) {        // one-hot tile starts (and stays) zero
    uint4* w = reinterpret_cast<uint4*>(wb + plan.scratch + W_ONEHOT);
    for (int i = lane; i < W_BYTES / 16; i += 32) w[i] = make_uint4(0, 0, 0, 0);   // and the probabilities
  }
  WarpState st;
  st.init();
  const WarpRange wr = warp_range<W, CS>(sr, warp);
  warp_pages<B, STACK, W, CS>(p, plan, wb, table, ptab, smem + plan.qf, smem + plan.qp, first, ctx, kvh, warp, lane, wr, ocK, ocV,
                qms0, qms1, st);
  MOEKV_TRACE_WARP(4 + warp);
  cp_wait<0>();
  __syncthreads();
  MOEKV_TRACE_CTA(12);

  // ---- merge: per-warp states to shared memory (the rings are free now)
  float* mo = reinterpret_cast<float*>(smem);                       // [W][NH][D] un-normalised outputs
  float* ml = mo + W * NH * D;                                      // [W][NH] max, [W][NH] sum
  float* snew = ml + 2 * W * NH;                                    // [NH] the new token's scores
  int* staged_list = reinterpret_cast<int*>(smem + plan.stlist);
  if (tid == 0) {                          // the warps' staged pages, in page order (insertion sort: a few)
    int k = 0;
    for (int w = 0; w < W; ++w) {
      const int* ws = reinterpret_cast<const int*>(smem + w * plan.warp_bytes + plan.staged);
      const int cnt = min(ws[0], STAGED_MAX);
      for (int e = 0; e < cnt; ++e) {
        const int v = ws[1 + e];
        int at = k++;
        while (at > 0 && staged_list[at] > v) { staged_list[1 + at] = staged_list[at]; --at; }
        staged_list[1 + at] = v;
      }
    }
    staged_list[0] = min(k, STAGED_MAX);
  }
  __syncthreads();                         // staged lists read before the merge overwrites the warps' areas
  if (!keeps_query<W>()) load_query<QT>(p, q_row, kvh, G, qh, qd, qn_tab, qmax_tab, false);
  float l0 = st.l0, l1 = st.l1, z0 = st.z0, z1 = st.z1;
#pragma unroll
  for (int o = STACK == 2 ? 2 : 4; o < 32; o <<= 1) {      // STACK 2: lanes c and c ^ 2 hold the same heads
    l0 += __shfl_xor_sync(0xffffffffu, l0, o); l1 += __shfl_xor_sync(0xffffffffu, l1, o);
    z0 += __shfl_xor_sync(0xffffffffu, z0, o); z1 += __shfl_xor_sync(0xffffffffu, z1, o);
  }
  if (g == 0) {
    ml[warp * NH + 2 * c] = st.m0; ml[warp * NH + 2 * c + 1] = st.m1;
    ml[(W + warp) * NH + 2 * c] = l0; ml[(W + warp) * NH + 2 * c + 1] = l1;
  }
#pragma unroll
  for (int i2 = 0; i2 < 8; ++i2)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int vj = 2 * i2 + (e >> 1), ch = 16 * g + vj, h = 2 * c + (e & 1);
      const float unit = __int_as_float((127 + 24 - value_off<B>(vj)) << 23);    // 2^(24 - off)
      mo[(warp * NH + h) * D + ch] = fmaf(st.acc[i2][e], unit, (e & 1) ? z1 : z0);
    }
  // ---- staged pages (full precision, tensor cores): every warp folds 16-token tiles into its own merge state
  const int num_staged = staged_list[0];
  __syncthreads();                         // the query table and every warp's merge state are complete
  staged_pages_tc<QT, W>(p, table, staged_list + 1, num_staged, first, ctx, kvh, G, qn_tab, qmax_tab, mo, ml, pre_index,
                         pre);
  __syncthreads();
  MOEKV_TRACE_CTA(13);
  combine_warps<QT, W>(p, mo, ml, qn_tab, qmax_tab, q_row, kvh, G, seq, split, snew);
  MOEKV_TRACE_CTA(14);
  if (p.num_splits == 1) { MOEKV_TRACE_CTA(15); return; }
  combine_splits<QT, W, STACK == 2 ? NH / 2 : NH>(p, seq, kvh, q_row, G, reinterpret_cast<int*>(smem + plan.flag),
                                                   reinterpret_cast<float*>(smem));
  MOEKV_TRACE_CTA(15);
}

}  // namespace moekv_v7
