// The v7 decode kernels for 2-bit codes, stacked scores (GQA groups <= 4) (lowbit_decode_launch.cuh).
#define MOEKV_V7_BITS 2
#define MOEKV_V7_STACK 2
#include "lowbit_decode_launch.cuh"
