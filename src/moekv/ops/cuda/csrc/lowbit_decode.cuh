// Low-bit paged decode attention for Hopper (v9): one CUDA kernel reads the packed pages straight from
// global memory through cp.async rings in shared memory and computes on the tensor cores
// (mma.sync m16n8k16, fp16 operands, fp32 accumulators). Contract and byte layout: docs/kv-format.md and
// docs/attention-kernels.md ("v9"); the pure-PyTorch twin is ops.reference.lowbit.paged_attention_lowbit.
//
// Work split: one CTA (4 warps) per (split, kv head, sequence). Warp w streams pages w, w + 4, ... of the split on
// its own (lowbit_decode_page.cuh), 32 tokens (a chunk) at a time, with an online softmax of its own; the CTA
// meets only before the page loop (query tables) and after it (merge, staged pages, split combine).
// Per page and warp:
//   loads   : a ring of three chunk buffers (fills K_0, V_0, K_1, ...: the next chunk's keys and values always in
//             flight), the page's small arrays one page ahead as uniform 16-byte pieces (Params::m_*).
//   prep    : the per-channel key scale folded into the query (the MMA B operand, per lane, in fragment order),
//             q . Z per head on the tensor cores, each token's value scale / zero point.
//   keys    : S^T[tok, head] = codes[tok, ch] . q'[ch, head]: tokens are the MMA M dimension, the GQA group
//             (padded to 8) is N. Codes become fp16 operands by masks alone: a k-bit field at bit offset o
//             (o + k <= 10) of a 16-bit half IS the fp16 subnormal code * 2^(o - 24); the 2^-o goes into q',
//             the 2^24 onto the fp32 result. int4: 5 integer instructions per 8 codes; int2: 9 per 16; int3
//             (triplets, see kv-format.md): 23 per 32 codes (v10; the 2-bit + 1-bit planes of v9 took 38).
//   softmax : base 2, per warp and head; the max's shuffle reduction and the rescale only when some lane's score
//             exceeds the running max (one vote; v12).
//   values  : out^T[ch, head] += codes^T[ch, tok] . (p * S_t)[tok, head]; the probabilities reach the B
//             fragment layout by movmatrix.trans; token pairs meet in one register by PRMT (int3: one per word).
//   outliers: exact 0/1 MMAs into the same accumulators (one-hot A tile in shared memory holding the unit
//             2^(o-24) of the target row, B = residual * p or residual * q): no atomics, deterministic. int3 / int2
//             with stacked scores and keys without outliers: value outliers as fp32 corrections per channel and
//             head (lowbit_decode_corr.cuh), held at a max of their own and folded in after the loop.
// Split-K only where the batch does not fill the GPU; the last CTA of a (sequence, kv head) combines.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace moekv_v7 {

constexpr int P = 128;            // tokens per page
constexpr int D = 128;            // head_dim
constexpr int WARPS = 4;          // warps of the default CTA; CTAs of W = 8 warps take small batches (kernel's W)
constexpr int THREADS = WARPS * 32;
constexpr int QWARPS = 4;         // warps that build the query tables and run the staged pages (128 threads = P = D)
constexpr int NH = 8;             // MMA N: the GQA group padded to 8 heads
constexpr int TABLE_MAX = 512;    // block-table entries of one split held in shared memory
constexpr int SLOT_TILE = 8;      // outlier slots per one-hot MMA step (m16n8k8)
constexpr int MARRAYS = 12;       // small per-page arrays (scales, zeros, base, counts, slot, outlier slots)
constexpr int FIXED_PIECES = 52;  // 16-byte pieces of the fixed-size ones (scales, zeros, base, counts, slot)
constexpr int SLOT_ARRAY = 7;     // the staging-slot array: indexed by page, not page-head
constexpr int PTAB = 96;          // pieces of a page's small arrays the CTA tabulates once (smem_plan's ptab)
#define NEG_INF (-__int_as_float(0x7f800000))

// ---------------------------------------------------------------- per-width layout constants
template <int B> struct Bits;
// smem rows of a chunk: the chunk as stored (fragment order, lane_words)
template <> struct Bits<4> {
  static constexpr int WORDS = 16;                 // words per row
  static constexpr int K_ROW = 64;                 // smem bytes per row of a chunk's key codes
  static constexpr int V_ROW = 64;
};
template <> struct Bits<3> {
  static constexpr int WORDS = 12;
  static constexpr int K_ROW = 48;
  static constexpr int V_ROW = 48;
};
template <> struct Bits<2> {
  static constexpr int WORDS = 8;
  static constexpr int K_ROW = 32;
  static constexpr int V_ROW = 32;
};
// Token order inside a 16-token MMA tile: QK row r holds token tau(r). For 8-word rows (int3 / int2) the value
// loads of the four token pairs (tau(2c), tau(2c + 1)) then hit four different bank groups, and the key loads
// of rows tau(g) stay conflict-free too; int4 keeps the identity (its lane words are conflict-free LDS.128).
template <int B> __host__ __device__ __forceinline__ int tau(int r) { return B == 4 ? r : r ^ ((r >> 2) & 1); }

struct Params {
  const void* q; const void* new_k; const void* new_v; void* out;
  float* partial; float* lse; int* counters;
  const int* k_codes; const __half* k_scale; const __half* k_zero;
  const __half* k_ovals; const int16_t* k_oidx; const int16_t* k_ocount;
  const int* v_codes; const uint8_t* v_scale; const uint8_t* v_zero; const __half* v_base;
  const __half* v_ovals; const int16_t* v_oidx; const int16_t* v_ocount;
  const void* staging_k; const void* staging_v;
  const int* block_map;             // [ids, stage_nb] int32: a page's staging blocks (first -1: read its low-bit page)
  const int* block_tables; const int* query_start_loc; const int* context_lens;
  float qk_scale;                   // softmax scale * log2(e)
  int num_kv_heads, group, num_splits, pages_per_split;   // pages_per_split 0: ceil(pages / splits) on the device
  int k_cap, v_cap;                 // outlier slots per page-head
  int stage_nb, stage_shift, stage_mask;   // staging blocks per page (1, 2 or 4), log2 of their rows, rows - 1
  int slot_stride;                  // bytes of a page's block-map row (4 * stage_nb)
  int last_lowbit_page;             // the last page with low-bit storage; ids beyond are staging-only (always staged)
  // v15 work split (chunk-split CTAs only; 0: off): the splits cover equal work, the partly filled last page (staged)
  // counted as this many 32-token chunk units against a full low-bit page's CHUNKS (lowbit_decode_page.cuh
  // split_range; docs/attention-kernels.md item 7)
  int work_tail;
  // a page's small arrays as uniform 16-byte pieces (built by the host, lowbit_decode.cu: meta_pieces): piece q
  // copies bytes [(index * stride) & ~15 + 16 k, +16) of array a (clamped to its end) to meta-stage offset
  // dst[a] + 16 k; index = the page-head, or the page for the slot array
  const uint8_t* m_base[MARRAYS];
  long long m_total[MARRAYS];
  int m_stride[MARRAYS], m_dst[MARRAYS];
  int m_pieces;                     // pieces per page: FIXED_PIECES, then the outlier slots' (nk, nk, nv, nv)
  int m_nk, m_nv;                   // 16-byte pieces of one page-head's key / value outlier index (or value) slots
  uint16_t m_piece[FIXED_PIECES];   // each fixed piece: (array << 8) | its rank within the array
  int stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_bt;
  int pdl;                          // launched with programmatic dependent launch (KernelConfig.pdl, ops/triton/pdl.py)
};

}  // namespace moekv_v7

#include "lowbit_decode_codes.cuh"

namespace moekv_v7 {

// ---------------------------------------------------------------- shared memory layout (v9)
// Every warp streams its own pages (warp w: pages w, w + 4, ... of the CTA's split) through rings of its own, so
// no CTA barrier runs inside the page loop:
//   code ring : RING_BUFS buffers of one 32-token chunk of key OR value codes (int3: main and third words apart,
//               rows padded as Bits says); fills alternate K_0, V_0, K_1, V_1, ... round the ring, so a chunk's key codes go into the
//               buffer its values left one chunk earlier (three buffers keep one fill in flight at all times);
//   meta ring : META_STAGES stages of a page's small arrays (scales, zeros, counts, slot, outliers), one page ahead;
//   prep      : the page's B fragments (key scale folded into the query), each token's value scale / zero point;
//   outliers  : the one-hot tile and the chunk's probabilities.
constexpr int CHUNK = 32;                          // tokens per warp step
constexpr int CHUNKS = P / CHUNK;
constexpr int RING_BUFS = 3;
constexpr int META_STAGES = 2;
template <int B> struct Layout {
  using W = Bits<B>;
  // one ring buffer: a chunk's key codes or value codes
  static constexpr int K_BYTES = CHUNK * W::K_ROW;
  static constexpr int V_BYTES = CHUNK * W::V_ROW;
  static constexpr int BUF_BYTES = K_BYTES > V_BYTES ? K_BYTES : V_BYTES;
  // meta stage: scales, zeros, counts, slot, then the outliers (runtime capacity)
  static constexpr int K_SCALE = 0;
  static constexpr int K_ZERO = K_SCALE + 2 * D;
  static constexpr int V_SCALE = K_ZERO + 2 * D;
  static constexpr int V_ZERO = V_SCALE + P;
  static constexpr int V_BASE = V_ZERO + P;       // 16-byte chunk holding the page-head's fp16 base
  static constexpr int K_COUNT = V_BASE + 16;     // chunk holding the key outlier count
  static constexpr int V_COUNT = K_COUNT + 16;
  static constexpr int SLOT = V_COUNT + 16;       // int32 staging blocks of the page (<= 4; first -1: low-bit)
  static constexpr int FIXED = SLOT + 16;         // then k_oidx, k_oval, v_oidx, v_oval (oc bytes each)
};

__host__ __device__ inline int outlier_chunk_bytes(int cap) { return cap > 0 ? (((2 * cap + 15) / 16) + 1) * 16 : 0; }

// per-warp prep area: B fragments [4 register groups][32 lanes][4] uint32, [P] float2 value scale / zero, the
// outlier slots' chunk bounds
constexpr int PREP_BFRAG = 0;
constexpr int PREP_VSZ = PREP_BFRAG + 4 * 32 * 16;
constexpr int PREP_BOUNDS = PREP_VSZ + P * 8;       // int [2][CHUNKS + 1]: first slot of each chunk, keys / values
constexpr int PREP_BYTES = PREP_BOUNDS + 2 * (CHUNKS + 1) * 4 + 8;
// per-warp outlier scratch: the one-hot tile (values: [D rows][SLOT_TILE]; keys use its first 32 rows; kept zero
// between uses), the chunk's probabilities, the warp's staged pages
constexpr int W_ONEHOT = 0;                        // [D rows][SLOT_TILE] fp16
constexpr int W_PTILE = W_ONEHOT + D * SLOT_TILE * 2;        // [CHUNK tokens][NH] fp16 probabilities
constexpr int W_CLAIM = W_PTILE + CHUNK * NH * 2;            // [D] uint8: value-outlier corrections' conflict check
constexpr int W_BYTES = W_CLAIM + D;
constexpr int STAGED_MAX = 16;                     // staged pages of one split (the tail page, sink pages)

struct SmemPlan {      // byte offsets into dynamic shared memory (host and device agree)
  int buf_bytes, meta_bytes, warp_bytes, ring, meta, prep, scratch, staged, table, qf, qp, qn, qmax, flag,
      stlist, ptab, total;
};

// after the page loop the rings hold the merge: per-warp outputs and (max, sum), the staged pages' state and
// their score tile, and the natural-order normalised query [NH][D] fp16
constexpr int MAX_SPLITS = 512;                   // splits per (sequence, kv head) a launch may plan (host MAX_SPLITS)
// the merge region: [W][NH][D] outputs, [2][W][NH] max / sum, [NH] the new token's scores (then the split combine's scratch)
template <int W> constexpr int merge_bytes_of() { return (W * NH * D + 2 * W * NH + NH) * 4; }
constexpr int MERGE_BYTES = merge_bytes_of<WARPS>();
static_assert(merge_bytes_of<WARPS>() >= (WARPS * NH * D + 2 * WARPS * NH) * 4, "combine scratch");
static_assert(merge_bytes_of<2 * WARPS>() >= (2 * WARPS * NH * D + 4 * WARPS * NH) * 4, "combine scratch");

// 8-warp CTAs (small batches: one CTA per SM, shared memory to spare) keep the fp16 query table out of the rings,
// so the kernel skips its reload after the page loop (session 23, attention-ab-s23-variants.md: B=1 16k int3
// -1..-4%, int4 -4..-6%); 4-warp CTAs share it with the merge region (occupancy)
template <int W> __host__ __device__ constexpr bool keeps_query() { return W != WARPS; }

template <int B, int W = WARPS>
__host__ __device__ inline SmemPlan smem_plan(int k_cap, int v_cap) {
  SmemPlan s;
  s.buf_bytes = Layout<B>::BUF_BYTES;
  s.meta_bytes = Layout<B>::FIXED + 2 * outlier_chunk_bytes(k_cap) + 2 * outlier_chunk_bytes(v_cap);
  const bool outliers = k_cap > 0 || v_cap > 0;
  // one warp's share: ring, meta stages, prep, outlier scratch, staged list
  s.ring = 0;
  s.meta = s.ring + RING_BUFS * s.buf_bytes;
  s.prep = s.meta + META_STAGES * s.meta_bytes;
  s.scratch = s.prep + PREP_BYTES;
  s.staged = s.scratch + (outliers ? W_BYTES : 0);
  s.warp_bytes = (s.staged + (1 + STAGED_MAX) * 4 + 15) / 16 * 16;
  const int warps_bytes = W * s.warp_bytes;
  const int merge_bytes = merge_bytes_of<W>() + NH * D * 2;               // + the query table (fp16)
  const int region = warps_bytes > merge_bytes ? warps_bytes : merge_bytes;
  s.table = region;
  s.qf = s.table + TABLE_MAX * 4;                  // [4][32 lanes][4] half2: query pairs * 2^-off (B fragments)
  s.qp = s.qf + 4 * 32 * 16;                       // the same pairs without the unit (bias MMA, key outliers)
  s.qmax = s.qp + 4 * 32 * 16;                     // [NH] fp32 |q| max per head
  s.flag = s.qmax + NH * 4;                        // the split combine's "last CTA" flag
  s.stlist = s.flag + 16;                          // [1 + W * STAGED_MAX] the split's staged pages, in page order
  s.ptab = s.stlist + (1 + W * STAGED_MAX) * 4;    // [PTAB] the small arrays' pieces (piece_entry), built once
  s.total = s.ptab + PTAB * 4;
  // natural-order query: in the merge region, rebuilt after the loop; or (keeps_query) past the end, kept
  if (keeps_query<W>()) { s.qn = (s.total + 15) / 16 * 16; s.total = s.qn + NH * D * 2; }
  else s.qn = merge_bytes_of<W>();
  return s;
}

}  // namespace moekv_v7

namespace moekv_v7 {

// Pages in fragment order (docs/kv-format.md 2.1, core/lowbit_order.py): a chunk's bytes are copied as they
// are, and lane l's N words of it (N = 12 int3, 8 int2) are the 16-byte words at 512 j + 16 l (conflict-free
// warp-wide LDS.128). The lane's rows r: tau(g), tau(g) + 8, 16 + tau(g), 24 + tau(g); its token pairs
// (16 m + tau(2c) + 8 pair, 16 m + tau(2c + 1) + 8 pair), the first token in the low half.
// int3 keys: lane words 3 r + i = triplet word i of group c of row r; values: 6 m + 3 pair + i = triplet word i
// of group g / 2, half g % 2, of the pair. int2 keys: 2 r + i = row word 2c + i of row r; values: 4 m + 2 pair + i
// = half i of row word g of the pair. int4 (identity token order): keys 4 r + i = row word 4c + i of row r (the
// row order itself); values 8 m + 4 pair + 2 i + h = half h of row word 2g + i of the pair.
template <int N> struct LaneWords { uint32_t w[N]; };
template <int N> __device__ __forceinline__ LaneWords<N> lane_words(const uint8_t* st, int lane16) {
  LaneWords<N> r;
#pragma unroll
  for (int j = 0; j < N / 4; ++j) {
    const uint4 v = *reinterpret_cast<const uint4*>(st + 512 * j + lane16);
    r.w[4 * j] = v.x; r.w[4 * j + 1] = v.y; r.w[4 * j + 2] = v.z; r.w[4 * j + 3] = v.w;
  }
  return r;
}
template <int B> __host__ __device__ constexpr int lane_word_count() { return B == 4 ? 16 : B == 3 ? 12 : 8; }

// m-tile m's two operand halves from a lane's words: its keys' rows 2m and 2m + 1, or its values' token pairs
// 2m and 2m + 1 (the lane words of both kinds are laid out alike: lane_word_count / 4 words a row or pair)
template <int B>
__device__ __forceinline__ void unpack_lane_pair(uint32_t (&a)[16], uint32_t (&b)[16],
                                                 const LaneWords<lane_word_count<B>()>& lw, int m) {
  constexpr int N = lane_word_count<B>() / 4;          // words per row (keys) or token pair (values)
  if constexpr (B == 4) {
    unpack32_4bit(a, lw.w + 2 * N * m);
    unpack32_4bit(b, lw.w + 2 * N * m + N);
  } else if constexpr (B == 3) {
    unpack16_3bit(a, lw.w[2 * N * m], lw.w[2 * N * m + 1], lw.w[2 * N * m + 2]);
    unpack16_3bit(b, lw.w[2 * N * m + N], lw.w[2 * N * m + N + 1], lw.w[2 * N * m + N + 2]);
  } else {
    unpack32_2bit(a, lw.w[2 * N * m], lw.w[2 * N * m + 1]);
    unpack32_2bit(b, lw.w[2 * N * m + N], lw.w[2 * N * m + N + 1]);
  }
}

// Destinations of a lane's 16-byte pieces of one chunk's key / value codes in a ring buffer (the same for every
// chunk). A chunk of a page-head is contiguous in global memory (CHUNK rows of WORDS words).
template <int B> struct CopyPlan {
  static constexpr int CPR = Bits<B>::WORDS / 4;            // 16-byte pieces per code row
  static constexpr int PER_LANE = CHUNK * CPR / 32;
  static constexpr bool SAME = Bits<B>::K_ROW == Bits<B>::V_ROW;
  int kdst[PER_LANE], vdst[SAME ? 1 : PER_LANE];
  __device__ __forceinline__ int dst(bool values, int k) const { return (values && !SAME) ? vdst[SAME ? 0 : k] : kdst[k]; }
  __device__ __forceinline__ void init(int lane) {
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) {
      const int q = lane + k * 32, row = q / CPR, part = q % CPR;
      // rows as stored (int3 / int2): the identity, 16 q; int3 spelled so (its 48-byte rows as row * 48 + part * 16
      // compile to a different register allocation with more spills)
      kdst[k] = B == 3 ? 16 * q : row * Bits<B>::K_ROW + part * 16;
      if constexpr (!SAME) vdst[k] = row * Bits<B>::V_ROW + part * 16;
    }
  }
};

// byte offset of chunk `chunk` of page-head `ph` in the key (and the value) code array: a chunk of a page-head is
// contiguous (CHUNK rows of WORDS words), and both arrays have the same page-head stride
template <int B> __device__ __forceinline__ long long chunk_offset(long long ph, int chunk) {
  constexpr int CB = CHUNK * Bits<B>::WORDS * 4;
  return ph * (P / CHUNK) * CB + chunk * CB;
}

// the chunk at byte offset `off` (chunk_offset, plus this lane's 16 * lane) of the key (values = false) or value
// codes into the ring buffer at shared-space address `buf`
template <int B>
__device__ __forceinline__ void issue_chunk(const Params& p, const CopyPlan<B>& cp, uint32_t buf, long long off,
                                            bool values) {
  const uint8_t* src = reinterpret_cast<const uint8_t*>(values ? p.v_codes : p.k_codes) + off;
#pragma unroll
  for (int k = 0; k < CopyPlan<B>::PER_LANE; ++k) cp_async16_s(buf + cp.dst(values, k), src + k * 512, 16);
}

// piece q of a page's small arrays as a table entry: bits 0-7 its rank k within array a, 8-11 the array, 16-31 its
// offset in a meta stage
__device__ __forceinline__ int piece_entry(const Params& p, int q) {
  int a, k;
  if (q < FIXED_PIECES) {
    a = p.m_piece[q] >> 8;
    k = p.m_piece[q] & 255;
  } else {                                   // outlier slots: key indices, key values, value indices, value values
    const int r = q - FIXED_PIECES;
    const int kk = 2 * p.m_nk;
    a = r < kk ? 8 + (r >= p.m_nk) : 10 + (r - kk >= p.m_nv);
    k = r < kk ? (r >= p.m_nk ? r - p.m_nk : r) : (r - kk >= p.m_nv ? r - kk - p.m_nv : r - kk);
  }
  return ((p.m_dst[a] + 16 * k) << 16) | (a << 8) | k;
}

// the small arrays of page-head `ph` (page `page`) into meta stage `st`, by one warp: one piece per lane and round
// (ptab: the CTA's table of the first PTAB pieces, piece_entry)
__device__ __forceinline__ void issue_meta(const Params& p, const int* ptab, uint8_t* st, int page, long long ph,
                                           int lane) {
#pragma unroll 1
  for (int q = lane; q < p.m_pieces; q += 32) {
    const int e = q < PTAB ? ptab[q] : piece_entry(p, q);
    const int a = (e >> 8) & 15, k = e & 255;
    const long long off = (((a == SLOT_ARRAY ? (long long)page : ph) * p.m_stride[a]) & ~15ll) + 16 * k;
    const long long rem = p.m_total[a] - off;
    const int bytes = rem >= 16 ? 16 : (int)max(rem, 0ll);
    cp_async16(st + (int)((unsigned)e >> 16), p.m_base[a] + (bytes > 0 ? off : 0), bytes);
  }
}

}  // namespace moekv_v7
