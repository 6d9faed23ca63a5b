// The v7 kernel's full-precision parts and its split combine (lowbit_decode_kernel.cuh).
#pragma once
#include "lowbit_decode.cuh"

namespace moekv_v7 {

// Staged pages (the tail page, sink pages) of this CTA's split in full precision, on CUDA cores: thread = token
// for the scores (16-byte row loads, the query's fp16 values from an fp32 table), one max / sum reduction per head, then
// thread = channel for p . v. The pages' online-softmax state accumulates in st_o [NH][D], st_m, st_l [NH].
// sbuf: [P][NH] floats, red: [2 * QWARPS][NH] floats of scratch. Threads >= P (CTAs of 8 warps) only meet the barriers.
template <typename QT, int W>
__device__ __forceinline__ void attend_staged_pages(const Params& p, const int* table, const int* staged, int num_staged,
                                                    int first, int ctx, int kvh, int G, const float* qn32,
                                                    const float* qmax_tab, float* st_o, float* st_m, float* st_l,
                                                    float* sbuf, float* red) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool active = W == QWARPS || tid < P;      // the first QWARPS warps (CTAs of 8 warps: the others wait)
  for (int k = 0; k < num_staged; ++k) {
    const int i = staged[k], page_index = first + i;
    const int slot = p.slot_of_page[table[i]];
    const long long row_stride = (long long)p.num_kv_heads * D;
    const QT* base_k = reinterpret_cast<const QT*>(p.staging_k) + (long long)slot * P * row_stride + (long long)kvh * D;
    const QT* base_v = reinterpret_cast<const QT*>(p.staging_v) + (long long)slot * P * row_stride + (long long)kvh * D;
    float s8[NH], pmax[NH];
    if (active) {
      // scores: thread = token, 16-byte row loads, the query from the fp32 table
      const QT* krow = base_k + tid * row_stride;
#pragma unroll
      for (int h = 0; h < NH; ++h) s8[h] = 0.f;
      uint4 krv[D / 8];                     // the whole row first: one global round trip, not D / 8 / unroll
#pragma unroll
      for (int i2 = 0; i2 < D / 8; ++i2) krv[i2] = *reinterpret_cast<const uint4*>(krow + 8 * i2);
#pragma unroll
      for (int d0 = 0; d0 < D; d0 += 8) {
        const uint4 kr = krv[d0 / 8];
        const QT* kv = reinterpret_cast<const QT*>(&kr);
        float kf[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) kf[e] = to_float<QT>(kv[e]);
#pragma unroll
        for (int h = 0; h < NH; ++h) {
          if (h < G) {
            const float4 qa = *reinterpret_cast<const float4*>(qn32 + h * D + d0);
            const float4 qb = *reinterpret_cast<const float4*>(qn32 + h * D + d0 + 4);
            s8[h] = fmaf(qa.x, kf[0], s8[h]); s8[h] = fmaf(qa.y, kf[1], s8[h]);
            s8[h] = fmaf(qa.z, kf[2], s8[h]); s8[h] = fmaf(qa.w, kf[3], s8[h]);
            s8[h] = fmaf(qb.x, kf[4], s8[h]); s8[h] = fmaf(qb.y, kf[5], s8[h]);
            s8[h] = fmaf(qb.z, kf[6], s8[h]); s8[h] = fmaf(qb.w, kf[7], s8[h]);
          }
        }
      }
      const bool valid = page_index * P + tid < ctx;
#pragma unroll
      for (int h = 0; h < NH; ++h) {
        s8[h] = valid ? s8[h] * (qmax_tab[h] * p.qk_scale) : NEG_INF;
        float mx = s8[h];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        pmax[h] = mx;
      }
      if (lane == 0) {
#pragma unroll
        for (int h = 0; h < NH; ++h) red[warp * NH + h] = pmax[h];
      }
    }
    __syncthreads();
    if (active) {
#pragma unroll
      for (int h = 0; h < NH; ++h) {
        float mx = red[h];
#pragma unroll
        for (int w = 1; w < QWARPS; ++w) mx = fmaxf(mx, red[w * NH + h]);
        const float mnew = fmaxf(st_m[h], mx), muse = mnew == NEG_INF ? 0.f : mnew;
        const float pr = ex2(s8[h] - muse);                         // this token's weight against the new max
        sbuf[tid * NH + h] = pr;
        float sum = pr;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        pmax[h] = mnew;
        s8[h] = sum;
      }
    }
    __syncthreads();                                                // red (max) read by all; sbuf complete
    float o8[NH];
    if (active) {
      if (lane == 0) {
#pragma unroll
        for (int h = 0; h < NH; ++h) red[QWARPS * NH + warp * NH + h] = s8[h];
      }
      // p . v: thread = channel; the page's tokens eight at a time (coalesced across the channel threads)
      const QT* vcol = base_v + tid;
#pragma unroll
      for (int h = 0; h < NH; ++h) o8[h] = 0.f;
#pragma unroll 4                          // 32 loads in flight per thread (the page loop's registers are free)
      for (int t0 = 0; t0 < P; t0 += 8) {
        float vf[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) vf[e] = to_float<QT>(vcol[(t0 + e) * row_stride]);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float4 pa = *reinterpret_cast<const float4*>(sbuf + (t0 + e) * NH);
          const float4 pb = *reinterpret_cast<const float4*>(sbuf + (t0 + e) * NH + 4);
          o8[0] = fmaf(pa.x, vf[e], o8[0]); o8[1] = fmaf(pa.y, vf[e], o8[1]);
          o8[2] = fmaf(pa.z, vf[e], o8[2]); o8[3] = fmaf(pa.w, vf[e], o8[3]);
          o8[4] = fmaf(pb.x, vf[e], o8[4]); o8[5] = fmaf(pb.y, vf[e], o8[5]);
          o8[6] = fmaf(pb.z, vf[e], o8[6]); o8[7] = fmaf(pb.w, vf[e], o8[7]);
        }
      }
    }
    __syncthreads();                                                // the sums are in red
    if (active) {
#pragma unroll
      for (int h = 0; h < NH; ++h) {
        const float alpha = ex2(st_m[h] - (pmax[h] == NEG_INF ? 0.f : pmax[h]));
        st_o[h * D + tid] = fmaf(st_o[h * D + tid], alpha, o8[h]);
        if (tid == 0) {
          float sum = 0.f;
#pragma unroll
          for (int w = 0; w < QWARPS; ++w) sum += red[QWARPS * NH + w * NH + h];
          st_l[h] = fmaf(st_l[h], alpha, sum);
        }
      }
    }
    __syncthreads();                                                // every thread read st_m before it moves
    if (tid == 0) {
#pragma unroll
      for (int h = 0; h < NH; ++h) st_m[h] = pmax[h];
    }
    __syncthreads();
  }
}

// The query of this CTA's heads (kvh * G + h), normalised per head (|qn| <= 1), as fp16 in natural channel order;
// thread: head qh = tid / 16, channels qd = 8 (tid % 16) + 0..7 (all threads call it).
template <typename QT>
__device__ __forceinline__ void load_query(const Params& p, long long q_row, int kvh, int G, int qh, int qd,
                                           __half* qn_tab, float* qmax_tab, bool write_max, float* qn32 = nullptr) {
  float qv[8];
  const QT* qp = reinterpret_cast<const QT*>(p.q) + q_row * p.stride_qt + (long long)(kvh * G + qh) * p.stride_qh + qd;
#pragma unroll
  for (int k = 0; k < 8; ++k) qv[k] = qh < G ? to_float<QT>(qp[k]) : 0.f;
  float mx = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) mx = fmaxf(mx, fabsf(qv[k]));
#pragma unroll
  for (int o = 1; o < 16; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  mx = mx > 0.f ? mx : 1.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const __half h = __float2half_rn(qv[k] / mx);
    qn_tab[qh * D + qd + k] = h;
    if (qn32 != nullptr) qn32[qh * D + qd + k] = __half2float(h);
  }
  if (write_max && (threadIdx.x & 15) == 0) qmax_tab[qh] = mx;
}

// Combine the warps' states, the staged pages' state and (split 0) the new token; thread = channel. One split:
// the output; several: the normalised partial output and its log-sum-exp.
template <typename QT, int W>
__device__ __forceinline__ void combine_warps(const Params& p, const float* mo, const float* ml, const float* st_o,
                                              const float* st_m, const float* st_l, const __half* qn_tab,
                                              const float* qmax_tab, long long q_row, int kvh, int G, int seq,
                                              int split, float* snew) {
  const int ch = threadIdx.x, lane = ch & 31, warp = ch >> 5;
  const bool write_direct = p.num_splits == 1;
  if (split == 0) {              // the new token's score per head, once: warp w takes heads w, w + W
    const QT* kn = reinterpret_cast<const QT*>(p.new_k) + q_row * p.stride_kt + (long long)kvh * p.stride_kh;
    float kf[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) kf[e] = to_float<QT>(kn[4 * lane + e]);
    for (int h = warp; h < G; h += W) {
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) dot = fmaf(__half2float(qn_tab[h * D + 4 * lane + e]), kf[e], dot);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      if (lane == 0) snew[h] = dot * (qmax_tab[h] * p.qk_scale);
    }
    __syncthreads();
  }
  if (W != QWARPS && ch >= D) return;  // CTAs of 8 warps: thread = channel for the first D threads
  for (int h = 0; h < G; ++h) {
    float M = st_m[h];
#pragma unroll
    for (int w = 0; w < W; ++w) M = fmaxf(M, ml[w * NH + h]);
    float s_new = NEG_INF, v_new = 0.f;
    if (split == 0) {
      s_new = snew[h];
      v_new = to_float<QT>(reinterpret_cast<const QT*>(p.new_v)[q_row * p.stride_vt + (long long)kvh * p.stride_vh + ch]);
      M = fmaxf(M, s_new);
    }
    const float Mu = M == NEG_INF ? 0.f : M;
    float Lsum = 0.f, O = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float wgt = ex2(ml[w * NH + h] - Mu);
      Lsum = fmaf(wgt, ml[(W + w) * NH + h], Lsum);
      O = fmaf(wgt, mo[(w * NH + h) * D + ch], O);
    }
    {
      const float wgt = ex2(st_m[h] - Mu);
      Lsum = fmaf(wgt, st_l[h], Lsum);
      O = fmaf(wgt, st_o[h * D + ch], O);
    }
    if (split == 0) { const float wgt = ex2(s_new - Mu); Lsum += wgt; O = fmaf(wgt, v_new, O); }
    const float res = Lsum > 0.f ? O / Lsum : 0.f;
    const int head = kvh * G + h;
    if (write_direct) {
      reinterpret_cast<QT*>(p.out)[q_row * p.stride_ot + (long long)head * p.stride_oh + ch] = from_float<QT>(res);
    } else {
      const long long base = (((long long)seq * p.num_kv_heads + kvh) * p.num_splits + split) * NH + h;
      p.partial[base * D + ch] = res;
      if (ch == 0) p.lse[base] = Lsum > 0.f ? M + __log2f(Lsum) : NEG_INF;
    }
  }
}

// Split-K: every CTA of a (sequence, kv head) has written its normalised partial output and log-sum-exp; the last
// to arrive (arrival counter, which it resets: CUDA-graph safe) combines them into the output. flag: one int of
// shared memory.
template <typename QT>
__device__ __forceinline__ void combine_splits(const Params& p, int seq, int kvh, long long q_row, int G, int* flag) {
  const int tid = threadIdx.x, ch = tid;
  // ---- split-K: the last CTA of this (sequence, kv head) combines
  __threadfence();
  __syncthreads();
  int* last_flag = flag;
  if (tid == 0) {
    const int prev = atomicAdd(p.counters + (seq * p.num_kv_heads + kvh), 1);
    last_flag[0] = prev == p.num_splits - 1;
  }
  __syncthreads();
  if (!last_flag[0]) return;
  __threadfence();
  for (int h = 0; h < G && ch < D; ++h) {      // thread = channel (CTAs of 8 warps: the first D threads)
    const long long base = ((long long)seq * p.num_kv_heads + kvh) * p.num_splits * NH + h;
    float M = NEG_INF;
    for (int s = 0; s < p.num_splits; ++s) M = fmaxf(M, __ldcg(p.lse + base + (long long)s * NH));
    const float Mu = M == NEG_INF ? 0.f : M;
    float wsum = 0.f, O = 0.f;
    for (int s = 0; s < p.num_splits; ++s) {
      const float wgt = ex2(__ldcg(p.lse + base + (long long)s * NH) - Mu);
      wsum += wgt;
      O = fmaf(wgt, __ldcg(p.partial + (base + (long long)s * NH) * D + ch), O);
    }
    const int head = kvh * G + h;
    reinterpret_cast<QT*>(p.out)[q_row * p.stride_ot + (long long)head * p.stride_oh + ch] =
        from_float<QT>(wsum > 0.f ? O / wsum : 0.f);
  }
  if (tid == 0) p.counters[seq * p.num_kv_heads + kvh] = 0;
}

}  // namespace moekv_v7
