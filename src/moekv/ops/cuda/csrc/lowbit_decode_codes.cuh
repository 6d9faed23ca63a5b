// Code -> tensor-core operand maps of the v7 decode kernel: which channels a thread's registers hold, their bit
// offsets, and the unpack of key rows and value token pairs by masks (docs/kv-format.md, docs/attention-kernels.md).
#pragma once
#include "lowbit_decode_ptx.cuh"

namespace moekv_v7 {

// ---------------------------------------------------------------- code -> operand maps
// Keys: thread c (lane % 4) owns physical channels [32c, 32c + 32) of a token row; its register j (0..15) holds
// the channel pair (key_lo(j), key_lo(j) + key_gap) of that block at field offset key_off(j) (the code's unit
// is 2^(off - 24)). Register 2s is the A fragment's a0/a1 of k-step s, 2s + 1 its a2/a3.
// int3 (triplets, docs/kv-format.md): register j < 15 is field j % 5 of word j / 5 (channels j and 16 + j), at
// offsets 0, 3, 6 of the word or 0, 3 of the word shifted right by 10; register 15 is the halves' sixteenth
// code, assembled from the three words' spare bits at offset 7.
template <int B> __device__ __forceinline__ int key_lo(int j) {
  if (B == 4) return 8 * (j >> 2) + (j & 3);
  if (B == 3) return j;
  return 16 * (j >> 3) + (j & 7);
}
template <int B> __device__ __forceinline__ int key_gap() { return B == 4 ? 4 : B == 3 ? 16 : 8; }
template <int B> __host__ __device__ __forceinline__ int field_off(int k) {   // k: register within its group of 16
  if (B == 4) return 4 * (k & 3 & 1);
  if (B == 3) return k == 15 ? 7 : (k % 5 < 3 ? 3 * (k % 5) : 3 * (k % 5 - 3));
  return (k & 7) < 5 ? 2 * (k & 7) : 2 * ((k & 7) - 5);
}
template <int B> __device__ __forceinline__ int key_off(int j) { return field_off<B>(j); }

// Unpack one token row's 32 channels of thread c into 16 fp16x2 registers (A operand values), from the chunk's
// lane words in fragment order (lowbit_decode.cuh: lane_words, unpack_lane_pair).
__device__ __forceinline__ void unpack16_2bit(uint32_t (&r)[8], uint32_t w) {
#pragma unroll
  for (int k = 0; k < 5; ++k) r[k] = w & (0x00030003u << (2 * k));
  const uint32_t v = w >> 10;
#pragma unroll
  for (int k = 5; k < 8; ++k) r[k] = v & (0x00030003u << (2 * (k - 5)));
}
// int3: one word of a triplet -> its five fields (per 16-bit half at bits 0, 3, 6, then 10, 13 after one shift)
__device__ __forceinline__ void unpack5_3bit(uint32_t* r, uint32_t w) {
  r[0] = w & 0x00070007u; r[1] = w & 0x00380038u; r[2] = w & 0x01C001C0u;
  const uint32_t v = w >> 10;
  r[3] = v & 0x00070007u; r[4] = v & 0x00380038u;
}
// int3: the halves' sixteenth code, bit i at bit 9 of word i, gathered at offset 7
__device__ __forceinline__ uint32_t spare_3bit(uint32_t w0, uint32_t w1, uint32_t w2) {
  const uint32_t r = w2 & 0x02000200u;
  return lop_or_and(lop_or_and(r, w1 >> 1, 0x01000100u), w0 >> 2, 0x00800080u);
}
__device__ __forceinline__ void unpack16_3bit(uint32_t (&r)[16], uint32_t w0, uint32_t w1, uint32_t w2) {
  unpack5_3bit(r, w0); unpack5_3bit(r + 5, w1); unpack5_3bit(r + 10, w2);
  r[15] = spare_3bit(w0, w1, w2);
}
__device__ __forceinline__ void unpack8_4bit(uint32_t* r, uint32_t w) {
  const uint32_t v = w >> 8;
  r[0] = w & 0x000F000Fu; r[1] = w & 0x00F000F0u; r[2] = v & 0x000F000Fu; r[3] = v & 0x00F000F0u;
}

// int4: four words -> 16 registers (a key row's four words; a value token pair's merged halves of two words)
__device__ __forceinline__ void unpack32_4bit(uint32_t (&r)[16], const uint32_t* w) {
#pragma unroll
  for (int i = 0; i < 4; ++i) unpack8_4bit(r + 4 * i, w[i]);
}
// int2: two words -> 16 registers (a key row's two words; a value token pair's merged low / high halves)
__device__ __forceinline__ void unpack32_2bit(uint32_t (&r)[16], uint32_t w0, uint32_t w1) {
  uint32_t a[8], b[8];
  unpack16_2bit(a, w0); unpack16_2bit(b, w1);
#pragma unroll
  for (int k = 0; k < 8; ++k) { r[k] = a[k]; r[8 + k] = b[k]; }
}

// Values: thread g (lane / 4) owns physical channels [16g, 16g + 16); register vj (0..15) of a token pair holds
// channel 16g + vj for both tokens (low half: the first). MMA row g of m-tile i is vj = 2i, row g + 8 is 2i + 1.
template <int B> __device__ __forceinline__ int value_off(int vj) { return field_off<B>(vj); }

}  // namespace moekv_v7
