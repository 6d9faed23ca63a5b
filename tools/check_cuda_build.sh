#!/usr/bin/env bash
# Compile the v7 low-bit decode extension for sm_90 on a machine without a GPU, the binding included, before any
# device minute is spent on it: every lowbit_decode_*.cu with `ptxas -v` (registers, spills) and lowbit_decode.cu
# (the torch binding) to an object file. Needs nvcc (`pip install nvidia-cuda-nvcc`, or /usr/local/cuda*/bin).
#
#     tools/check_cuda_build.sh            # all kernels + the binding (~2 minutes on 2 cores)
#     tools/check_cuda_build.sh b3s b3sw8  # only these kernel files, and the binding
#
# The CPU torch wheel ships ATen's CUDA headers but not the CUDA libraries' headers they include (cuBLAS, cuSPARSE,
# cuSOLVER) nor one generated c10 header: the first are unpacked from their pip wheels into $CACHE (downloaded
# once; a package registry, not a model hub), the second is a one-line stub. Link-level problems (a missing
# symbol) still only show on the GPU machine.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CSRC="$ROOT/src/moekv/ops/cuda/csrc"
PY="${PY:-$ROOT/.venv/bin/python}"
CACHE="${CACHE:-/tmp/moekv-cuda-headers}"
NVCC="${NVCC:-$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | tail -1)}"
[ -x "$NVCC" ] || { echo "no nvcc: pip install nvidia-cuda-nvcc" >&2; exit 2; }
mkdir -p "$CACHE/stub/c10/cuda/impl"
printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$CACHE/stub/c10/cuda/impl/cuda_cmake_macros.h"
INC=()
for lib in cublas cusparse cusolver; do
  if [ ! -d "$CACHE/nvidia/$lib/include" ]; then
    "$PY" -m pip download -q --no-deps "nvidia-$lib-cu12" -d "$CACHE/wheels" 2>/dev/null
    (cd "$CACHE" && unzip -q -o "wheels/nvidia_${lib}_cu12-"*.whl "nvidia/$lib/include/*")
  fi
  INC+=("-I$CACHE/nvidia/$lib/include")
done
TORCH_INC=$("$PY" -c "import torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))")
PY_INC=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
FLAGS=(-std=c++17 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90,code=sm_90 -I"$CSRC")
OUT="$(mktemp -d)"
if [ $# -gt 0 ]; then FILES=(); for b in "$@"; do FILES+=("$CSRC/lowbit_decode_$b.cu"); done
else FILES=("$CSRC"/lowbit_decode_b*.cu); fi
for f in "${FILES[@]}"; do
  echo "== $(basename "$f")"
  "$NVCC" "${FLAGS[@]}" -cubin -o "$OUT/$(basename "$f" .cu).cubin" "$f" -Xptxas -v 2>&1 \
    | grep -E "error|Used [0-9]+ registers|spill stores" | sed 's/^ptxas info *: //' | paste -sd' ' -
done
echo "== lowbit_decode.cu (the binding)"
# shellcheck disable=SC2086
"$NVCC" "${FLAGS[@]}" -c -o "$OUT/binding.o" "$CSRC/lowbit_decode.cu" $TORCH_INC -I"$CACHE/stub" -I"$PY_INC" "${INC[@]}" \
  -DTORCH_EXTENSION_NAME=moekv_check -D_GLIBCXX_USE_CXX11_ABI=1 2>&1 | grep -E "error" -A3 || true
[ -s "$OUT/binding.o" ] && echo "binding compiled" || { echo "binding FAILED" >&2; exit 1; }
rm -rf "$OUT"
