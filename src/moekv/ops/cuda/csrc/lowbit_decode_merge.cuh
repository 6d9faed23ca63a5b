// The v7 kernel's full-precision parts and its split combine (lowbit_decode_kernel.cuh).
#pragma once
#include "lowbit_decode.cuh"

namespace moekv_v7 {

// The query of this CTA's heads (kvh * G + h), normalised per head (|qn| <= 1), as fp16 in natural channel order;
// thread: head qh = tid / 16, channels qd = 8 (tid % 16) + 0..7 (all threads call it).
template <typename QT>
__device__ __forceinline__ void load_query(const Params& p, long long q_row, int kvh, int G, int qh, int qd,
                                           __half* qn_tab, float* qmax_tab, bool write_max) {
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
  }
  if (write_max && (threadIdx.x & 15) == 0) qmax_tab[qh] = mx;
}

// Combine the warps' states (staged pages folded in: lowbit_decode_staged.cuh) and (split 0) the new token; thread = channel. One split:
// the output; several: the normalised partial output and its log-sum-exp.
template <typename QT, int W>
__device__ __forceinline__ void combine_warps(const Params& p, const float* mo, const float* ml, const __half* qn_tab,
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
    float M = NEG_INF;
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
// shared memory; scratch: the (free by now) merge region, at least MAX_SPLITS * NH + (W / QWARPS) * NH * D floats.
// Every load is independent of the others: the splits' log-sum-exps go to shared memory in one round, each head's
// max and weights are computed there once, then thread = (channel, split phase) sums its splits for all heads with
// 4 splits x G heads of loads in flight (v10 walked the splits one after the other per head: 3 * S * G dependent-ish
// L2 round trips on the last CTA's critical path).
template <typename QT, int W>
__device__ __forceinline__ void combine_splits(const Params& p, int seq, int kvh, long long q_row, int G, int* flag,
                                               float* scratch) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, S = p.num_splits;
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    const int prev = atomicAdd(p.counters + (seq * p.num_kv_heads + kvh), 1);
    flag[0] = prev == S - 1;
  }
  __syncthreads();
  if (!flag[0]) return;
  __threadfence();
  const long long base = ((long long)seq * p.num_kv_heads + kvh) * S * NH;     // [S][NH] log-sum-exps
  float* wgt = scratch;                                                        // [S][NH]: lse, then weights
  float* wsum = scratch + MAX_SPLITS * NH;                                     // [NH]
  float* part = wsum + NH;                                                     // [PHASES - 1][NH][D]
  for (int i = tid; i < S * NH; i += 32 * W) wgt[i] = (i % NH) < G ? __ldcg(p.lse + base + i) : NEG_INF;
  __syncthreads();
  for (int h = warp; h < G; h += W) {              // warp per head: max, weights in place, their sum
    float M = NEG_INF;
    for (int s = lane; s < S; s += 32) M = fmaxf(M, wgt[s * NH + h]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    const float Mu = M == NEG_INF ? 0.f : M;
    float sum = 0.f;
    for (int s = lane; s < S; s += 32) { const float w = ex2(wgt[s * NH + h] - Mu); wgt[s * NH + h] = w; sum += w; }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) wsum[h] = sum;
  }
  __syncthreads();
  constexpr int PHASES = 32 * W / D;               // 1 (4 warps) or 2 (8 warps): splits s = phase, phase + PHASES, ...
  const int ch = tid % D, phase = tid / D;
  float O[NH];
#pragma unroll
  for (int h = 0; h < NH; ++h) O[h] = 0.f;
  const float* pp = p.partial + base * D + ch;
#pragma unroll 4
  for (int s = phase; s < S; s += PHASES) {
#pragma unroll
    for (int h = 0; h < NH; ++h)
      if (h < G) O[h] = fmaf(wgt[s * NH + h], __ldcg(pp + ((long long)s * NH + h) * D), O[h]);
  }
  if (PHASES > 1) {
    if (phase > 0) {
#pragma unroll
      for (int h = 0; h < NH; ++h) if (h < G) part[((phase - 1) * NH + h) * D + ch] = O[h];
    }
    __syncthreads();
    if (phase > 0) return;
#pragma unroll
    for (int q = 1; q < PHASES; ++q)
#pragma unroll
      for (int h = 0; h < NH; ++h) if (h < G) O[h] += part[((q - 1) * NH + h) * D + ch];
  }
#pragma unroll
  for (int h = 0; h < NH; ++h) {
    if (h < G) {
      const float ws = wsum[h];
      reinterpret_cast<QT*>(p.out)[q_row * p.stride_ot + (long long)(kvh * G + h) * p.stride_oh + ch] =
          from_float<QT>(ws > 0.f ? O[h] / ws : 0.f);
    }
  }
  if (tid == 0) p.counters[seq * p.num_kv_heads + kvh] = 0;
}

}  // namespace moekv_v7
