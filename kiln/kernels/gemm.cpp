// kiln's weight-only low-bit GEMM (see gemm.h for the numerics and the layout).
// Built with -ffp-contract=off: every fused multiply-add is written out, so no path gets one the others lack.
#include "gemm.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#define KILN_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace kiln {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512vnni";
    default: return "scalar";
  }
}

bool parse_isa(const char* name, Isa* out) {
  const Isa all[] = {Isa::scalar, Isa::avx2, Isa::avx512};
  for (Isa isa : all) {
    if (std::strcmp(name, isa_name(isa)) == 0) {
      *out = isa;
      return true;
    }
  }
  return false;
}

#ifdef KILN_X86
static uint64_t xcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (uint64_t(edx) << 32) | eax;
}
#endif

bool isa_supported(Isa isa) {
  if (isa == Isa::scalar) return true;
#ifdef KILN_X86
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE) || !(c & bit_FMA) || !(c & bit_AVX)) return false;
  uint64_t os = xcr0();
  if ((os & 0x6) != 0x6) return false;  // the OS saves XMM and YMM state
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b & bit_AVX2)) return false;
  if (isa == Isa::avx2) return true;
  // AVX-512: F, BW, VL and VNNI listed, and the OS saves opmask and ZMM state (XCR0 bits 5-7)
  return (b & bit_AVX512F) && (b & bit_AVX512BW) && (b & bit_AVX512VL) && (c & bit_AVX512VNNI) &&
         (os & 0xe0) == 0xe0;
#else
  return false;
#endif
}

Isa best_isa() {
  if (isa_supported(Isa::avx512)) return Isa::avx512;
  if (isa_supported(Isa::avx2)) return Isa::avx2;
  return Isa::scalar;
}

static inline int nibble(const uint8_t* row, int64_t i) { return (row[i >> 1] >> ((i & 1) * 4)) & 15; }

std::string pack(int bits, int block, int64_t k, int64_t n, const uint8_t* codes, const float* scales,
                 const uint8_t* zeros, Packed* out) {
  if (bits != 4 && bits != 8) return "bits must be 4 or 8";
  if (block < 16 || (block & (block - 1)) || block > 4096) return "block_size must be a power of two in [16, 4096]";
  if (k <= 0 || n <= 0) return "K and N must be positive";
  Packed& p = *out;
  p.bits = bits;
  p.block = block;
  p.k = k;
  p.n = n;
  p.blocks = (k + block - 1) / block;
  p.tiles = (n + kTile - 1) / kTile;
  const int64_t row_bytes = int64_t(block) * bits / 8;       // one column's block in the source
  const int64_t zero_row = (p.blocks * bits + 7) / 8;        // one column's zero points in the source
  auto zero_of = [&](int64_t col, int64_t b) {
    return bits == 8 ? zeros[col * zero_row + b] : nibble(zeros + col * zero_row, b);
  };
  p.symmetric = true;
  for (int64_t col = 0; zeros && col < n && p.symmetric; ++col) {
    for (int64_t b = 0; b < p.blocks && p.symmetric; ++b) p.symmetric = zero_of(col, b) == (1 << (bits - 1));
  }
  p.record = p.block_bytes() + 4 * kTile + (p.symmetric ? 0 : kTile);
  p.storage.assign(size_t(p.bytes() + 63), 0);
  p.base = p.storage.data() + ((64 - reinterpret_cast<uintptr_t>(p.storage.data()) % 64) % 64);
  const int chunks = block / 4;
  for (int64_t col = 0; col < n; ++col) {
    const int64_t t = col / kTile;
    const int c = int(col % kTile);
    for (int64_t b = 0; b < p.blocks; ++b) {
      const uint8_t* src = codes + (col * p.blocks + b) * row_bytes;
      uint8_t* dst = const_cast<uint8_t*>(p.codes(t, b));
      for (int g = 0; g < chunks; ++g) {
        for (int i = 0; i < 4; ++i) {
          const int64_t at = int64_t(g) * 4 + i;
          if (bits == 8) {
            dst[g * 64 + c * 4 + i] = src[at];
          } else {
            const int v = nibble(src, at);
            dst[(g >> 1) * 64 + c * 4 + i] |= uint8_t(v << ((g & 1) * 4));
          }
        }
      }
      std::memcpy(dst + p.block_bytes() + 4 * c, scales + col * p.blocks + b, 4);
      if (!p.symmetric) dst[p.block_bytes() + 4 * kTile + c] = uint8_t(zero_of(col, b));
    }
  }
  return "";
}

void prepare(int64_t m, int64_t k, int block, int64_t blocks, Activations* a) {
  (void)k;
  a->m = m;
  a->blocks = blocks;
  a->padded = blocks * block;
  a->q.assign(size_t(m * a->padded), 0);
  a->scale.assign(size_t(m * blocks), 0.0f);
  a->sum.assign(size_t(m * blocks), 0);
}

// One block of a row: its int8 codes, scale and sum (the reference the AVX2 form equals bit for bit).
static void quantize_block(const float* x, int64_t n, int8_t* q, float* scale_out, int32_t* sum_out) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / 127.0f;
  const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
  int32_t sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::nearbyint(x[i] * inv);
    const int iv = int(std::min(127.0f, std::max(-127.0f, v)));
    q[i] = int8_t(iv);
    sum += iv;
  }
  *scale_out = scale;
  *sum_out = sum;
}

#ifdef KILN_X86
// A whole block of 32 with the scalar form's operations lane by lane: max|x| (a NaN is skipped, as std::max skips
// it), the same scale and reciprocal, x * inv rounded to nearest even (nearbyint in the default rounding mode),
// clamped the same way (a NaN to -127), summed exactly.
__attribute__((target("avx2,fma"))) static void quantize_block32_avx2(const float* x, int8_t* q, float* scale_out,
                                                                     int32_t* sum_out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    amax = _mm256_max_ps(_mm256_andnot_ps(sign, v[j]), amax);  // a NaN operand: the second (amax) is kept
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float scale = _mm_cvtss_f32(m4) / 127.0f;
  const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
  const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  __m256i iv[4];
  __m256i sum = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[j], vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    iv[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));  // max(NaN, lo) = lo
    sum = _mm256_add_epi32(sum, iv[j]);
  }
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  *scale_out = scale;
  *sum_out = _mm_cvtsi128_si32(s4);
}
#endif

void quantize_rows(Isa isa, const float* x, int64_t m0, int64_t m1, int64_t k, int block, Activations* a) {
  (void)isa;  // only x86 has a second form
  for (int64_t m = m0; m < m1; ++m) {
    const float* row = x + m * k;
    int8_t* q = a->q.data() + m * a->padded;
    for (int64_t b = 0; b < a->blocks; ++b) {
      const int64_t lo = b * block, hi = std::min<int64_t>(k, lo + block);
      float* scale = &a->scale[size_t(m * a->blocks + b)];
      int32_t* sum = &a->sum[size_t(m * a->blocks + b)];
#ifdef KILN_X86
      if (isa != Isa::scalar && hi - lo == 32) {
        quantize_block32_avx2(row + lo, q + lo, scale, sum);
        continue;
      }
#endif
      quantize_block(row + lo, hi - lo, q + lo, scale, sum);
    }
  }
}

// ---- scalar: the reference every path equals -------------------------------------------------------------------

static void tiles_scalar(const Packed& w, const Activations& a, int64_t t0, int64_t t1, float* y) {
  const int chunks = w.block / 4;
  std::vector<float> acc(kTile);
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t m = 0; m < a.m; ++m) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t b = 0; b < w.blocks; ++b) {
        const uint8_t* codes = w.codes(t, b);
        const float* scales = w.scales(t, b);
        const int8_t* q = a.q.data() + m * a.padded + b * w.block;
        const float sa = a.scale[size_t(m * a.blocks + b)];
        const int32_t suma = a.sum[size_t(m * a.blocks + b)];
        for (int c = 0; c < kTile; ++c) {
          int32_t dot = 0;
          for (int g = 0; g < chunks; ++g) {
            for (int i = 0; i < 4; ++i) {
              const int code = w.bits == 8 ? codes[g * 64 + c * 4 + i]
                                           : (codes[(g >> 1) * 64 + c * 4 + i] >> ((g & 1) * 4)) & 15;
              dot += code * q[g * 4 + i];
            }
          }
          dot -= (w.symmetric ? 1 << (w.bits - 1) : w.zeros(t, b)[c]) * suma;
          const float s = scales[c] * sa;
          acc[c] = std::fma(float(dot), s, acc[c]);
        }
      }
      for (int c = 0; c < kTile && t * kTile + c < w.n; ++c) y[m * w.n + t * kTile + c] = acc[c];
    }
  }
}

// A tile's M x 16 sums into y's columns (the last tile's padding columns dropped).
static void store_tile(const Packed& w, int64_t m, int64_t t, const float* acc_rows, float* y) {
  const int64_t cols = std::min<int64_t>(kTile, w.n - t * kTile);
  for (int64_t r = 0; r < m; ++r) std::memcpy(y + r * w.n + t * kTile, acc_rows + r * kTile, size_t(cols) * 4);
}

#ifdef KILN_X86

// The record kAhead bytes past this one, into the cache: a task's tiles are one stream, and a decode call's streams
// are short (tens of KB a task), over before the hardware prefetcher has learnt them; measured on the SmolLM2
// shapes at one row, 1.25x (AVX2 EPYC). A prefetch past the end of the weights is harmless (no fault).
constexpr int64_t kAhead = 2048;

static inline void prefetch_ahead(const Packed& w, const uint8_t* record) {
  for (int64_t line = 0; line < w.record; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(record + kAhead + line), _MM_HINT_T0);
  }
}

// ---- AVX2 --------------------------------------------------------------------------------------------------------

static inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// One block's integer sums of R rows against a tile's 16 columns (two halves of 8): each weight load feeds R rows.
// A row's integers are exact, so they do not depend on R or on how the codes were unpacked: rows blocked by four
// equal rows taken alone. PACKED: 4-bit codes read as stored and split into nibbles in registers (few rows);
// otherwise one byte per code (8-bit codes, or 4-bit codes unpacked once for many rows). C: chunks if fixed, else 0.
template <int R, bool PACKED, int C>
__attribute__((target("avx2,fma"))) static inline void sums_avx2(int bits, const uint8_t* src, int runtime_chunks,
                                                                 const int8_t* q, int64_t stride, __m256i* lo,
                                                                 __m256i* hi) {
  const int chunks = C ? C : runtime_chunks;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
  if (bits == 4) {
    // code <= 15, |a| <= 127: a pair <= 3810, eight pairs summed in int16 <= 30480
    const __m256i low = _mm256_set1_epi8(15);
    for (int g0 = 0; g0 < chunks; g0 += 8) {
      __m256i h0[R], h1[R];
      for (int r = 0; r < R; ++r) h0[r] = h1[r] = _mm256_setzero_si256();
      const int g1 = std::min(chunks, g0 + 8);
      if (PACKED) {  // chunks 2j and 2j + 1 are the low and high nibbles of the same 64 bytes
        for (int g = g0; g < g1; g += 2) {
          const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (g >> 1) * 64));
          const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (g >> 1) * 64 + 32));
          const __m256i l0 = _mm256_and_si256(v0, low), l1 = _mm256_and_si256(v1, low);
          const __m256i u0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
          const __m256i u1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
          for (int r = 0; r < R; ++r) {
            const __m256i a0 = _mm256_set1_epi32(four_bytes(q + r * stride + g * 4));
            const __m256i a1 = _mm256_set1_epi32(four_bytes(q + r * stride + g * 4 + 4));
            h0[r] = _mm256_add_epi16(h0[r], _mm256_add_epi16(_mm256_maddubs_epi16(l0, a0), _mm256_maddubs_epi16(u0, a1)));
            h1[r] = _mm256_add_epi16(h1[r], _mm256_add_epi16(_mm256_maddubs_epi16(l1, a0), _mm256_maddubs_epi16(u1, a1)));
          }
        }
      } else {
        for (int g = g0; g < g1; ++g) {
          const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(src + g * 64));
          const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(src + g * 64 + 32));
          for (int r = 0; r < R; ++r) {
            const __m256i av = _mm256_set1_epi32(four_bytes(q + r * stride + g * 4));
            h0[r] = _mm256_add_epi16(h0[r], _mm256_maddubs_epi16(w0, av));
            h1[r] = _mm256_add_epi16(h1[r], _mm256_maddubs_epi16(w1, av));
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(h0[r], ones));
        hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(h1[r], ones));
      }
    }
    return;
  }
  // 8 bits: signed codes (code - 128) as |w| against sign(a, w): a pair <= 2 * 128 * 127, widened at once
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  for (int g = 0; g < chunks; ++g) {
    const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + g * 64)), flip);
    const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + g * 64 + 32)), flip);
    const __m256i m0 = _mm256_sign_epi8(w0, w0), m1 = _mm256_sign_epi8(w1, w1);
    for (int r = 0; r < R; ++r) {
      const __m256i av = _mm256_set1_epi32(four_bytes(q + r * stride + g * 4));
      lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(_mm256_maddubs_epi16(m0, _mm256_sign_epi8(av, w0)), ones));
      hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(m1, _mm256_sign_epi8(av, w1)), ones));
    }
  }
}

// R rows' sums of one block into their accumulators (acc[2 r], acc[2 r + 1]: row r's columns 0-7 and 8-15):
// zero points, then acc = fma(float(sum), s_w * s_a, acc).
template <int R>
__attribute__((target("avx2,fma"))) static inline void fold_avx2(const Packed& w, const Activations& a, int64_t t,
                                                                 int64_t b, int64_t m, const __m256i* lo,
                                                                 const __m256i* hi, __m256* acc) {
  const float* scales = w.scales(t, b);
  const __m256 s0 = _mm256_loadu_ps(scales), s1 = _mm256_loadu_ps(scales + 8);
  __m256i z0 = _mm256_setzero_si256(), z1 = z0;
  if (!w.symmetric) {
    z0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.zeros(t, b))));
    z1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.zeros(t, b) + 8)));
  }
  // 8-bit sums are of code - 128: dot(code, a) = that + 128 sum(a)
  const int32_t offset = (w.symmetric ? 1 << (w.bits - 1) : 0) - (w.bits == 8 ? 128 : 0);
  for (int r = 0; r < R; ++r) {
    const int32_t suma = a.sum[size_t((m + r) * a.blocks + b)];
    __m256i zs0 = _mm256_set1_epi32(offset * suma), zs1 = zs0;
    if (!w.symmetric) {
      zs0 = _mm256_add_epi32(zs0, _mm256_mullo_epi32(z0, _mm256_set1_epi32(suma)));
      zs1 = _mm256_add_epi32(zs1, _mm256_mullo_epi32(z1, _mm256_set1_epi32(suma)));
    }
    const __m256 sa = _mm256_set1_ps(a.scale[size_t((m + r) * a.blocks + b)]);
    acc[2 * r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(lo[r], zs0)), _mm256_mul_ps(s0, sa), acc[2 * r]);
    acc[2 * r + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(hi[r], zs1)), _mm256_mul_ps(s1, sa),
                                     acc[2 * r + 1]);
  }
}

// One block's sums of R rows against a tile, the block size fixed where it is the common 32.
template <int R, bool PACKED>
__attribute__((target("avx2,fma"))) static inline void block_sums_avx2(const Packed& w, const Activations& a,
                                                                       int64_t b, const uint8_t* src, int64_t m,
                                                                       __m256i* lo, __m256i* hi) {
  const int8_t* q = a.q.data() + m * a.padded + b * w.block;
  if (w.block == 32) {
    sums_avx2<R, PACKED, 8>(w.bits, src, 8, q, a.padded, lo, hi);
  } else {
    sums_avx2<R, PACKED, 0>(w.bits, src, w.block / 4, q, a.padded, lo, hi);
  }
}

// R rows of one block, accumulators in memory (acc_rows: a.m x 16).
template <int R, bool PACKED>
__attribute__((target("avx2,fma"))) static inline void rows_avx2(const Packed& w, const Activations& a, int64_t t,
                                                                 int64_t b, const uint8_t* src, int64_t m,
                                                                 float* acc_rows) {
  __m256i lo[R], hi[R];
  block_sums_avx2<R, PACKED>(w, a, b, src, m, lo, hi);
  __m256 acc[2 * R];
  for (int i = 0; i < 2 * R; ++i) acc[i] = _mm256_loadu_ps(acc_rows + m * kTile + i * 8);
  fold_avx2<R>(w, a, t, b, m, lo, hi, acc);
  for (int i = 0; i < 2 * R; ++i) _mm256_storeu_ps(acc_rows + m * kTile + i * 8, acc[i]);
}

// Decode's path: all R (< 4) rows of tiles [t0, t1), accumulators in registers, 4-bit nibbles split in registers,
// the records kAhead bytes on prefetched.
template <int R>
__attribute__((target("avx2,fma"))) static void few_rows_avx2(const Packed& w, const Activations& a, int64_t t0,
                                                               int64_t t1, float* y) {
  alignas(32) float out[R * kTile];
  for (int64_t t = t0; t < t1; ++t) {
    __m256 acc[2 * R];
    for (int i = 0; i < 2 * R; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w.blocks; ++b) {
      const uint8_t* codes = w.codes(t, b);
      prefetch_ahead(w, codes);
      __m256i lo[R], hi[R];
      block_sums_avx2<R, true>(w, a, b, codes, 0, lo, hi);
      fold_avx2<R>(w, a, t, b, 0, lo, hi, acc);
    }
    for (int i = 0; i < 2 * R; ++i) _mm256_store_ps(out + i * 8, acc[i]);
    store_tile(w, R, t, out, y);
  }
}

__attribute__((target("avx2,fma"))) static void tiles_avx2(const Packed& w, const Activations& a, int64_t t0,
                                                            int64_t t1, float* y) {
  if (a.m == 1) return few_rows_avx2<1>(w, a, t0, t1, y);
  if (a.m == 2) return few_rows_avx2<2>(w, a, t0, t1, y);
  if (a.m == 3) return few_rows_avx2<3>(w, a, t0, t1, y);
  const int chunks = w.block / 4;
  const __m256i low = _mm256_set1_epi8(15);
  alignas(64) uint8_t unpacked[64 * 1024];  // one block's codes, one byte each (block <= 4096)
  std::vector<float> acc_rows(size_t(a.m) * kTile);
  for (int64_t t = t0; t < t1; ++t) {
    std::fill(acc_rows.begin(), acc_rows.end(), 0.0f);
    for (int64_t b = 0; b < w.blocks; ++b) {
      const uint8_t* codes = w.codes(t, b);
      prefetch_ahead(w, codes);
      const uint8_t* src = codes;
      if (w.bits == 4) {  // the nibbles unpacked once, read by every row
        for (int j = 0; j < chunks / 2; ++j) {
          for (int h = 0; h < 2; ++h) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64 + h * 32));
            _mm256_store_si256(reinterpret_cast<__m256i*>(unpacked + (2 * j) * 64 + h * 32), _mm256_and_si256(v, low));
            _mm256_store_si256(reinterpret_cast<__m256i*>(unpacked + (2 * j + 1) * 64 + h * 32),
                               _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
          }
        }
        src = unpacked;
      }
      int64_t m = 0;
      for (; m + 4 <= a.m; m += 4) rows_avx2<4, false>(w, a, t, b, src, m, acc_rows.data());
      for (; m < a.m; ++m) rows_avx2<1, false>(w, a, t, b, src, m, acc_rows.data());
    }
    store_tile(w, a.m, t, acc_rows.data(), y);
  }
}

// ---- AVX-512 VNNI ------------------------------------------------------------------------------------------------

// R rows of one block against a tile's 16 columns: dpbusd takes the unsigned codes (4 or 8 bits) as they are.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma"))) static inline void rows_avx512(
    const Packed& w, const Activations& a, int64_t t, int64_t b, const uint8_t* src, int64_t m, float* acc_rows) {
  const int chunks = w.block / 4;
  const int8_t* q = a.q.data() + m * a.padded + b * w.block;
  __m512i sums[R];
  for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
  for (int g = 0; g < chunks; ++g) {
    const __m512i wv = _mm512_loadu_si512(src + g * 64);
    for (int r = 0; r < R; ++r) {
      sums[r] = _mm512_dpbusd_epi32(sums[r], wv, _mm512_set1_epi32(four_bytes(q + r * a.padded + g * 4)));
    }
  }
  const __m512 s = _mm512_loadu_ps(w.scales(t, b));
  const __m512i z = w.symmetric ? _mm512_set1_epi32(1 << (w.bits - 1))
                                : _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.zeros(t, b))));
  for (int r = 0; r < R; ++r) {
    const __m512i zs = _mm512_mullo_epi32(z, _mm512_set1_epi32(a.sum[size_t((m + r) * a.blocks + b)]));
    const __m512 sa = _mm512_set1_ps(a.scale[size_t((m + r) * a.blocks + b)]);
    float* acc = acc_rows + (m + r) * kTile;
    _mm512_storeu_ps(acc, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums[r], zs)), _mm512_mul_ps(s, sa),
                                          _mm512_loadu_ps(acc)));
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma"))) static void tiles_avx512(
    const Packed& w, const Activations& a, int64_t t0, int64_t t1, float* y) {
  const int chunks = w.block / 4;
  const __m512i low = _mm512_set1_epi8(15);
  alignas(64) uint8_t unpacked[64 * 1024];
  std::vector<float> acc_rows(size_t(a.m) * kTile);
  for (int64_t t = t0; t < t1; ++t) {
    std::fill(acc_rows.begin(), acc_rows.end(), 0.0f);
    for (int64_t b = 0; b < w.blocks; ++b) {
      const uint8_t* codes = w.codes(t, b);
      prefetch_ahead(w, codes);
      const uint8_t* src = codes;
      if (w.bits == 4) {
        for (int j = 0; j < chunks / 2; ++j) {
          const __m512i v = _mm512_loadu_si512(codes + j * 64);
          _mm512_store_si512(unpacked + (2 * j) * 64, _mm512_and_si512(v, low));
          _mm512_store_si512(unpacked + (2 * j + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
        src = unpacked;
      }
      int64_t m = 0;
      for (; m + 4 <= a.m; m += 4) rows_avx512<4>(w, a, t, b, src, m, acc_rows.data());
      for (; m < a.m; ++m) rows_avx512<1>(w, a, t, b, src, m, acc_rows.data());
    }
    store_tile(w, a.m, t, acc_rows.data(), y);
  }
}

#endif  // KILN_X86

void gemm_tiles(Isa isa, const Packed& w, const Activations& a, int64_t t0, int64_t t1, float* y) {
#ifdef KILN_X86
  if (isa == Isa::avx512) return tiles_avx512(w, a, t0, t1, y);
  if (isa == Isa::avx2) return tiles_avx2(w, a, t0, t1, y);
#endif
  (void)isa;
  tiles_scalar(w, a, t0, t1, y);
}

}  // namespace kiln
