// The v10 decode kernel's per-warp state and its value outliers as fp32 corrections (lowbit_decode_page.cuh).
#pragma once
#include "lowbit_decode.cuh"

namespace moekv_v7 {

struct WarpState {
  float acc[8][4];
  float m0, m1, l0, l1, z0, z1;
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < 8; ++i) { acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f; }
    m0 = m1 = NEG_INF; l0 = l1 = z0 = z1 = 0.f;
  }
};

struct SlotView {
  const uint16_t* idx;   // page-head's slot indices (token * D + channel), ascending
  const __half* val;     // residuals
};

// Value outliers as corrections (stacked scores): slots [lo, hi) of chunk k, one per lane, add r * p[token][head]
// (the chunk's probabilities, heads 0..3) to corr[channel][head] (fp32, [D][4]). Lanes whose channels are all
// different (each lane claims its channel in `claim` and reads it back) update at once; otherwise the slots of one
// channel update in successive rounds in slot order. No atomics, deterministic.
constexpr float CORR_SPAN = 20.f;     // the corrections' max may trail the running max by up to 2^20 (page loop)

// fac: each head's factor 2^(m - mc) (the probabilities in pt are relative to the running max m, the rows to mc)
__device__ __forceinline__ void add_corrections(const SlotView& sv, int lo, int hi, int k, int lane, float* corr,
                                                const __half* pt, uint8_t* claim, float4 fac) {
  for (int base = lo; base < hi; base += 32) {
    const int s = base + lane;
    const bool live = s < hi;
    const int idx = live ? (int)sv.idx[s] : 0;
    const int tok = idx / D - CHUNK * k, ch = live ? idx % D : D + lane;     // dead lanes: distinct dummies
    const float r = live ? __half2float(sv.val[s]) : 0.f;
    const float r0 = r * fac.x, r1 = r * fac.y, r2 = r * fac.z, r3 = r * fac.w;
    const uint2 pp = *reinterpret_cast<const uint2*>(pt + (live ? tok : 0) * NH);
    const float2 p01 = __half22float2(*reinterpret_cast<const __half2*>(&pp.x));
    const float2 p23 = __half22float2(*reinterpret_cast<const __half2*>(&pp.y));
    auto add = [&] {                   // this lane's slot into its channel's row
      float4* row = reinterpret_cast<float4*>(corr) + ch;
      float4 v = *row;
      v.x = fmaf(r0, p01.x, v.x); v.y = fmaf(r1, p01.y, v.y); v.z = fmaf(r2, p23.x, v.z); v.w = fmaf(r3, p23.y, v.w);
      *row = v;
    };
    if (live) claim[ch] = (uint8_t)lane;
    __syncwarp();
    const bool clash = __any_sync(0xffffffffu, live && claim[ch] != lane);
    if (!clash) {
      if (live) add();
      __syncwarp();
      continue;
    }
    const unsigned same = __match_any_sync(0xffffffffu, ch);
    unsigned pending = __ballot_sync(0xffffffffu, live);
    while (pending) {
      const bool mine = live && ((pending >> lane) & 1u) && (__ffs(same & pending) - 1 == lane);
      if (mine) add();
      __syncwarp();
      pending &= ~__ballot_sync(0xffffffffu, mine);
    }
  }
}

// the online softmax's rescale of the corrections: lane (g, c) takes channels 16 g + 8 (c >> 1) + 0..7 of heads
// 2 (c & 1), 2 (c & 1) + 1 (its a0, a1)
__device__ __forceinline__ void scale_corrections(float* corr, int g, int c, float a0, float a1) {
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float2* e = reinterpret_cast<float2*>(corr + (16 * g + 8 * (c >> 1) + i) * 4 + 2 * (c & 1));
    float2 v = *e;
    v.x *= a0; v.y *= a1;
    *e = v;
  }
  __syncwarp();
}

// the corrections into the accumulators (their rows' unit 2^(off - 24)) at the running max: b0, b1 = 2^(mc - m) of the
// lane's heads (c < 2: heads 2c, 2c + 1); lanes of columns 4..7 hold padding
template <int B>
__device__ __forceinline__ void fold_corrections(const float* corr, int g, int c, WarpState& st, float b0, float b1) {
  __syncwarp();
  if (c >= 2) return;
#pragma unroll
  for (int i2 = 0; i2 < 8; ++i2)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int vj = 2 * i2 + (e >> 1), ch = 16 * g + vj, h = 2 * c + (e & 1);
      const float unit = __int_as_float((127 - 24 + value_off<B>(vj)) << 23);    // 2^(off - 24)
      st.acc[i2][e] = fmaf(corr[ch * 4 + h], unit * ((e & 1) ? b1 : b0), st.acc[i2][e]);
    }
}

}  // namespace moekv_v7
