// The v7 decode kernel (see lowbit_decode.cuh for the design).
#pragma once
#include "lowbit_decode_merge.cuh"

namespace moekv_v7 {

// One-hot outlier step: the slots [lo, hi) of this warp's chunk, SLOT_TILE at a time. For values, row(d) / unit(d)
// give the accumulator row of channel d and its unit; B = residual * p[token][head]. For keys, rows are tokens.
struct SlotView {
  const uint16_t* idx;   // page-head's slot indices (token * D + channel)
  const __half* val;     // residuals
};

__device__ __forceinline__ SlotView slot_view(const uint8_t* st, int off_idx, int off_val, long long ph, int cap) {
  const int shift = (int)((ph * cap * 2) & 15);
  return SlotView{reinterpret_cast<const uint16_t*>(st + off_idx + shift),
                  reinterpret_cast<const __half*>(st + off_val + shift)};
}

// slots of this warp: indices in [lo_idx, hi_idx) among the first `count` (sorted ascending)
__device__ __forceinline__ int2 warp_slot_range(const SlotView& sv, int count, int lo_idx, int hi_idx, int lane) {
  int lo = 0, hi = 0;
  for (int base = 0; base < count; base += 32) {
    const int s = base + lane;
    const int idx = s < count ? (int)sv.idx[s] : 0x7fffffff;
    lo += __popc(__ballot_sync(0xffffffffu, idx < lo_idx));
    hi += __popc(__ballot_sync(0xffffffffu, idx < hi_idx));
  }
  return make_int2(lo, hi);
}

// Prep of one page into a prep buffer (the CTA together): the per-channel key scale folded into the query as the
// B fragments (warp jb, lane fl: registers 4 jb .. 4 jb + 3), q . Z per head, each token's value scale / zero point,
// the page's flags; a staged page is recorded in `staged_list`.
template <int B>
__device__ __forceinline__ void prep_page(const Params& p, const uint8_t* mt, uint8_t* pp, long long ph, int i,
                                          const __half2 (&qf)[4], const __half* qn_tab, int* staged_list) {
  using L = Layout<B>;
  const int tid = threadIdx.x, fl = tid & 31, jb = tid >> 5, qh = tid >> 4, qd = (tid & 15) * 8;
  const __half* ks = reinterpret_cast<const __half*>(mt + L::K_SCALE);
  uint32_t bw[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int j = 4 * jb + r, lo = 32 * (fl & 3) + key_lo<B>(j), hi = lo + key_gap<B>();
    const __half2 sp = __halves2half2(ks[lo], ks[hi]);
    const __half2 prod = __hmul2(qf[r], sp);
    bw[r] = *reinterpret_cast<const uint32_t*>(&prod);
  }
  *reinterpret_cast<uint4*>(pp + PREP_BFRAG + (jb * 32 + fl) * 16) = make_uint4(bw[0], bw[1], bw[2], bw[3]);
  const uint4 zr = *reinterpret_cast<const uint4*>(mt + L::K_ZERO + qd * 2);
  const __half* zh = reinterpret_cast<const __half*>(&zr);
  const uint4 qr = *reinterpret_cast<const uint4*>(qn_tab + qh * D + qd);
  const __half* qh8 = reinterpret_cast<const __half*>(&qr);
  float bias = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) bias = fmaf(__half2float(qh8[k]), __half2float(zh[k]), bias);
#pragma unroll
  for (int o = 1; o < 16; o <<= 1) bias += __shfl_xor_sync(0xffffffffu, bias, o);
  if ((tid & 15) == 0) reinterpret_cast<float*>(pp + PREP_BIAS)[qh] = bias;
  const float base = __half2float(*reinterpret_cast<const __half*>(mt + L::V_BASE + ((ph * 2) & 15)));
  const float rel = ex2(-(float)mt[L::V_SCALE + tid] * (1.f / 16.f));
  const float sv = base * rel;
  const float zv = -(sv * (float)mt[L::V_ZERO + tid]) * (1.f / (float)(1 << (8 - B)));
  reinterpret_cast<float2*>(pp + PREP_VSZ)[tid] = make_float2(sv, zv);
  if (tid == 0) {
    const int slot = *reinterpret_cast<const int*>(mt + L::SLOT);
    const int kc = p.k_cap > 0 ? min((int)*reinterpret_cast<const int16_t*>(mt + L::K_COUNT + ((ph * 2) & 15)), p.k_cap) : 0;
    const int vc = p.v_cap > 0 ? min((int)*reinterpret_cast<const int16_t*>(mt + L::V_COUNT + ((ph * 2) & 15)), p.v_cap) : 0;
    int* flags = reinterpret_cast<int*>(pp + PREP_FLAGS);
    flags[0] = slot; flags[1] = kc; flags[2] = vc;
    if (slot >= 0) { const int k = staged_list[0]; if (k < 16) staged_list[1 + k] = i; staged_list[0] = k + 1; }
  }
}

// MINB: resident CTAs per SM the registers are capped for (4: <= 128 registers; int4's larger code stages fit 3).
template <int B, typename QT, int MINB>
__global__ void __launch_bounds__(THREADS, MINB) decode_kernel(const Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  using L = Layout<B>;
  const SmemPlan plan = smem_plan<B>(p.k_cap, p.v_cap);
  const int ocK = outlier_chunk_bytes(p.k_cap), ocV = outlier_chunk_bytes(p.v_cap);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
  const int split = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z;
  const int G = p.group;
  const long long q_row = p.query_start_loc[seq];
  const int ctx = p.context_lens[seq];
  const int num_pages = (ctx + P - 1) / P;
  const int pps = p.pages_per_split > 0 ? p.pages_per_split : (num_pages + p.num_splits - 1) / p.num_splits;
  const int first = split * pps;
  const int n = max(min(first + pps, num_pages) - first, 0);

  int* table = reinterpret_cast<int*>(smem + plan.table);
  __half* qn_tab = reinterpret_cast<__half*>(smem + plan.qn);
  float* qmax_tab = reinterpret_cast<float*>(smem + plan.qmax);
  const int* bt = p.block_tables + (long long)seq * p.stride_bt;
  for (int i = tid; i < n; i += THREADS) table[i] = bt[first + i];
  if (p.k_cap > 0 || p.v_cap > 0) {        // one-hot tiles start (and stay) zero
    uint4* w = reinterpret_cast<uint4*>(smem + plan.warp);
    for (int i = tid; i < WARPS * W_BYTES / 16; i += THREADS) w[i] = make_uint4(0, 0, 0, 0);
  }

  // ---- query: heads kvh * G + h, normalised per head (|qn| <= 1); thread: head tid / 16, channels 8 (tid % 16) + 0..7
  const int qh = tid >> 4, qd = (tid & 15) * 8;
  float qv[8];
  {
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
    for (int k = 0; k < 8; ++k) { qv[k] = qv[k] / mx; qn_tab[qh * D + qd + k] = __float2half_rn(qv[k]); }
    if ((tid & 15) == 0) qmax_tab[qh] = mx;
  }
  __syncthreads();
  // prep constants: B-fragment registers 4 jb .. 4 jb + 3 of lane fl (head fl / 4, key block fl % 4)
  const int fl = lane, jb = warp;
  __half2 qf[4];                                                        // qn * 2^-off of the 4 registers' channels
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int j = 4 * jb + r, o = key_off<B>(j);
    const int lo = 32 * (fl & 3) + key_lo<B>(j), hi = lo + key_gap<B>();
    const float unit = __int_as_float((127 - o) << 23);                 // 2^-o
    qf[r] = __floats2half2_rn(__half2float(qn_tab[(fl >> 2) * D + lo]) * unit,
                              __half2float(qn_tab[(fl >> 2) * D + hi]) * unit);
  }
  const float qms0 = qmax_tab[2 * c] * p.qk_scale, qms1 = qmax_tab[2 * c + 1] * p.qk_scale;   // score scale

  // ---- ring prologue: codes of page 0, the small arrays of pages 0 and 1; prep of page 0
  CopyPlan<B> copies;
  copies.init(tid);
  auto code_stage = [&](int k) { return smem + plan.ring + (k & 1) * plan.code_bytes; };
  auto meta_stage = [&](int k) { return smem + plan.meta + (k % META_STAGES) * plan.meta_bytes; };
  auto prep_buf = [&](int k) { return smem + plan.prep + (k & 1) * PREP_BYTES; };
  auto page_head = [&](int k) { return (long long)table[k] * p.num_kv_heads + kvh; };
  int* staged_list = reinterpret_cast<int*>(smem + plan.staged);        // [0]: count, then page indices
  if (tid == 0) staged_list[0] = 0;
  if (n > 0) {
    issue_codes<B>(p, copies, code_stage(0), table[0], kvh, tid);
    issue_meta<B>(p, meta_stage(0), table[0], kvh, tid, ocK, ocV);
  }
  if (n > 1) issue_meta<B>(p, meta_stage(1), table[1], kvh, tid, ocK, ocV);
  cp_commit();
  cp_wait<0>();
  __syncthreads();
  if (n > 0) prep_page<B>(p, meta_stage(0), prep_buf(0), page_head(0), 0, qf, qn_tab, staged_list);

  float acc[8][4];
#pragma unroll
  for (int i = 0; i < 8; ++i) { acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f; }
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f, z0 = 0.f, z1 = 0.f;
  const int odd = g & 1;
  uint8_t* wscr = smem + plan.warp + warp * W_BYTES;

  for (int i = 0; i < n; ++i) {
    // one barrier per page: page i's codes and page i + 1's small arrays have landed, page i - 1 is done by all
    // warps (its code stage and the meta stage of page i - 1 are free), prep of page i is visible
    cp_wait<0>();
    __syncthreads();
    if (i + 1 < n) issue_codes<B>(p, copies, code_stage(i + 1), table[i + 1], kvh, tid);
    if (i + 2 < n) issue_meta<B>(p, meta_stage(i + 2), table[i + 2], kvh, tid, ocK, ocV);
    cp_commit();
    if (i + 1 < n) prep_page<B>(p, meta_stage(i + 1), prep_buf(i + 1), page_head(i + 1), i + 1, qf, qn_tab, staged_list);
    const uint8_t* st = code_stage(i);
    const uint8_t* mt = meta_stage(i);
    const uint8_t* prep = prep_buf(i);
    const long long ph = page_head(i);
    const int* flags = reinterpret_cast<const int*>(prep + PREP_FLAGS);
    if (flags[0] >= 0) continue;                       // staged page: its low-bit storage is stale
    const int page_index = first + i;
    const bool full_page = (page_index + 1) * P <= ctx;
    // ---- keys -> scores
    uint32_t bq[16];
#pragma unroll
    for (int b4 = 0; b4 < 4; ++b4) {
      const uint4 v = *reinterpret_cast<const uint4*>(prep + PREP_BFRAG + (b4 * 32 + lane) * 16);
      bq[4 * b4] = v.x; bq[4 * b4 + 1] = v.y; bq[4 * b4 + 2] = v.z; bq[4 * b4 + 3] = v.w;
    }
    float cs[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const int row = 32 * warp + 16 * mt + tau<B>(g);
      uint32_t ka[16], kb[16];
      unpack_key_row<B>(ka, Loads<B>::key(st, row, c));
      unpack_key_row<B>(kb, Loads<B>::key(st, row + 8, c));
      cs[mt][0] = cs[mt][1] = cs[mt][2] = cs[mt][3] = 0.f;
#pragma unroll
      for (int s = 0; s < 8; ++s) mma16816(cs[mt], ka[2 * s], kb[2 * s], ka[2 * s + 1], kb[2 * s + 1], bq[2 * s], bq[2 * s + 1]);
    }
    const int kcount = flags[1], vcount = flags[2];
    if (kcount > 0) {                                  // key outliers: scores += onehot(token, slot) . (r * qn)
      const SlotView sv = slot_view(mt, L::FIXED, L::FIXED + ocK, ph, p.k_cap);
      const int2 rng = warp_slot_range(sv, kcount, 32 * warp * D, 32 * (warp + 1) * D, lane);
      __half* onehot = reinterpret_cast<__half*>(wscr + W_ONEHOT);
      for (int base = rng.x; base < rng.y; base += SLOT_TILE) {
        const int s = base + lane;
        const bool live = lane < SLOT_TILE && s < rng.y;
        const int idx = live ? (int)sv.idx[s] : 0;
        const int tok = live ? idx / D - 32 * warp : 0, ch = live ? idx % D : 0;
        const float r = live ? __half2float(sv.val[s]) : 0.f;
        const int krow = (tok & 16) + tau<B>(tok & 15);           // the QK row of this token
        if (live) onehot[krow * SLOT_TILE + lane] = __ushort_as_half((unsigned short)1);   // 2^-24
        __syncwarp();
        float prod[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int src = 2 * c + (e & 1) + 8 * (e >> 1);
          const float rr = __shfl_sync(0xffffffffu, r, src);
          const int cc = __shfl_sync(0xffffffffu, ch, src);
          prod[e] = rr * __half2float(qn_tab[g * D + cc]);
        }
        const uint32_t b0 = pack_half2(prod[0], prod[1]), b1 = pack_half2(prod[2], prod[3]);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          uint32_t a[4];
          ldmatrix_x4(a, onehot + (16 * mt + (lane & 15)) * SLOT_TILE + (lane >> 4) * 8);
          mma16816(cs[mt], a[0], a[1], a[2], a[3], b0, b1);
        }
        __syncwarp();
        if (live) onehot[krow * SLOT_TILE + lane] = __ushort_as_half((unsigned short)0);
        __syncwarp();
      }
    }
    // value words of both k-steps, loaded before the softmax so their latency hides behind it
    ValueWords<B> vw[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const int t0 = 32 * warp + 16 * mt + tau<B>(2 * c), t1 = 32 * warp + 16 * mt + tau<B>(2 * c + 1);
      vw[mt][0] = Loads<B>::value(st, t0, g); vw[mt][1] = Loads<B>::value(st, t1, g);
      vw[mt][2] = Loads<B>::value(st, t0 + 8, g); vw[mt][3] = Loads<B>::value(st, t1 + 8, g);
    }
    // ---- online softmax (base 2)
    const float bias0 = reinterpret_cast<const float*>(prep + PREP_BIAS)[2 * c];
    const float bias1 = reinterpret_cast<const float*>(prep + PREP_BIAS)[2 * c + 1];
    const float2* vsz = reinterpret_cast<const float2*>(prep + PREP_VSZ);
    float sc[2][4];
    float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = 32 * warp + 16 * mt + tau<B>(g) + 8 * (e >> 1);
        const bool valid = full_page || page_index * P + tok < ctx;
        const float v = (e & 1) ? qms1 * fmaf(cs[mt][e], 16777216.f, bias1) : qms0 * fmaf(cs[mt][e], 16777216.f, bias0);
        sc[mt][e] = valid ? v : NEG_INF;
        if (e & 1) mx1 = fmaxf(mx1, sc[mt][e]); else mx0 = fmaxf(mx0, sc[mt][e]);
      }
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
    }
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    const float u0 = n0 == NEG_INF ? 0.f : n0, u1 = n1 == NEG_INF ? 0.f : n1;
    if (__any_sync(0xffffffffu, n0 > m0 || n1 > m1)) {
      const float a0 = ex2(m0 - u0), a1 = ex2(m1 - u1);
#pragma unroll
      for (int i2 = 0; i2 < 8; ++i2) { acc[i2][0] *= a0; acc[i2][2] *= a0; acc[i2][1] *= a1; acc[i2][3] *= a1; }
      l0 *= a0; z0 *= a0; l1 *= a1; z1 *= a1;
    }
    m0 = n0; m1 = n1;
    uint32_t pb[2][2];                                   // PV B fragments per k-step (= QK m-tile)
    __half2* ptile = reinterpret_cast<__half2*>(wscr + W_PTILE);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      float pr[4], ps[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = 32 * warp + 16 * mt + tau<B>(g) + 8 * (e >> 1);
        pr[e] = ex2(sc[mt][e] - ((e & 1) ? u1 : u0));
        const float2 sz = vsz[tok];
        ps[e] = pr[e] * sz.x;
        if (e & 1) { l1 += pr[e]; z1 = fmaf(pr[e], sz.y, z1); } else { l0 += pr[e]; z0 = fmaf(pr[e], sz.y, z0); }
      }
      pb[mt][0] = movmatrix_trans(pack_half2(ps[0], ps[1]));
      pb[mt][1] = movmatrix_trans(pack_half2(ps[2], ps[3]));
      if (vcount > 0) {
        ptile[(16 * mt + tau<B>(g)) * (NH / 2) + c] = __floats2half2_rn(pr[0], pr[1]);
        ptile[(16 * mt + tau<B>(g) + 8) * (NH / 2) + c] = __floats2half2_rn(pr[2], pr[3]);
      }
    }
    // ---- values
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      uint32_t r01[16], r23[16];
      unpack_value_pair<B>(r01, vw[mt][0], vw[mt][1], odd);
      unpack_value_pair<B>(r23, vw[mt][2], vw[mt][3], odd);
#pragma unroll
      for (int i2 = 0; i2 < 8; ++i2) mma16816(acc[i2], r01[2 * i2], r01[2 * i2 + 1], r23[2 * i2], r23[2 * i2 + 1], pb[mt][0], pb[mt][1]);
    }
    if (vcount > 0) {          // value outliers: acc += onehot(row(ch), slot) * unit . (r * p[token][head])
      __syncwarp();
      const SlotView sv = slot_view(mt, L::FIXED + 2 * ocK, L::FIXED + 2 * ocK + ocV, ph, p.v_cap);
      const int2 rng = warp_slot_range(sv, vcount, 32 * warp * D, 32 * (warp + 1) * D, lane);
      __half* onehot = reinterpret_cast<__half*>(wscr + W_ONEHOT);
      const __half* pt = reinterpret_cast<const __half*>(wscr + W_PTILE);
      for (int base = rng.x; base < rng.y; base += SLOT_TILE) {
        const int s = base + lane;
        const bool live = lane < SLOT_TILE && s < rng.y;
        const int idx = live ? (int)sv.idx[s] : 0;
        const int tok = live ? idx / D - 32 * warp : 0, ch = live ? idx % D : 0;
        const int vj = ch & 15, row = 16 * (vj >> 1) + (ch >> 4) + 8 * (vj & 1);
        const float r = live ? __half2float(sv.val[s]) : 0.f;
        if (live) onehot[row * SLOT_TILE + lane] = __ushort_as_half((unsigned short)(1u << value_off<B>(vj)));
        __syncwarp();
        float prod[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int src = 2 * c + (e & 1) + 8 * (e >> 1);
          const float rr = __shfl_sync(0xffffffffu, r, src);
          const int tt = __shfl_sync(0xffffffffu, tok, src);
          prod[e] = rr * __half2float(pt[tt * NH + g]);
        }
        const uint32_t b0 = pack_half2(prod[0], prod[1]), b1 = pack_half2(prod[2], prod[3]);
#pragma unroll
        for (int i2 = 0; i2 < 8; ++i2) {
          uint32_t a[4];
          ldmatrix_x4(a, onehot + (16 * i2 + (lane & 15)) * SLOT_TILE + (lane >> 4) * 8);
          mma16816(acc[i2], a[0], a[1], a[2], a[3], b0, b1);
        }
        __syncwarp();
        if (live) onehot[row * SLOT_TILE + lane] = __ushort_as_half((unsigned short)0);
        __syncwarp();
      }
    }
  }
  cp_wait<0>();
  __syncthreads();

  // ---- merge: per-warp states to shared memory (the ring is free now)
  float* mo = reinterpret_cast<float*>(smem + plan.ring);           // [WARPS][NH][D] un-normalised outputs
  float* ml = mo + WARPS * NH * D;                                  // [WARPS][NH] max, [WARPS][NH] sum
  float* st_o = ml + 2 * WARPS * NH;                                // staged pages' state: [NH][D] o, [NH] m, [NH] l
  float* st_m = st_o + NH * D;
  float* st_l = st_m + NH;
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o); l1 += __shfl_xor_sync(0xffffffffu, l1, o);
    z0 += __shfl_xor_sync(0xffffffffu, z0, o); z1 += __shfl_xor_sync(0xffffffffu, z1, o);
  }
  if (g == 0) {
    ml[warp * NH + 2 * c] = m0; ml[warp * NH + 2 * c + 1] = m1;
    ml[(WARPS + warp) * NH + 2 * c] = l0; ml[(WARPS + warp) * NH + 2 * c + 1] = l1;
  }
#pragma unroll
  for (int i2 = 0; i2 < 8; ++i2)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int vj = 2 * i2 + (e >> 1), ch = 16 * g + vj, h = 2 * c + (e & 1);
      const float unit = __int_as_float((127 + 24 - value_off<B>(vj)) << 23);    // 2^(24 - off)
      mo[(warp * NH + h) * D + ch] = fmaf(acc[i2][e], unit, (e & 1) ? z1 : z0);
    }
  // ---- staged pages (full precision, CUDA cores): one token per thread for scores, one channel per thread for p.v
  const int num_staged = min(staged_list[0], 16);
  if (tid < NH) { st_m[tid] = NEG_INF; st_l[tid] = 0.f; }
  for (int i = tid; i < NH * D; i += THREADS) st_o[i] = 0.f;
  __syncthreads();
  float* sbuf = st_l + NH;                                          // [P][NH] staged probabilities
  attend_staged_pages<QT>(p, table, staged_list + 1, num_staged, first, ctx, kvh, G, qn_tab, qmax_tab, st_o, st_m,
                          st_l, sbuf, sbuf + P * NH);
  __syncthreads();
  // ---- combine warps, staged pages and (split 0) the new token; thread = channel
  const int ch = tid;
  const bool write_direct = p.num_splits == 1;
  for (int h = 0; h < G; ++h) {
    float M = st_m[h];
#pragma unroll
    for (int w = 0; w < WARPS; ++w) M = fmaxf(M, ml[w * NH + h]);
    float s_new = NEG_INF, v_new = 0.f;
    if (split == 0) {
      const QT* kn = reinterpret_cast<const QT*>(p.new_k) + q_row * p.stride_kt + (long long)kvh * p.stride_kh;
      float dot = 0.f;
      for (int d = 0; d < D; ++d) dot = fmaf(__half2float(qn_tab[h * D + d]), to_float<QT>(kn[d]), dot);
      s_new = dot * (qmax_tab[h] * p.qk_scale);
      v_new = to_float<QT>(reinterpret_cast<const QT*>(p.new_v)[q_row * p.stride_vt + (long long)kvh * p.stride_vh + ch]);
      M = fmaxf(M, s_new);
    }
    const float Mu = M == NEG_INF ? 0.f : M;
    float Lsum = 0.f, O = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float wgt = ex2(ml[w * NH + h] - Mu);
      Lsum = fmaf(wgt, ml[(WARPS + w) * NH + h], Lsum);
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
  if (write_direct) return;
  combine_splits<QT>(p, seq, kvh, q_row, G, reinterpret_cast<int*>(smem + plan.prep));
}

}  // namespace moekv_v7
