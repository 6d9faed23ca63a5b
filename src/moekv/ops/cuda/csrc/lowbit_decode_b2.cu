// The v7 decode kernels for 2-bit codes (lowbit_decode_launch.cuh).
#define MOEKV_V7_BITS 2
#include "lowbit_decode_launch.cuh"
