// The page loop of one warp (v9): its pages w, w + WARPS, ... of the CTA's split, 32-token chunks at a time.
//
// Copies (cp.async, 16 bytes per lane, one commit group per fill) walk a ring of RING_BUFS chunk buffers:
// fills go K_0, V_0, K_1, V_1, ...; K_{q+1} is issued at the top of chunk q into the buffer V_{q-1} left, V_{q+1}
// right after chunk q's key MMAs into the buffer K_q left. A page's small arrays come one page ahead (meta ring).
// Waits: before chunk q's keys, everything but the latest group (V_q); before its values, all but the two latest
// (K_{q+1}, V_{q+1}). A __syncwarp after each wait makes the other lanes' copies visible.
#pragma once
#include "lowbit_decode_slots.cuh"

namespace moekv_v7 {

// STACK 2 (GQA groups of at most 4): the B operand's columns 4..7 repeat heads 0..3, so after the key MMAs the
// lanes of columns 0..3 keep tile 0's scores (tokens 0..15 of the chunk) and those of columns 4..7 tile 1's
// (tokens 16..31): 4 real scores per lane instead of 8 with 4 padding heads. STACK 1: 8 heads, both tiles.
// The CTA's split (SplitRange): pages [first, first + n) of the sequence in its table. Page-per-warp CTAs and plain
// chunk-split CTAs: pages_per_split pages a split (0: ceil(pages / splits), sized on the device). Work split (v15,
// Params::work_tail > 0, chunk-split CTAs only; docs/attention-kernels.md item 7): the sequence's work is
// U = CHUNKS x (full pages) + work_tail chunk units when its last page is partly filled (that page is staged: a page
// is quantized when it fills), and split s takes units [s U / splits, (s + 1) U / splits): its chunk units of the
// full pages, u_lo .. u_hi - 1 counted from chunk 0 of its first page, plus the partly filled page when the split
// holds that page's first unit (tail). Computed from ctx alone: graph-safe, every split of a sequence agrees.
struct SplitRange {
  int first, n;    // the split's pages (the table)
  int u_lo, u_hi;  // CS: the chunk units its warps share (page u / CHUNKS of the table, chunk u % CHUNKS)
  bool tail;       // work split: the table's last page is the partly filled last page, visited after the runs
};

template <bool CS>
__device__ __forceinline__ SplitRange split_range(const Params& p, int ctx, int split) {
  SplitRange r{};
  const int num_pages = (ctx + P - 1) / P;
  if (CS && p.work_tail > 0) {
    const int partial = ctx % P != 0 ? 1 : 0, full = num_pages - partial, fu = full * CHUNKS;
    const long long units = fu + partial * p.work_tail;
    const int a = (int)(split * units / p.num_splits), b = (int)((split + 1) * units / p.num_splits);
    const int ca = min(a, fu), cb = min(b, fu);
    r.tail = partial && a <= fu && fu < b;
    r.first = cb > ca ? ca / CHUNKS : full;
    r.n = (cb > ca ? (cb - 1) / CHUNKS - r.first + 1 : 0) + (r.tail ? 1 : 0);
    r.u_lo = cb > ca ? ca - CHUNKS * r.first : 0;
    r.u_hi = cb > ca ? cb - CHUNKS * r.first : 0;
  } else {
    const int pps = p.pages_per_split > 0 ? p.pages_per_split : (num_pages + p.num_splits - 1) / p.num_splits;
    r.first = split * pps;
    r.n = max(min(r.first + pps, num_pages) - r.first, 0);
    r.u_lo = 0;
    r.u_hi = r.n * CHUNKS;
    r.tail = false;
  }
  return r;
}

// The warp's share of its split (WarpRange): pages w, w + W, ... whole (CS false), or (CS: chunk-split CTAs for small
// batches, docs/attention-kernels.md v14 item 6c) the split's chunk units u0 .. u1 - 1 of [u_lo, u_hi) (page u /
// CHUNKS, chunk u % CHUNKS) in one contiguous run, so a page's chunks spread over the warps and each warp's chain is
// shorter. Work split: the last warp's run ends at the last full page and goes on to the split's partly filled page
// (SplitRange::tail, the table's last page, whole: a staged page ends the run at its first chunk).
struct WarpRange {
  int my_n;        // pages the warp visits
  int jp0;         // CS: the first one's index in the split's table
  int k0, k1;      // CS: the chunk the first page starts at, the chunk after the last page's last
};

template <int W, bool CS>
__device__ __forceinline__ WarpRange warp_range(const SplitRange& sr, int warp) {
  WarpRange r{};
  if constexpr (CS) {
    const int U = sr.u_hi - sr.u_lo, u0 = sr.u_lo + warp * U / W, u1 = sr.u_lo + (warp + 1) * U / W;
    const int tail = sr.tail && warp == W - 1 ? 1 : 0;
    // (with a tail, the last run ends at a page boundary (k1 = CHUNKS), and the tail page follows it)
    r.jp0 = u1 > u0 ? u0 / CHUNKS : 0;
    r.my_n = (u1 > u0 ? (u1 - 1) / CHUNKS - r.jp0 + 1 : 0) + tail;
    r.k0 = u1 > u0 ? u0 % CHUNKS : 0;
    r.k1 = u1 > u0 && !tail ? (u1 - 1) % CHUNKS + 1 : CHUNKS;
  } else {
    r.my_n = sr.n > warp ? (sr.n - 1 - warp) / W + 1 : 0;
    r.k0 = 0;
    r.k1 = CHUNKS;
  }
  return r;
}

template <int B, int STACK, int W, bool CS>
__device__ __forceinline__ void warp_pages(const Params& p, const SmemPlan& plan, uint8_t* wb, const int* table,
                                           const int* ptab, const uint8_t* qf_tab, const uint8_t* qp_tab, int first, int ctx, int kvh,
                                           int warp, int lane, const WarpRange& wr, int ocK, int ocV, float qms0, float qms1,
                                           WarpState& st) {
  const int my_n = wr.my_n;
  using L = Layout<B>;
  const int g = lane >> 2, c = lane & 3;
  CopyPlan<B> copies;
  copies.init(lane);
  // ring buffer b (the ring starts the warp's area: smem_plan's ring = 0; a buffer is Layout<B>::BUF_BYTES), as a
  // generic pointer for the loads and as a shared-space address for the copies
  auto buf = [&](int b) { return wb + b * Layout<B>::BUF_BYTES; };
  const uint32_t ring_s = smem_addr(wb);
  auto buf_s = [&](int b) { return ring_s + b * Layout<B>::BUF_BYTES; };
  const int lane16 = lane * 16;
  auto meta = [&](int jj) { return wb + plan.meta + (jj & 1) * plan.meta_bytes; };
  auto index_of = [&](int jj) { return CS ? wr.jp0 + jj : warp + W * jj; };   // in the split's table
  auto page_of = [&](int jj) { return table[index_of(jj)]; };
  // low-bit storage index of a page-head: a staging-only id (>= lowbit_pages, always staged) reads the last
  // page's storage in the pipeline's prefetches, never used
  auto ph_of = [&](int page) { return (long long)min(page, p.last_lowbit_page) * p.num_kv_heads + kvh; };
  uint8_t* prep = wb + plan.prep;
  uint8_t* scr = wb + plan.scratch;
  int* wstaged = reinterpret_cast<int*>(wb + plan.staged);
  if (my_n <= 0) return;
  const float sa0 = qms0 * 16777216.f, sa1 = qms1 * 16777216.f;   // the codes' unit 2^-24 times the score scale
  {
    const int page = page_of(0);
    issue_meta(p, ptab, meta(0), page, ph_of(page), lane);
    issue_chunk<B>(p, copies, buf_s(0), chunk_offset<B>(ph_of(page), wr.k0) + lane16, false);
    cp_commit();
    issue_chunk<B>(p, copies, buf_s(1), chunk_offset<B>(ph_of(page), wr.k0) + lane16, true);
    cp_commit();
  }
  int kb = 0;                                    // ring buffer of K_q (V_q: kb + 1, the next fill: kb + 2, mod 3)
  // CORR (stacked scores, no key outliers): value outliers go to fp32 rows corr[D][4 heads] in the one-hot tile's
  // place, folded into the accumulators after the loop; else one-hot MMAs into the accumulators
  // int3 and int2 (int4 stays on one-hot MMAs: with them it measured 1-7% slower except at B=128 in session 25,
  // attention-ab-s25-stack.md, as in session 20)
  const bool CORR = B != 4 && STACK == 2 && p.k_cap == 0;
  bool corr_live = false;
  // the corrections are held relative to a max of their own, mc (<= the running max m, per head of the lane), and
  // rescaled only when m outgrows it by 2^CORR_SPAN (session 25: rescaling them with every new max held 3.3% of the
  // stall samples); a slot adds r * p * 2^(m - mc), the fold after the loop multiplies by 2^(mc - m)
  float mc0 = NEG_INF, mc1 = NEG_INF;
  for (int jj = 0; jj < my_n; ++jj) {
    const int page = page_of(jj);
    const long long ph = ph_of(page);
    const int page_index = first + index_of(jj);
    const int kbeg = CS && jj == 0 ? wr.k0 : 0, kend = CS && jj == my_n - 1 ? wr.k1 : CHUNKS;   // this page's chunks
    const bool full_page = (page_index + 1) * P <= ctx;
    const uint8_t* mt = meta(jj);
    const bool has_next = jj + 1 < my_n;
    const int next_page = has_next ? page_of(jj + 1) : page;
    // code offsets of this page-head's chunk 0 and the next page-head's: chunk q + 1's fills take one or the other
    const long long page_off = chunk_offset<B>(ph, 0) + lane16, next_off = chunk_offset<B>(ph_of(next_page), 0) + lane16;
    int kcount = 0, vcount = 0;
    int* kbd = reinterpret_cast<int*>(prep + PREP_BOUNDS);
    int* vbd = kbd + CHUNKS + 1;
    float sb0 = 0.f, sb1 = 0.f;                  // the score's bias: q . Z times the score scale
    bool staged = false;
#pragma unroll 1
    for (int k = kbeg; k < kend; ++k) {
      const int vbuf = kb == 2 ? 0 : kb + 1, nbuf = kb == 0 ? 2 : kb - 1;
      const bool more = k + 1 < kend || has_next;              // a next chunk (K_{q+1}, V_{q+1}) to fill
      const long long noff = k + 1 < kend ? page_off + (k + 1) * (CHUNK * Bits<B>::WORDS * 4) : next_off;
      cp_wait<1>();                              // K_q (and the page's small arrays) landed
      __syncwarp();
      {                                          // K_{q+1}; with the first chunk, the next page's small arrays
        if (more) issue_chunk<B>(p, copies, buf_s(nbuf), noff, false);
        if (k == kbeg && has_next) issue_meta(p, ptab, meta(jj + 1), next_page, ph_of(next_page), lane);
        cp_commit();
      }
      if (k == kbeg) {                           // ---- the page's prep
        const int* blocks = reinterpret_cast<const int*>(mt + L::SLOT + ((page * p.slot_stride) & 15));
        staged = blocks[0] >= 0;
        if (staged) {                            // staged page: its low-bit storage is stale; the CTA does it later
          // listed once: by the warp whose run holds the page's chunk 0 (every warp when whole pages)
          if (lane == 0 && kbeg == 0) { const int s = wstaged[0]; if (s < STAGED_MAX) wstaged[1 + s] = index_of(jj); wstaged[0] = s + 1; }
          // its rows of this kv head (16-bit, 256 bytes each) into L2 now, so the tensor-core pass after the loop
          // (lowbit_decode_staged.cuh) finds them there instead of paying an HBM round trip on the critical path
          const long long rs = (long long)p.num_kv_heads * D * 2, off = (long long)kvh * D * 2;
          const uint8_t* bk = reinterpret_cast<const uint8_t*>(p.staging_k) + off;
          const uint8_t* bv = reinterpret_cast<const uint8_t*>(p.staging_v) + off;
#pragma unroll
          for (int r = lane; r < P; r += 32) {
            const int blk = blocks[r >> p.stage_shift];        // rows of blocks not held: past the context
            if (blk >= 0) {
              const long long row = ((long long)blk << p.stage_shift) + (r & p.stage_mask);
              prefetch_l2(bk + row * rs); prefetch_l2(bk + row * rs + 128);
              prefetch_l2(bv + row * rs); prefetch_l2(bv + row * rs + 128);
            }
          }
        } else {
          kcount = p.k_cap > 0 ? min((int)*reinterpret_cast<const int16_t*>(mt + L::K_COUNT + ((ph * 2) & 15)), p.k_cap) : 0;
          vcount = p.v_cap > 0 ? min((int)*reinterpret_cast<const int16_t*>(mt + L::V_COUNT + ((ph * 2) & 15)), p.v_cap) : 0;
          uint32_t sp[16], qf[16];
          channel_pairs<B>(sp, mt + L::K_SCALE + 64 * c);
          load_frag16(qf, qf_tab, lane);
#pragma unroll
          for (int b4 = 0; b4 < 4; ++b4) {
            uint32_t o[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const __half2 prod = __hmul2(*reinterpret_cast<const __half2*>(&qf[4 * b4 + r]),
                                           *reinterpret_cast<const __half2*>(&sp[4 * b4 + r]));
              o[r] = *reinterpret_cast<const uint32_t*>(&prod);
            }
            *reinterpret_cast<uint4*>(prep + PREP_BFRAG + (b4 * 32 + lane) * 16) = make_uint4(o[0], o[1], o[2], o[3]);
          }
          // q . Z per head on the tensor cores: every A row is the zero row, B the query pairs
          uint32_t zp[16], qp[16];
          channel_pairs<B>(zp, mt + L::K_ZERO + 64 * c);
          load_frag16(qp, qp_tab, lane);
          float bacc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int s = 0; s < 8; ++s) mma16816(bacc, zp[2 * s], zp[2 * s], zp[2 * s + 1], zp[2 * s + 1], qp[2 * s], qp[2 * s + 1]);
          sb0 = sa0 * (bacc[0] * 0x1p-24f); sb1 = sa1 * (bacc[1] * 0x1p-24f);   // qms * bacc
          // each token's value scale / zero point
          const float base = __half2float(*reinterpret_cast<const __half*>(mt + L::V_BASE + ((ph * 2) & 15)));
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int t = lane + 32 * r;
            const float rel = ex2(-(float)mt[L::V_SCALE + t] * (1.f / 16.f));
            const float sv = base * rel;
            const float zv = -(sv * (float)mt[L::V_ZERO + t]) * (1.f / (float)(1 << (8 - B)));
            reinterpret_cast<float2*>(prep + PREP_VSZ)[t] = make_float2(sv, zv);
          }
          if (kcount > 0) chunk_bounds(slot_view(mt, L::FIXED, L::FIXED + ocK, ph, p.k_cap), kcount, lane, kbd);
          if (vcount > 0)
            chunk_bounds(slot_view(mt, L::FIXED + 2 * ocK, L::FIXED + 2 * ocK + ocV, ph, p.v_cap), vcount, lane, vbd);
          __syncwarp();
        }
      }
      // chunk-split CTAs: a staged page that ends the warp's run ends it here (its chunks add nothing: the CTA folds
      // the page after the loop); the copies in flight are waited for after the loop
      if (CS && staged && !has_next) break;
      if (staged) {                              // keep the ring's fills and waits in step
        if (more) {
          __syncwarp();
          issue_chunk<B>(p, copies, buf_s(kb), noff, true);
        }
        cp_commit();
        cp_wait<2>();
        kb = nbuf;
        continue;
      }
      const uint8_t* kst = buf(kb);
      // ---- keys -> scores
      float cs[2][4];
      {
        uint32_t bq[16];
        load_frag16(bq, prep + PREP_BFRAG, lane);
        const LaneWords<lane_word_count<B>()> klw = lane_words<lane_word_count<B>()>(kst, lane16);
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          uint32_t ka[16], kb2[16];
          unpack_lane_pair<B>(ka, kb2, klw, m);   // rows 2m and 2m + 1 of the lane: m-tile m's rows tau(g), + 8
          cs[m][0] = cs[m][1] = cs[m][2] = cs[m][3] = 0.f;
#pragma unroll
          for (int s = 0; s < 8; ++s) mma16816(cs[m], ka[2 * s], kb2[2 * s], ka[2 * s + 1], kb2[2 * s + 1], bq[2 * s], bq[2 * s + 1]);
        }
      }
      if (kcount > 0) {                          // key outliers: scores += onehot(token, slot) . (r * qn)
        const SlotView sv = slot_view(mt, L::FIXED, L::FIXED + ocK, ph, p.k_cap);
        const int lo = kbd[k], hi = kbd[k + 1];
        __half* onehot = reinterpret_cast<__half*>(scr + W_ONEHOT);
        for (int base = lo; base < hi; base += SLOT_TILE) {
          const int s = base + lane;
          const bool live = lane < SLOT_TILE && s < hi;
          const int idx = live ? (int)sv.idx[s] : 0;
          const int tok = live ? idx / D - CHUNK * k : 0, ch = live ? idx % D : 0;
          const float r = live ? __half2float(sv.val[s]) : 0.f;
          const int krow = (tok & 16) + tau<B>(tok & 15);
          if (live) onehot[krow * SLOT_TILE + lane] = __ushort_as_half((unsigned short)1);   // 2^-24
          __syncwarp();
          const uint32_t b0 = slot_operand(r, ch, c, [&](int cc) { return qn_at<B>(qp_tab, g, cc); });
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            uint32_t a[2];
            ldmatrix_x2(a, onehot + (16 * m + (lane & 15)) * SLOT_TILE);
            mma1688(cs[m], a[0], a[1], b0);
          }
          __syncwarp();
          if (live) onehot[krow * SLOT_TILE + lane] = __ushort_as_half((unsigned short)0);
          __syncwarp();
        }
      }
      __syncwarp();                              // every lane is done with K_q: V_{q+1} may overwrite it
      if (more) issue_chunk<B>(p, copies, buf_s(kb), noff, true);
      cp_commit();
      cp_wait<2>();                              // V_q landed
      __syncwarp();
      const uint8_t* vst = buf(vbuf);
      const LaneWords<lane_word_count<B>()> vlw = lane_words<lane_word_count<B>()>(vst, lane16);   // token pairs merged
      // ---- online softmax (base 2)
      constexpr int MT = 3 - STACK;                        // score tiles per lane
      const float2* vsz = reinterpret_cast<const float2*>(prep + PREP_VSZ) + CHUNK * k;
      const int tok0 = page_index * P + CHUNK * k;
      auto tok_of = [&](int m, int e) { return 16 * (STACK == 2 ? (c >> 1) : m) + tau<B>(g) + 8 * (e >> 1); };
      float sc[MT][4];
      float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float raw = STACK == 2 ? (c < 2 ? cs[0][e] : cs[1][e]) : cs[m][e];
          sc[m][e] = (e & 1) ? fmaf(raw, sa1, sb1) : fmaf(raw, sa0, sb0);
        }
      if (!full_page) {                                    // the sequence's last page: tokens past the context
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
          for (int e = 0; e < 4; ++e) sc[m][e] = tok0 + tok_of(m, e) < ctx ? sc[m][e] : NEG_INF;
      }
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (e & 1) mx1 = fmaxf(mx1, sc[m][e]); else mx0 = fmaxf(mx0, sc[m][e]);
        }
      // The running max moves only where some lane holds a score above it, so the reduction (four dependent shuffle
      // rounds) and the rescale run only then; otherwise the reduced max would equal the running one (exact). Past the
      // first chunks of a sequence a new max is rare (session 25: the shuffles held 7.5% of the stall samples).
      if (__any_sync(0xffffffffu, mx0 > st.m0 || mx1 > st.m1)) {
#pragma unroll
        for (int o = STACK == 2 ? 2 : 4; o < 32; o <<= 1) {
          mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
          mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
        }
        const float n0 = fmaxf(st.m0, mx0), n1 = fmaxf(st.m1, mx1);
        const float a0 = ex2(st.m0 - (n0 == NEG_INF ? 0.f : n0)), a1 = ex2(st.m1 - (n1 == NEG_INF ? 0.f : n1));
#pragma unroll
        for (int i2 = 0; i2 < 8; ++i2) { st.acc[i2][0] *= a0; st.acc[i2][2] *= a0; st.acc[i2][1] *= a1; st.acc[i2][3] *= a1; }
        st.l0 *= a0; st.z0 *= a0; st.l1 *= a1; st.z1 *= a1;
        if (CORR && corr_live && __any_sync(0xffffffffu, n0 - mc0 > CORR_SPAN || n1 - mc1 > CORR_SPAN)) {
          scale_corrections(reinterpret_cast<float*>(scr + W_ONEHOT), g, c, mc0 == NEG_INF ? 0.f : ex2(mc0 - n0),
                            mc1 == NEG_INF ? 0.f : ex2(mc1 - n1));
          mc0 = n0; mc1 = n1;
        }
        st.m0 = n0; st.m1 = n1;
      }
      const float u0 = st.m0 == NEG_INF ? 0.f : st.m0, u1 = st.m1 == NEG_INF ? 0.f : st.m1;
      uint32_t pb[2][2];                                   // PV B fragments per k-step (= QK m-tile)
      __half2* ptile = reinterpret_cast<__half2*>(scr + W_PTILE);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        float pr[4], ps[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = tok_of(m, e);
          pr[e] = ex2(sc[m][e] - ((e & 1) ? u1 : u0));
          const float2 sz = vsz[tok];
          ps[e] = pr[e] * sz.x;
          if (e & 1) { st.l1 += pr[e]; st.z1 = fmaf(pr[e], sz.y, st.z1); } else { st.l0 += pr[e]; st.z0 = fmaf(pr[e], sz.y, st.z0); }
        }
        pb[m][0] = movmatrix_trans(pack_half2(ps[0], ps[1]));
        pb[m][1] = movmatrix_trans(pack_half2(ps[2], ps[3]));
        if (vcount > 0) {
          const int col = STACK == 2 ? (c & 1) : c;
          ptile[tok_of(m, 0) * (NH / 2) + col] = __floats2half2_rn(pr[0], pr[1]);
          ptile[tok_of(m, 2) * (NH / 2) + col] = __floats2half2_rn(pr[2], pr[3]);
        }
      }
      if (STACK == 2) {          // k-step 1 (tokens 16..31): columns 0..3 take what the lanes of columns 4..7 hold
        pb[1][0] = __shfl_xor_sync(0xffffffffu, pb[0][0], 16);
        pb[1][1] = __shfl_xor_sync(0xffffffffu, pb[0][1], 16);
      }
      // ---- values
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        uint32_t r01[16], r23[16];
        unpack_lane_pair<B>(r01, r23, vlw, m);     // token pairs (t0, t1) and (t0 + 8, t1 + 8) of m-tile m
#pragma unroll
        for (int i2 = 0; i2 < 8; ++i2) mma16816(st.acc[i2], r01[2 * i2], r01[2 * i2 + 1], r23[2 * i2], r23[2 * i2 + 1], pb[m][0], pb[m][1]);
      }
      if (CORR && vcount > 0) {  // value outliers into the warp's fp32 correction rows: corr[ch][head] += r * p
        const int lo = vbd[k], hi = vbd[k + 1];
        if (lo < hi) {
          __syncwarp();
          corr_live = true;
          if (mc0 == NEG_INF) mc0 = st.m0;
          if (mc1 == NEG_INF) mc1 = st.m1;
          const float f0 = st.m0 == NEG_INF ? 0.f : ex2(st.m0 - mc0), f1 = st.m1 == NEG_INF ? 0.f : ex2(st.m1 - mc1);
          // heads 0..3: lane 0 holds heads 0 and 1, lane 1 heads 2 and 3
          const float4 fac = make_float4(__shfl_sync(0xffffffffu, f0, 0), __shfl_sync(0xffffffffu, f1, 0),
                                         __shfl_sync(0xffffffffu, f0, 1), __shfl_sync(0xffffffffu, f1, 1));
          const SlotView sv = slot_view(mt, L::FIXED + 2 * ocK, L::FIXED + 2 * ocK + ocV, ph, p.v_cap);
          add_corrections(sv, lo, hi, k, lane, reinterpret_cast<float*>(scr + W_ONEHOT),
                          reinterpret_cast<const __half*>(scr + W_PTILE), scr + W_CLAIM, fac);
        }
      }
      if (!CORR && vcount > 0) { // value outliers: acc += onehot(row(ch), slot) * unit . (r * p[token][head])
        const int lo = vbd[k], hi = vbd[k + 1];
        if (lo < hi) {
          __syncwarp();
          const SlotView sv = slot_view(mt, L::FIXED + 2 * ocK, L::FIXED + 2 * ocK + ocV, ph, p.v_cap);
          __half* onehot = reinterpret_cast<__half*>(scr + W_ONEHOT);
          const __half* pt = reinterpret_cast<const __half*>(scr + W_PTILE);
          for (int base = lo; base < hi; base += SLOT_TILE) {
            const int s = base + lane;
            const bool live = lane < SLOT_TILE && s < hi;
            const int idx = live ? (int)sv.idx[s] : 0;
            const int tok = live ? idx / D - CHUNK * k : 0, ch = live ? idx % D : 0;
            const int vj = ch & 15, row = 16 * (vj >> 1) + (ch >> 4) + 8 * (vj & 1);
            const float r = live ? __half2float(sv.val[s]) : 0.f;
            if (live) onehot[row * SLOT_TILE + lane] = __ushort_as_half((unsigned short)(1u << value_off<B>(vj)));
            __syncwarp();
            const uint32_t b0 = slot_operand(r, tok, c, [&](int tt) { return __half2float(pt[tt * NH + g]); });
#pragma unroll
            for (int i2 = 0; i2 < 8; ++i2) {
              uint32_t a[2];
              ldmatrix_x2(a, onehot + (16 * i2 + (lane & 15)) * SLOT_TILE);
              mma1688(st.acc[i2], a[0], a[1], b0);
            }
            __syncwarp();
            if (live) onehot[row * SLOT_TILE + lane] = __ushort_as_half((unsigned short)0);
            __syncwarp();
          }
        }
      }
      kb = nbuf;
    }
  }
  if (CORR && __any_sync(0xffffffffu, corr_live))
    fold_corrections<B>(reinterpret_cast<const float*>(scr + W_ONEHOT), g, c, st,
                        st.m0 == NEG_INF || mc0 == NEG_INF ? 0.f : ex2(mc0 - st.m0),
                        st.m1 == NEG_INF || mc1 == NEG_INF ? 0.f : ex2(mc1 - st.m1));
}

}  // namespace moekv_v7
