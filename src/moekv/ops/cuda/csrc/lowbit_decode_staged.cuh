// Staged pages (the tail page, sink pages: full precision in the staging slots) on the tensor cores (v11).
//
// Every warp of the CTA takes 16-token tiles w, w + W, ... of each staged page of its split and folds each tile's
// online-softmax state into its own merge state (mo[w], ml[w]: written by the merge just before), so the warps
// work side by side and meet no barrier; combine_warps then sees the staged tokens inside the warps' states.
// v10 ran them on CUDA cores (thread = token, then thread = channel, four CTA barriers per page): about twice a
// warp's whole page loop on the last split's critical path at B=1 16k (session 21's B=1 profile).
//
// Per tile: scores = K (16 tokens x 128 channels, A) . q (B: the fp16 query, head = column) in 8 k-steps; values:
// o[ch][head] += V^T (A: 16 channels x 16 tokens per m-tile, 8 m-tiles) . p (B). Channel orders are chosen so a
// lane's operands are whole 16-byte rows: a lane's four key k-slots of k-steps 2b and 2b + 1 are channels
// 32b + 8c + 0..7 of one load (the query's B fragment the same channels of its fp16 row), and value m-tile i's
// rows g / g + 8 are channels 16g + 2i / 16g + 2i + 1 (the accumulators' channel order of the page loop), two
// 16-byte loads of a token row per lane. bf16 staging: bf16 MMAs with the query and the probabilities split in a
// high and a low bf16 part (two MMAs each; the fp16 query is exact in the two, the probabilities to ~16 bits).
#pragma once
#include <type_traits>
#include "lowbit_decode.cuh"

namespace moekv_v7 {

// an fp16 pair as the high and low parts of a bf16 pair (exact: an fp16 significand fits in two bf16 ones)
__device__ __forceinline__ void split_half2(uint32_t x, uint32_t& hi, uint32_t& lo) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&x));
  const __nv_bfloat162 h = __floats2bfloat162_rn(f.x, f.y);
  const float2 hf = __bfloat1622float2(h);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = pack_bf162(f.x - hf.x, f.y - hf.y);
}

// C += A . B in the staging dtype: fp16 operands as they are; bf16 A with B given as its high and low parts
template <typename QT>
__device__ __forceinline__ void staged_mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           uint32_t bh0, uint32_t bh1, uint32_t bl0, uint32_t bl1) {
  if constexpr (std::is_same<QT, __half>::value) {
    mma16816(c, a0, a1, a2, a3, bh0, bh1);
  } else {
    mma16816_bf16(c, a0, a1, a2, a3, bh0, bh1);
    mma16816_bf16(c, a0, a1, a2, a3, bl0, bl1);
  }
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// The query's B fragments of the staged MMAs (column g = head g; k-steps 2b / 2b + 1 = channels 32b + 8c + 0..3 /
// 4..7); bf16 staging: as high and low parts. qn_tab: the query in fp16, natural channel order, zero rows for
// heads >= G.
template <typename QT>
__device__ __forceinline__ void staged_query(const __half* qn_tab, uint32_t (&bh)[8][2], uint32_t (&bl)[8][2]) {
  constexpr bool FP16 = std::is_same<QT, __half>::value;
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    const uint4 q = *reinterpret_cast<const uint4*>(qn_tab + g * D + 32 * b + 8 * c);
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      uint32_t& h = bh[2 * b + (r >> 1)][r & 1];
      uint32_t& l = bl[2 * b + (r >> 1)][r & 1];
      if constexpr (FP16) { h = w[r]; l = 0u; } else { split_half2(w[r], h, l); }
    }
  }
}

// A 16-token tile of a staged page in registers: key rows g, g + 8 (channels 32b + 8c ..), value rows 2c, 2c + 1,
// 2c + 8, 2c + 9 (channels 16g ..; rows past the context zero: staging may hold anything there).
struct StagedTile {
  uint4 kr[2][4], vr[4][2];
};

template <typename QT>
__device__ __forceinline__ void load_staged_tile(const QT* base_k, const QT* base_v, long long row_stride, int t0,
                                                 int tok0, int ctx, StagedTile& tl) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int b = 0; b < 4; ++b)
      tl.kr[r][b] = *reinterpret_cast<const uint4*>(base_k + (t0 + g + 8 * r) * row_stride + 32 * b + 8 * c);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int t = t0 + 2 * c + (j & 1) + 8 * (j >> 1);
    const bool ok = tok0 - t0 + t < ctx;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const uint4 v = *reinterpret_cast<const uint4*>(base_v + t * row_stride + 16 * g + 8 * hh);
      tl.vr[j][hh] = ok ? v : make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// Fold a loaded tile (tok0: its first token in the sequence) into a warp's merge state: mo_w [NH][D] un-normalised
// outputs, mx [NH] max, sm [NH] sum (lane g == 0 writes those). qms0 / qms1: the score scale of heads 2c, 2c + 1.
template <typename QT>
__device__ __forceinline__ void fold_staged_tile(const StagedTile& tl, int tok0, int ctx, int G, float qms0, float qms1,
                                                 const uint32_t (&bh)[8][2], const uint32_t (&bl)[8][2], float* mo_w,
                                                 float* mx, float* sm) {
  constexpr bool FP16 = std::is_same<QT, __half>::value;
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int h0 = 2 * c, h1 = 2 * c + 1;
  // ---- scores: rows g / g + 8 = tokens, columns 2c, 2c + 1 = heads
  float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    staged_mma<QT>(s, tl.kr[0][b].x, tl.kr[1][b].x, tl.kr[0][b].y, tl.kr[1][b].y, bh[2 * b][0], bh[2 * b][1],
                   bl[2 * b][0], bl[2 * b][1]);
    staged_mma<QT>(s, tl.kr[0][b].z, tl.kr[1][b].z, tl.kr[0][b].w, tl.kr[1][b].w, bh[2 * b + 1][0], bh[2 * b + 1][1],
                   bl[2 * b + 1][0], bl[2 * b + 1][1]);
  }
  const bool v0 = tok0 + g < ctx, v1 = tok0 + g + 8 < ctx;
  s[0] = v0 ? s[0] * qms0 : NEG_INF; s[1] = v0 ? s[1] * qms1 : NEG_INF;
  s[2] = v1 ? s[2] * qms0 : NEG_INF; s[3] = v1 ? s[3] * qms1 : NEG_INF;
  float m0 = fmaxf(s[0], s[2]), m1 = fmaxf(s[1], s[3]);
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
    m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, o));
    m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, o));
  }
  const float u0 = m0 == NEG_INF ? 0.f : m0, u1 = m1 == NEG_INF ? 0.f : m1;
  const float p0 = ex2(s[0] - u0), p1 = ex2(s[1] - u1), p2 = ex2(s[2] - u0), p3 = ex2(s[3] - u1);
  float l0 = p0 + p2, l1 = p1 + p3;
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o);
  }
  // ---- p as the value MMAs' B fragments (k = tokens, column = head): transposed tiles of the score layout
  uint32_t ph0, ph1, pl0 = 0u, pl1 = 0u;
  if constexpr (FP16) {
    ph0 = movmatrix_trans(pack_half2(p0, p1));
    ph1 = movmatrix_trans(pack_half2(p2, p3));
  } else {
    const __nv_bfloat162 a = __floats2bfloat162_rn(p0, p1), b2 = __floats2bfloat162_rn(p2, p3);
    const float2 af = __bfloat1622float2(a), bf = __bfloat1622float2(b2);
    ph0 = movmatrix_trans(*reinterpret_cast<const uint32_t*>(&a));
    ph1 = movmatrix_trans(*reinterpret_cast<const uint32_t*>(&b2));
    pl0 = movmatrix_trans(pack_bf162(p0 - af.x, p1 - af.y));
    pl1 = movmatrix_trans(pack_bf162(p2 - bf.x, p3 - bf.y));
  }
  // ---- fold into the merge state: the tile's weights against the new max per head
  const float M0 = h0 < G ? mx[h0] : 0.f, M1 = h1 < G ? mx[h1] : 0.f;
  const float L0 = h0 < G ? sm[h0] : 0.f, L1 = h1 < G ? sm[h1] : 0.f;
  const float n0 = fmaxf(M0, m0), n1 = fmaxf(M1, m1);
  const float nu0 = n0 == NEG_INF ? 0.f : n0, nu1 = n1 == NEG_INF ? 0.f : n1;
  const float a0 = ex2(M0 - nu0), a1 = ex2(M1 - nu1), b0 = ex2(u0 - nu0), b1 = ex2(u1 - nu1);
  __syncwarp();                                      // every lane has read mx / sm before lane g == 0 writes them
#pragma unroll
  for (int ii = 0; ii < 8; ++ii) {                   // value m-tile ii: channels 16g + 2ii (+1)
    uint32_t a[4];
#pragma unroll
    for (int q = 0; q < 2; ++q) {                    // tokens (2c, 2c + 1), then (2c + 8, 2c + 9)
      const uint32_t x = word_of(tl.vr[2 * q][ii >> 2], ii & 3), y = word_of(tl.vr[2 * q + 1][ii >> 2], ii & 3);
      a[2 * q] = prmt(x, y, 0x5410);                 // channel 16g + 2ii of both tokens
      a[2 * q + 1] = prmt(x, y, 0x7632);             // channel 16g + 2ii + 1
    }
    float o[4] = {0.f, 0.f, 0.f, 0.f};
    staged_mma<QT>(o, a[0], a[1], a[2], a[3], ph0, ph1, pl0, pl1);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = (e & 1) ? h1 : h0, ch = 16 * g + 2 * ii + (e >> 1);
      if (h < G) {
        float* dst = mo_w + h * D + ch;
        *dst = fmaf(*dst, (e & 1) ? a1 : a0, o[e] * ((e & 1) ? b1 : b0));
      }
    }
  }
  if (g == 0) {
    if (h0 < G) { mx[h0] = n0; sm[h0] = fmaf(L0, a0, l0 * b0); }
    if (h1 < G) { mx[h1] = n1; sm[h1] = fmaf(L1, a1, l1 * b1); }
  }
  __syncwarp();
}

// The staging rows of a staged page's 16-row tile t0 for kv head kvh (blocks: the page's block_map row). The tile's
// rows lie in one staging block (blocks of >= 32 rows); the pointer is shifted by the block's first row so that row
// t of the page (t in that block) is base + t * num_kv_heads * D. A block not held (-1: past the context) reads
// block 0: in bounds, its rows masked or skipped by the callers.
template <typename QT>
__device__ __forceinline__ const QT* staged_rows(const Params& p, const void* staging, const int* blocks, int t0,
                                                 int kvh) {
  const int blk = max(blocks[t0 >> p.stage_shift], 0);
  const long long shift_rows = ((long long)blk << p.stage_shift) - (t0 & ~p.stage_mask);
  return reinterpret_cast<const QT*>(staging) + shift_rows * p.num_kv_heads * D + (long long)kvh * D;
}

// Fold the staged pages of this CTA's split (staged[0..num_staged): indices into the split's table) into the
// warps' merge states: mo [W][NH][D] un-normalised outputs, ml [W][NH] max then [W][NH] sum. qn_tab: the query
// in fp16, natural channel order, zero rows for heads >= G; qmax_tab: its per-head scale. All threads call it.
// pre_index (8-warp CTAs): the table index of the tail page whose tile `warp` each warp loaded before the page
// loop (pre), -1 for none.
template <typename QT, int W>
__device__ __forceinline__ void staged_pages_tc(const Params& p, const int* table, const int* staged, int num_staged,
                                                int first, int ctx, int kvh, int G, const __half* qn_tab,
                                                const float* qmax_tab, float* mo, float* ml, int pre_index,
                                                const StagedTile& pre) {
  if (num_staged == 0) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, c = lane & 3;
  uint32_t bh[8][2], bl[8][2];
  staged_query<QT>(qn_tab, bh, bl);
  const int h0 = 2 * c, h1 = 2 * c + 1;                 // this lane's score / output columns
  const float qms0 = h0 < G ? qmax_tab[h0] * p.qk_scale : 0.f, qms1 = h1 < G ? qmax_tab[h1] * p.qk_scale : 0.f;
  const long long row_stride = (long long)p.num_kv_heads * D;
  float* mo_w = mo + warp * NH * D;
  float* mx = ml + warp * NH;
  float* sm = ml + (W + warp) * NH;
  for (int k = 0; k < num_staged; ++k) {
    const int i = staged[k], page_index = first + i;
    if (W * 16 == P && i == pre_index) {               // its tiles are in the warps' registers already
      // (a tile past the context was not loaded: it adds nothing)
      if (page_index * P + 16 * warp < ctx)
        fold_staged_tile<QT>(pre, page_index * P + 16 * warp, ctx, G, qms0, qms1, bh, bl, mo_w, mx, sm);
      continue;
    }
    const int* blocks = p.block_map + (long long)table[i] * p.stage_nb;
    for (int tile = warp; tile < P / 16; tile += W) {
      const int t0 = 16 * tile, tok0 = page_index * P + t0;
      if (tok0 >= ctx) continue;                         // past the context (its block may not be held): adds nothing
      StagedTile tl;
      load_staged_tile<QT>(staged_rows<QT>(p, p.staging_k, blocks, t0, kvh),
                           staged_rows<QT>(p, p.staging_v, blocks, t0, kvh), row_stride, t0, tok0, ctx, tl);
      fold_staged_tile<QT>(tl, tok0, ctx, G, qms0, qms1, bh, bl, mo_w, mx, sm);
    }
  }
}

// 8-warp CTAs (one per SM: registers to spare): the split that holds the sequence's partly filled last page (when
// staged) loads its 16-token tile `warp` per warp before the page loop, so the loads' latency passes
// under the page chain instead of after it (docs/attention-kernels.md, v14 item 6a). Returns the page's index in
// the split's table, or -1.
template <typename QT, int W>
__device__ __forceinline__ int preload_tail(const Params& p, const int* table, int first, int n, int num_pages,
                                            int ctx, int kvh, StagedTile& pre) {
  if constexpr (keeps_query<W>() && W * 16 == P) {
    const int last = num_pages - 1, warp = threadIdx.x >> 5;
    if (ctx % P == 0 || last < first || last >= first + n) return -1;
    const int* blocks = p.block_map + (long long)table[last - first] * p.stage_nb;
    if (blocks[0] < 0) return -1;
    const int t0 = 16 * warp, tok0 = last * P + t0;
    if (tok0 < ctx)                                      // a tile past the context: its block may not be held
      load_staged_tile<QT>(staged_rows<QT>(p, p.staging_k, blocks, t0, kvh),
                           staged_rows<QT>(p, p.staging_v, blocks, t0, kvh), (long long)p.num_kv_heads * D, t0, tok0,
                           ctx, pre);
    return last - first;
  }
  return -1;
}

}  // namespace moekv_v7
