// kiln's weight-only low-bit GEMM: y (M, N) = x (M, K) @ W (K, N), W in blocked 4- or 8-bit codes.
//
// Numerics (the same on every path and for every M, so a row's result depends on that row alone):
//   - x is quantized per row and block of `block` inputs to int8: a = rne(x * (1 / s_a)), s_a = max|x| / 127;
//   - a block's integer dot product of codes and a, minus zero * sum(a), is exact in int32;
//   - out[m, n] = fma(float(dot_b), s_w[n, b] * s_a[m, b], out) over the blocks b in order, from 0.
// Each SIMD lane computes one output column with exactly the scalar operations, so the scalar, AVX2 and AVX-512
// paths agree bit for bit, and row i of an M-row call equals the one-row call.
//
// Layout (`Packed`): 16 output columns form a tile; a tile's block holds block / 4 chunks of 64 bytes, byte c * 4 + t
// of chunk g being column c's code for input 4 g + t (4-bit codes: chunks 2j and 2j + 1 share 64 bytes, low and high
// nibble), then the block's 16 scales and (asymmetric codes) 16 zero points: one record. Every tile's records
// follow each other, so one pass over a tile reads its weights once for all rows, in one stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kiln {

constexpr int kTile = 16;  // output columns per tile

enum class Isa { scalar = 0, avx2 = 1, avx512 = 2 };

const char* isa_name(Isa isa);
Isa best_isa();                     // the fastest path this CPU (and its OS) runs
bool isa_supported(Isa isa);
bool parse_isa(const char* name, Isa* out);

struct Packed {
  Packed() = default;
  Packed(const Packed&) = delete;  // `base` points into `storage`: a copy would point into the original
  Packed& operator=(const Packed&) = delete;
  int bits = 4, block = 32;
  int64_t k = 0, n = 0, blocks = 0, tiles = 0;
  bool symmetric = true;  // every zero point is 2^(bits - 1): none stored
  int64_t record = 0;     // bytes of one tile's block: its codes, 16 float scales, (asym) 16 uint8 zero points
  std::vector<uint8_t> storage;  // tiles x blocks records, in the order a tile is read, from `base`
  uint8_t* base = nullptr;       // the first record: 64-byte aligned (records of symmetric codes fill whole lines)
  int64_t block_bytes() const { return int64_t(kTile) * block * bits / 8; }
  int64_t bytes() const { return tiles * blocks * record; }
  const uint8_t* codes(int64_t t, int64_t b) const { return base + (t * blocks + b) * record; }
  const float* scales(int64_t t, int64_t b) const {
    return reinterpret_cast<const float*>(codes(t, b) + block_bytes());
  }
  const uint8_t* zeros(int64_t t, int64_t b) const { return codes(t, b) + block_bytes() + 4 * kTile; }
};

// From ONNX Runtime's MatMulNBits layout: codes (N, blocks, block * bits / 8) low bits first along K, scales
// (N, blocks), zero points (N, ceil(blocks * bits / 8)) packed the same way, or null (2^(bits - 1)).
// Returns an empty string, or why the weights cannot be packed.
std::string pack(int bits, int block, int64_t k, int64_t n, const uint8_t* codes, const float* scales,
                 const uint8_t* zeros, Packed* out);

// Activations of M rows, quantized once per call.
struct Activations {
  int64_t m = 0, padded = 0, blocks = 0;  // padded = blocks * block
  std::vector<int8_t> q;       // m x padded
  std::vector<float> scale;    // m x blocks
  std::vector<int32_t> sum;    // m x blocks
};

// Rows [m0, m1) of x into a: the same codes on every path (`isa` picks only how they are computed).
void quantize_rows(Isa isa, const float* x, int64_t m0, int64_t m1, int64_t k, int block, Activations* a);
void prepare(int64_t m, int64_t k, int block, int64_t blocks, Activations* a);

// Rows [0, a.m) of tiles [t0, t1) into y (M, N).
void gemm_tiles(Isa isa, const Packed& w, const Activations& a, int64_t t0, int64_t t1, float* y);

}  // namespace kiln
