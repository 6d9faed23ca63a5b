// The v7 decode kernels for 2-bit codes, GQA groups of at most 4: stacked scores (lowbit_decode_launch.cuh).
#define MOEKV_V7_BITS 2
#define MOEKV_V7_STACK 2
#include "lowbit_decode_launch.cuh"
