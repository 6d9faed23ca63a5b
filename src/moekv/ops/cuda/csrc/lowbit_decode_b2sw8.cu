// The v7 decode kernels for 2-bit codes, stacked scores (GQA groups <= 4), CTAs of 8 warps (lowbit_decode_launch.cuh).
#define MOEKV_V7_BITS 2
#define MOEKV_V7_STACK 2
#define MOEKV_V7_WARPS 8
#include "lowbit_decode_launch.cuh"
