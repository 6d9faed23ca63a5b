// Helpers of the page loop (lowbit_decode_page.cuh): a page-head's outlier slots, their chunk bounds, the one-hot
// MMAs' B fragments, the query's B-fragment tables.
#pragma once
#include "lowbit_decode_corr.cuh"

namespace moekv_v7 {

__device__ __forceinline__ SlotView slot_view(const uint8_t* st, int off_idx, int off_val, long long ph, int cap) {
  const int shift = (int)((ph * cap * 2) & 15);
  return SlotView{reinterpret_cast<const uint16_t*>(st + off_idx + shift),
                  reinterpret_cast<const __half*>(st + off_val + shift)};
}

// the first slot of every chunk among the first `count` (slots sorted by token * D + channel) into bounds[0..CHUNKS]
__device__ __forceinline__ void chunk_bounds(const SlotView& sv, int count, int lane, int* bounds) {
  int b1 = 0, b2 = 0, b3 = 0;
  for (int base = 0; base < count; base += 32) {
    const int s = base + lane;
    const int idx = s < count ? (int)sv.idx[s] : 0x7fffffff;
    b1 += __popc(__ballot_sync(0xffffffffu, idx < CHUNK * D));
    b2 += __popc(__ballot_sync(0xffffffffu, idx < 2 * CHUNK * D));
    b3 += __popc(__ballot_sync(0xffffffffu, idx < 3 * CHUNK * D));
  }
  if (lane == 0) { bounds[0] = 0; bounds[1] = b1; bounds[2] = b2; bounds[3] = b3; bounds[4] = count; }
}

// The one-hot MMA's B fragment (m16n8k8): slots 2c, 2c + 1 of the tile (lane s holds slot s's residual r and its
// key: the channel for key outliers, the token for value outliers), each residual times factor(key) of this
// lane's head.
template <typename F>
__device__ __forceinline__ uint32_t slot_operand(float r, int key, int c, F factor) {
  float prod[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float rr = __shfl_sync(0xffffffffu, r, 2 * c + e);
    const int kk = __shfl_sync(0xffffffffu, key, 2 * c + e);
    prod[e] = rr * factor(kk);
  }
  return pack_half2(prod[0], prod[1]);
}

// channel pairs (lo, lo + gap) of the 16 B-fragment registers of lane block c from a [32] fp16 row in shared memory
template <int B>
__device__ __forceinline__ void channel_pairs(uint32_t (&r)[16], const uint8_t* row32) {
  uint32_t w[16];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint4 v = *reinterpret_cast<const uint4*>(row32 + 16 * k);
    w[4 * k] = v.x; w[4 * k + 1] = v.y; w[4 * k + 2] = v.z; w[4 * k + 3] = v.w;
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int lo = key_lo<B>(j), hi = lo + key_gap<B>();
    r[j] = prmt(w[lo >> 1], w[hi >> 1], (lo & 1) ? 0x7632 : 0x5410);
  }
}

__device__ __forceinline__ void load_frag16(uint32_t (&r)[16], const uint8_t* tab, int lane) {
#pragma unroll
  for (int b4 = 0; b4 < 4; ++b4) {
    const uint4 v = *reinterpret_cast<const uint4*>(tab + (b4 * 32 + lane) * 16);
    r[4 * b4] = v.x; r[4 * b4 + 1] = v.y; r[4 * b4 + 2] = v.z; r[4 * b4 + 3] = v.w;
  }
}

// qn[head][ch] (natural channel order) from the pair table qp (B-fragment order)
template <int B>
__device__ __forceinline__ float qn_at(const uint8_t* qp, int head, int ch) {
  const int blk = ch >> 5, w = ch & 31;
  const int j = B == 4 ? (w & 3) + 4 * (w >> 3) : B == 3 ? (w & 15) : (w & 7) + 8 * (w >> 4);
  const int half = B == 4 ? (w >> 2) & 1 : B == 3 ? (w >> 4) : (w >> 3) & 1;
  const __half* e = reinterpret_cast<const __half*>(qp + ((j >> 2) * 32 + head * 4 + blk) * 16 + (j & 3) * 4);
  return __half2float(e[half]);
}

}  // namespace moekv_v7
