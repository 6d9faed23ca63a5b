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
// shared memory; scratch: the (free by now) merge region, [W][NH][D] + [W][NH][2] floats.
// v14: warp w folds splits w, w + W, ... online (a running max per head), lane = four channels (16-byte loads of the
// partials, the log-sum-exp a broadcast load), UNROLL splits' loads in one round; then the warps' (max, sum, outputs)
// meet in shared memory and thread = channel folds them. 64 splits of 4 warps: 4 rounds of loads (v10-v13: the
// log-sum-exps, then the weights in shared memory, then S / 4 rounds of partials per channel thread). GH: the heads a
// CTA can hold (4 with stacked scores, else NH), so the registers match the group.
template <typename QT, int W, int GH>
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
  constexpr int UNROLL = GH <= 4 ? 4 : 2;
  float M[GH], L[GH];
  float4 O[GH];
#pragma unroll
  for (int h = 0; h < GH; ++h) { M[h] = NEG_INF; L[h] = 0.f; O[h] = make_float4(0.f, 0.f, 0.f, 0.f); }
  const float4* pp = reinterpret_cast<const float4*>(p.partial + base * D) + lane;   // channels 4 lane .. + 3
  const float* lp = p.lse + base;
#pragma unroll UNROLL
  for (int s = warp; s < S; s += W) {
#pragma unroll
    for (int h = 0; h < GH; ++h) {
      if (h < G) {
        const float l = __ldcg(lp + (long long)s * NH + h);
        const float4 x = __ldcg(pp + ((long long)s * NH + h) * (D / 4));
        const float n = fmaxf(M[h], l), nu = n == NEG_INF ? 0.f : n;
        const float a = ex2(M[h] - nu), b = ex2(l - nu);
        O[h].x = fmaf(O[h].x, a, x.x * b); O[h].y = fmaf(O[h].y, a, x.y * b);
        O[h].z = fmaf(O[h].z, a, x.z * b); O[h].w = fmaf(O[h].w, a, x.w * b);
        L[h] = fmaf(L[h], a, b); M[h] = n;
      }
    }
  }
  float* so = scratch;                             // [W][NH][D] the warps' outputs
  float* sml = scratch + W * NH * D;               // [W][NH][2] their max and sum
#pragma unroll
  for (int h = 0; h < GH; ++h) {
    if (h < G) {
      reinterpret_cast<float4*>(so + (warp * NH + h) * D)[lane] = O[h];
      if (lane == 0) { sml[(warp * NH + h) * 2] = M[h]; sml[(warp * NH + h) * 2 + 1] = L[h]; }
    }
  }
  __syncthreads();
  if (tid < D) {                                   // thread = channel
    for (int h = 0; h < G; ++h) {
      float Mx = NEG_INF;
#pragma unroll
      for (int w = 0; w < W; ++w) Mx = fmaxf(Mx, sml[(w * NH + h) * 2]);
      const float Mu = Mx == NEG_INF ? 0.f : Mx;
      float Ls = 0.f, Os = 0.f;
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float wgt = ex2(sml[(w * NH + h) * 2] - Mu);
        Ls = fmaf(wgt, sml[(w * NH + h) * 2 + 1], Ls);
        Os = fmaf(wgt, so[(w * NH + h) * D + tid], Os);
      }
      reinterpret_cast<QT*>(p.out)[q_row * p.stride_ot + (long long)(kvh * G + h) * p.stride_oh + tid] =
          from_float<QT>(Ls > 0.f ? Os / Ls : 0.f);
    }
  }
  if (tid == 0) p.counters[seq * p.num_kv_heads + kvh] = 0;
}

}  // namespace moekv_v7
