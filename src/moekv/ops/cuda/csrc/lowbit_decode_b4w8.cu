// The v7 decode kernels for 4-bit codes, GQA groups of 5..8 (int2: all), CTAs of 8 warps (lowbit_decode_launch.cuh).
#define MOEKV_V7_BITS 4
#define MOEKV_V7_STACK 1
#define MOEKV_V7_WARPS 8
#include "lowbit_decode_launch.cuh"
