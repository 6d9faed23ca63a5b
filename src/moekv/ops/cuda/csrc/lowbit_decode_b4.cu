// The v7 decode kernels for 4-bit codes (lowbit_decode_launch.cuh).
#define MOEKV_V7_BITS 4
#include "lowbit_decode_launch.cuh"
