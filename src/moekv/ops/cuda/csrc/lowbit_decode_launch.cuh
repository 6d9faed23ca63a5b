// The launch of the v7 decode kernels of one code width, MOEKV_V7_BITS, score stacking, MOEKV_V7_STACK (1, or 2
// for GQA groups of at most 4), warps per CTA, MOEKV_V7_WARPS (4, or 8 for small batches) and chunk-split CTAs,
// MOEKV_V7_CS (0, or 1 for small batches: lowbit_decode_page.cuh WarpRange): each lowbit_decode_b<bits>[s][w8|c].cu
// defines them and includes this, so the build compiles the kernels in parallel.
#pragma once
#include <stdexcept>
#include <string>
#include "lowbit_decode_kernel.cuh"

namespace moekv_v7 {

// resident CTAs per SM each width is built for: int3 / int2 stages fit 4 (<= 128 registers), int4's larger ones 3
template <int B> constexpr int MINB = B == 4 ? 3 : 4;
// CTAs of 8 warps (small batches, one CTA per SM): no register cap below the hardware's 255
template <int B, int W> constexpr int MINB_W = W == WARPS ? MINB<B> : 1;

static void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("lowbit decode v7: ") + what + ": " + cudaGetErrorString(err));
}

template <int B, int STACK, int W, bool CS, typename QT>
static void launch(const Params& p, int batch, cudaStream_t stream) {
  auto kernel = decode_kernel<B, QT, MINB_W<B, W>, STACK, W, CS>;
  const SmemPlan plan = smem_plan<B, W>(p.k_cap, p.v_cap);
  static int configured = 0;
  if (plan.total > configured) {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, plan.total), "shared memory");
    configured = plan.total;
  }
  dim3 grid(p.num_splits, p.num_kv_heads, batch);
  if (p.pdl) {                      // may be scheduled while the kernel before it finishes; it waits at its top
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(32 * W);
    cfg.dynamicSmemBytes = plan.total;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    check(cudaLaunchKernelEx(&cfg, kernel, p), "launch (PDL)");
  } else {
    kernel<<<grid, 32 * W, plan.total, stream>>>(p);
  }
  check(cudaGetLastError(), "launch");
}

}  // namespace moekv_v7

template <int B, int STACK, int W, bool CS>
void launch_bits(const moekv_v7::Params& p, int batch, bool bf16, cudaStream_t stream);

#ifndef MOEKV_V7_WARPS
#define MOEKV_V7_WARPS 4
#endif
#ifndef MOEKV_V7_CS
#define MOEKV_V7_CS 0
#endif
template <>
void launch_bits<MOEKV_V7_BITS, MOEKV_V7_STACK, MOEKV_V7_WARPS, (MOEKV_V7_CS != 0)>(const moekv_v7::Params& p, int batch,
                                                                                 bool bf16, cudaStream_t stream) {
  using namespace moekv_v7;
  constexpr bool CS = MOEKV_V7_CS != 0;
  if (bf16) launch<MOEKV_V7_BITS, MOEKV_V7_STACK, MOEKV_V7_WARPS, CS, __nv_bfloat16>(p, batch, stream);
  else launch<MOEKV_V7_BITS, MOEKV_V7_STACK, MOEKV_V7_WARPS, CS, __half>(p, batch, stream);
}
