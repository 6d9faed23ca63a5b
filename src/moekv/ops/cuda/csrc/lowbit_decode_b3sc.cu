// The v7 decode kernels for 3-bit codes, stacked scores, chunk-split CTAs of 4 warps (lowbit_decode_launch.cuh).
#define MOEKV_V7_BITS 3
#define MOEKV_V7_STACK 2
#define MOEKV_V7_CS 1
#include "lowbit_decode_launch.cuh"
