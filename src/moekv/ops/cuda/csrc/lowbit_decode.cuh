// Low-bit paged decode attention for Hopper (v7): one CUDA kernel reads the packed pages straight from
// global memory through a cp.async ring in shared memory and computes on the tensor cores
// (mma.sync m16n8k16, fp16 operands, fp32 accumulators). Contract and byte layout: docs/kv-format.md and
// docs/attention-kernels.md ("v7"); the pure-PyTorch twin is ops.reference.lowbit.paged_attention_lowbit.
//
// Work split: one CTA (4 warps) per (split, kv head, sequence). All warps walk the same pages; warp w takes
// tokens [32w, 32w + 32) of each 128-token page, with an online softmax of its own (merged at the end).
// Per page (one CTA barrier per page):
//   loads   : every thread issues its share of 16-byte cp.async copies: the codes of page i + 1 into a 2-stage
//             ring, the small arrays (scales, zero points, counts, outliers, the staging slot) of page i + 2 into
//             a 3-stage ring; no load waits in the compute path.
//   prep    : the CTA folds page i + 1's per-channel key scale into the query (the MMA B operand, per lane, in
//             fragment order), computes q . Z per head and each token's value scale / zero point into the other
//             of two prep buffers while page i is computed.
//   keys    : S^T[tok, head] = codes[tok, ch] . q'[ch, head]: tokens are the MMA M dimension, the GQA group
//             (padded to 8) is N. Codes become fp16 operands by masks alone: a k-bit field at bit offset o
//             (o + k <= 10) of a 16-bit half IS the fp16 subnormal code * 2^(o - 24); the 2^-o goes into q',
//             the 2^24 onto the fp32 result. int4: 5 integer instructions per 8 codes; int2: 9 per 16; int3
//             (2-bit plane + interleaved 1-bit plane, see kv-format.md): 2 LOP3 per 2 codes.
//   softmax : base 2, per warp and head; accumulators rescaled only when a max grows.
//   values  : out^T[ch, head] += codes^T[ch, tok] . (p * S_t)[tok, head]; the probabilities reach the B
//             fragment layout by movmatrix.trans; token pairs meet in one register by PRMT.
//   outliers: exact 0/1 MMAs into the same accumulators (one-hot A tile in shared memory holding the unit
//             2^(o-24) of the target row, B = residual * p or residual * q): no atomics, deterministic.
// Split-K only where the batch does not fill the GPU; the last CTA of a (sequence, kv head) combines.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace moekv_v7 {

constexpr int P = 128;            // tokens per page
constexpr int D = 128;            // head_dim
constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int NH = 8;             // MMA N: the GQA group padded to 8 heads
constexpr int TABLE_MAX = 512;    // block-table entries of one split held in shared memory
constexpr int SLOT_TILE = 16;     // outlier slots per one-hot MMA step
#define NEG_INF (-__int_as_float(0x7f800000))

// ---------------------------------------------------------------- per-width layout constants
template <int B> struct Bits;
template <> struct Bits<4> {
  static constexpr int WORDS = 16;                 // words per row
  static constexpr int K_LO = 64, K_HI = 0;        // smem bytes per row: main plane, 1-bit plane (keys)
  static constexpr int V_LO = 80, V_HI = 0;        // values: main plane padded (bank-conflict free pair loads)
};
template <> struct Bits<3> {
  static constexpr int WORDS = 12;
  static constexpr int K_LO = 32, K_HI = 16;
  static constexpr int V_LO = 32, V_HI = 16;
};
template <> struct Bits<2> {
  static constexpr int WORDS = 8;
  static constexpr int K_LO = 32, K_HI = 0;
  static constexpr int V_LO = 32, V_HI = 0;
};
// Token order inside a 16-token MMA tile: QK row r holds token tau(r). For 8-word rows (int3 / int2) the value
// loads of the four token pairs (tau(2c), tau(2c + 1)) then hit four different bank groups, and the key loads
// of rows tau(g) stay conflict-free too; int4 keeps the identity (its value rows are padded instead).
template <int B> __host__ __device__ __forceinline__ int tau(int r) { return B == 4 ? r : r ^ ((r >> 2) & 1); }

struct Params {
  const void* q; const void* new_k; const void* new_v; void* out;
  float* partial; float* lse; int* counters;
  const int* k_codes; const __half* k_scale; const __half* k_zero;
  const __half* k_ovals; const int16_t* k_oidx; const int16_t* k_ocount;
  const int* v_codes; const uint8_t* v_scale; const uint8_t* v_zero; const __half* v_base;
  const __half* v_ovals; const int16_t* v_oidx; const int16_t* v_ocount;
  const void* staging_k; const void* staging_v; const int* slot_of_page;
  const int* block_tables; const int* query_start_loc; const int* context_lens;
  float qk_scale;                   // softmax scale * log2(e)
  int num_kv_heads, group, num_splits, pages_per_split;   // pages_per_split 0: ceil(pages / splits) on the device
  int k_cap, v_cap;                 // outlier slots per page-head
  long long k_oc_bytes, v_oc_bytes; // bytes of the outlier index / value tensors (covering loads stay inside)
  long long v_base_bytes, k_count_bytes, v_count_bytes;
  int stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_bt;
};

}  // namespace moekv_v7

#include "lowbit_decode_codes.cuh"

namespace moekv_v7 {

// ---------------------------------------------------------------- shared memory layout
// Two rings: the codes of a page-head (CODE_STAGES deep: the page being computed and the next one in flight) and
// its small arrays (META_STAGES deep, one page further ahead, so that the prep of page i + 1 runs while page i is
// computed and one CTA barrier per page suffices).
constexpr int CODE_STAGES = 2;
constexpr int META_STAGES = 3;
template <int B> struct Layout {
  using W = Bits<B>;
  // code stage: a page-head's codes, planes apart, rows padded as W says
  static constexpr int KC_LO = 0;
  static constexpr int KC_HI = KC_LO + P * W::K_LO;
  static constexpr int VC_LO = KC_HI + P * W::K_HI;
  static constexpr int VC_HI = VC_LO + P * W::V_LO;
  static constexpr int CODE_BYTES = VC_HI + P * W::V_HI;
  // meta stage: scales, zeros, counts, slot, then the outliers (runtime capacity)
  static constexpr int K_SCALE = 0;
  static constexpr int K_ZERO = K_SCALE + 2 * D;
  static constexpr int V_SCALE = K_ZERO + 2 * D;
  static constexpr int V_ZERO = V_SCALE + P;
  static constexpr int V_BASE = V_ZERO + P;       // 16-byte chunk holding the page-head's fp16 base
  static constexpr int K_COUNT = V_BASE + 16;     // chunk holding the key outlier count
  static constexpr int V_COUNT = K_COUNT + 16;
  static constexpr int SLOT = V_COUNT + 16;       // int32 staging slot of the page (-1: low-bit)
  static constexpr int FIXED = SLOT + 16;         // then k_oidx, k_oval, v_oidx, v_oval (oc bytes each)
};

__host__ __device__ inline int outlier_chunk_bytes(int cap) { return cap > 0 ? (((2 * cap + 15) / 16) + 1) * 16 : 0; }

// prep area (two, page i computes from one while page i + 1 is prepared into the other): B fragments per lane,
// q . Z per head, value scale / zero per token, flags
constexpr int PREP_BFRAG = 0;                      // [4 blocks][32 lanes][4] uint32
constexpr int PREP_BIAS = PREP_BFRAG + 4 * 32 * 16;
constexpr int PREP_VSZ = PREP_BIAS + NH * 4;       // [P] float2
constexpr int PREP_FLAGS = PREP_VSZ + P * 8;       // int: staged, k count, v count, page index
constexpr int PREP_BYTES = PREP_FLAGS + 16;
// per-warp outlier scratch: one one-hot tile (values: [D rows][SLOT_TILE]; keys use its first 32 rows; both kept
// zero between uses) and the warp's probabilities
constexpr int W_ONEHOT = 0;                        // [D rows][SLOT_TILE] fp16
constexpr int W_PTILE = W_ONEHOT + D * SLOT_TILE * 2;        // [32 tokens][NH] fp16 probabilities
constexpr int W_BYTES = W_PTILE + 32 * NH * 2;

struct SmemPlan {      // byte offsets into dynamic shared memory (host and device agree)
  int code_bytes, meta_bytes, meta, ring, prep, warp, table, qn, qmax, staged, total;
};

// after the page loop the rings hold the merge: per-warp outputs and (max, sum), the staged pages' state and
// their score tile
constexpr int MERGE_BYTES = (WARPS * NH * D + 2 * WARPS * NH + NH * D + 2 * NH + P * NH + 2 * WARPS * NH) * 4;

template <int B>
__host__ __device__ inline SmemPlan smem_plan(int k_cap, int v_cap) {
  SmemPlan s;
  s.code_bytes = Layout<B>::CODE_BYTES;
  s.meta_bytes = Layout<B>::FIXED + 2 * outlier_chunk_bytes(k_cap) + 2 * outlier_chunk_bytes(v_cap);
  s.meta_bytes = (s.meta_bytes + 127) / 128 * 128;
  s.ring = 0;
  s.meta = s.ring + CODE_STAGES * s.code_bytes;
  const int ring_bytes = s.meta + META_STAGES * s.meta_bytes;
  s.prep = s.ring + (ring_bytes > MERGE_BYTES ? ring_bytes : MERGE_BYTES);
  s.warp = s.prep + 2 * PREP_BYTES;
  s.table = s.warp + ((k_cap > 0 || v_cap > 0) ? WARPS * W_BYTES : 0);
  s.qn = s.table + TABLE_MAX * 4;                  // [NH][D] fp16 normalised query
  s.qmax = s.qn + NH * D * 2;                      // [NH] fp32 |q| max per head
  s.staged = s.qmax + NH * 4;                      // [1 + 16] staged page count and indices
  s.total = s.staged + 17 * 4;
  return s;
}

}  // namespace moekv_v7

namespace moekv_v7 {

template <int B> struct Loads {
  using L = Layout<B>;
  using W = Bits<B>;
  // key words of token row `row` for thread c
  static __device__ __forceinline__ KeyWords<B> key(const uint8_t* st, int row, int c) {
    KeyWords<B> kw;
    if constexpr (B == 4) {
      const uint4 v = *reinterpret_cast<const uint4*>(st + L::KC_LO + row * 64 + c * 16);
      kw.w[0] = v.x; kw.w[1] = v.y; kw.w[2] = v.z; kw.w[3] = v.w;
    } else if constexpr (B == 2) {
      const uint2 v = *reinterpret_cast<const uint2*>(st + L::KC_LO + row * 32 + c * 8);
      kw.w[0] = v.x; kw.w[1] = v.y;
    } else {
      const uint2 v = *reinterpret_cast<const uint2*>(st + L::KC_LO + row * 32 + c * 8);
      kw.w[0] = v.x; kw.w[1] = v.y;
      kw.h = *reinterpret_cast<const uint32_t*>(st + L::KC_HI + row * 16 + c * 4);
    }
    return kw;
  }
  // value words of token row `row` for thread g
  static __device__ __forceinline__ ValueWords<B> value(const uint8_t* st, int row, int g) {
    ValueWords<B> vw;
    if constexpr (B == 4) {
      const uint2 v = *reinterpret_cast<const uint2*>(st + L::VC_LO + row * W::V_LO + g * 8);
      vw.w[0] = v.x; vw.w[1] = v.y;
    } else if constexpr (B == 2) {
      vw.w = *reinterpret_cast<const uint32_t*>(st + L::VC_LO + row * W::V_LO + g * 4);
    } else {
      vw.w = *reinterpret_cast<const uint32_t*>(st + L::VC_LO + row * W::V_LO + g * 4);
      vw.h = *reinterpret_cast<const uint32_t*>(st + L::VC_HI + row * 16 + (g >> 1) * 4);
    }
    return vw;
  }
};

// Destinations of a thread's code chunks in a code stage (precomputed once).
template <int B> struct CopyPlan {
  static constexpr int CPR = Bits<B>::WORDS / 4;            // 16-byte chunks per code row
  static constexpr int PER_THREAD = P * CPR / THREADS;
  int kdst[PER_THREAD], vdst[PER_THREAD];
  __device__ __forceinline__ void init(int tid) {
    using L = Layout<B>;
    using W = Bits<B>;
#pragma unroll
    for (int k = 0; k < PER_THREAD; ++k) {
      const int q = tid + k * THREADS, row = q / CPR, part = q % CPR;
      if constexpr (B == 3) {
        kdst[k] = part < 2 ? L::KC_LO + row * 32 + part * 16 : L::KC_HI + row * 16;
        vdst[k] = part < 2 ? L::VC_LO + row * W::V_LO + part * 16 : L::VC_HI + row * 16;
      } else {
        kdst[k] = L::KC_LO + row * W::K_LO + part * 16;
        vdst[k] = L::VC_LO + row * W::V_LO + part * 16;
      }
    }
  }
};

__device__ __forceinline__ void covering_copy(uint8_t* dst, const void* base, long long total, long long off) {
  const int bytes = (int)max(0ll, min(16ll, total - off));
  cp_async16(dst, reinterpret_cast<const uint8_t*>(base) + (bytes > 0 ? off : 0), bytes);
}

// the codes of page `page` (kv head kvh) into code stage `st`: every thread the same number of 16-byte chunks
template <int B>
__device__ __forceinline__ void issue_codes(const Params& p, const CopyPlan<B>& cp, uint8_t* st, int page, int kvh,
                                            int tid) {
  using W = Bits<B>;
  const long long ph = (long long)page * p.num_kv_heads + kvh;
  const uint8_t* kc = reinterpret_cast<const uint8_t*>(p.k_codes) + ph * (P * W::WORDS * 4) + tid * 16;
  const uint8_t* vc = reinterpret_cast<const uint8_t*>(p.v_codes) + ph * (P * W::WORDS * 4) + tid * 16;
#pragma unroll
  for (int k = 0; k < CopyPlan<B>::PER_THREAD; ++k) {
    cp_async16(st + cp.kdst[k], kc + k * THREADS * 16, 16);
    cp_async16(st + cp.vdst[k], vc + k * THREADS * 16, 16);
  }
}

// the small arrays of page `page` into meta stage `st`: fixed lanes of warps 2 and 3; the outlier slots' covering
// chunks: warps 0 and 1
template <int B>
__device__ __forceinline__ void issue_meta(const Params& p, uint8_t* st, int page, int kvh, int tid, int ocK, int ocV) {
  using L = Layout<B>;
  const long long ph = (long long)page * p.num_kv_heads + kvh;
  const int warp = tid >> 5, lane = tid & 31;
  if (warp == 3) {                        // key scale and zero: 16 chunks each
    const uint8_t* src = reinterpret_cast<const uint8_t*>(lane < 16 ? p.k_scale : p.k_zero) + ph * (2 * D);
    cp_async16(st + L::K_SCALE + lane * 16, src + (lane & 15) * 16, 16);
  } else if (warp == 2) {
    if (lane < 16) {                      // value scale / zero codes: 8 chunks each
      const uint8_t* src = (lane < 8 ? p.v_scale : p.v_zero) + ph * P;
      cp_async16(st + L::V_SCALE + lane * 16, src + (lane & 7) * 16, 16);
    } else if (lane < 19) {               // chunks holding the fp16 base and the int16 counts
      const int k = lane - 16;
      const void* base = k == 0 ? (const void*)p.v_base : k == 1 ? (const void*)p.k_ocount : (const void*)p.v_ocount;
      const long long total = k == 0 ? p.v_base_bytes : k == 1 ? p.k_count_bytes : p.v_count_bytes;
      covering_copy(st + L::V_BASE + k * 16, base, total, (ph * 2) & ~15ll);
    } else if (lane == 19) {
      cp_async4(st + L::SLOT, p.slot_of_page + page);
    }
  } else {                                // outliers: index and value arrays, keys then values
    const int nk = ocK / 16, nv = ocV / 16;
    for (int q = tid; q < 2 * (nk + nv); q += 64) {
      const bool keys = q < 2 * nk;
      const int r = keys ? q : q - 2 * nk, n = keys ? nk : nv;
      const bool vals = r >= n;
      const int k = vals ? r - n : r;
      const void* base = keys ? (vals ? (const void*)p.k_ovals : (const void*)p.k_oidx)
                              : (vals ? (const void*)p.v_ovals : (const void*)p.v_oidx);
      const long long off = ((ph * (keys ? p.k_cap : p.v_cap) * 2) & ~15ll) + k * 16;
      covering_copy(st + L::FIXED + (keys ? 0 : 2 * ocK) + (vals ? n * 16 : 0) + k * 16, base,
                    keys ? p.k_oc_bytes : p.v_oc_bytes, off);
    }
  }
}

}  // namespace moekv_v7
