// The v7 decode kernels of one code width (compiled apart from the others: the build runs them in parallel).
#include <stdexcept>
#include <string>
#include "lowbit_decode_kernel.cuh"

namespace moekv_v7 {

static void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("lowbit decode v7: ") + what + ": " + cudaGetErrorString(err));
}

template <int B, typename QT, int STAGES>
static void launch(const Params& p, int batch, cudaStream_t stream) {
  auto kernel = decode_kernel<B, QT, STAGES>;
  const SmemPlan plan = smem_plan<B>(p.k_cap, p.v_cap, STAGES);
  static int configured = 0;
  if (plan.total > configured) {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, plan.total), "shared memory");
    configured = plan.total;
  }
  dim3 grid(p.num_splits, p.num_kv_heads, batch);
  kernel<<<grid, THREADS, plan.total, stream>>>(p);
  check(cudaGetLastError(), "launch");
}

}  // namespace moekv_v7

template <int B>
void launch_bits(const moekv_v7::Params& p, int batch, int stages, bool bf16, cudaStream_t stream);

template <>
void launch_bits<4>(const moekv_v7::Params& p, int batch, int stages, bool bf16, cudaStream_t stream) {
  using namespace moekv_v7;
  if (stages != 2) throw std::invalid_argument("lowbit decode v7: this width is built with 2 stages");
  if (bf16) launch<4, __nv_bfloat16, 2>(p, batch, stream);
  else launch<4, __half, 2>(p, batch, stream);
}
