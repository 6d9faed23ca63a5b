// The v7 decode kernels for 3-bit codes (lowbit_decode_launch.cuh).
#define MOEKV_V7_BITS 3
#include "lowbit_decode_launch.cuh"
