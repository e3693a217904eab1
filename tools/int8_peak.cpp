// The int8 multiply ceiling of this CPU: how many int8 multiply-adds a second the instruction kiln's kernel is built
// on retires, operands in registers (no memory, independent chains), on `threads` threads at once.
// AVX2: vpmaddubsw + vpaddw (32 products a pair); AVX-512 VNNI: vpdpbusd (64 products). tools/bench_kernel.py builds
// and runs it to bound what M rows can cost against one row on this machine.
//
//   int8_peak avx2|avx512vnni THREADS  ->  prints GMAC/s
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

constexpr int kChains = 12;  // AVX-512 chains: vpdpbusd accumulates in place, five cycles a step
constexpr int64_t kIters = 40000000;

// One vpmaddubsw into a scratch register and its vpaddw into chain H. Written as assembly: in C++ the compiler sees
// the same two operands in every chain and computes their product once (GCC does), which measured the adds alone.
#define KILN_PAIR(h, t) "vpmaddubsw %[a], %[w], %%ymm" #t "\n\tvpaddw %%ymm" #t ", %[" #h "], %[" #h "]\n\t"

__attribute__((target("avx2"), noinline)) static int avx2(int seed) {
  const __m256i w = _mm256_set1_epi8(char(seed)), a = _mm256_set1_epi8(char(seed + 2));
  __m256i h0, h1, h2, h3, h4, h5, h6, h7;  // eight chains: an add's latency is one cycle, four would do
  h0 = h1 = h2 = h3 = h4 = h5 = h6 = h7 = _mm256_setzero_si256();
  for (int64_t i = 0; i < kIters; ++i) {
    __asm__ volatile(KILN_PAIR(h0, 12) KILN_PAIR(h1, 13) KILN_PAIR(h2, 14) KILN_PAIR(h3, 15) KILN_PAIR(h4, 12)
                         KILN_PAIR(h5, 13) KILN_PAIR(h6, 14) KILN_PAIR(h7, 15)
                     : [h0] "+x"(h0), [h1] "+x"(h1), [h2] "+x"(h2), [h3] "+x"(h3), [h4] "+x"(h4), [h5] "+x"(h5),
                       [h6] "+x"(h6), [h7] "+x"(h7)
                     : [a] "x"(a), [w] "x"(w)
                     : "xmm12", "xmm13", "xmm14", "xmm15");
  }
  const __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(h0, h1), _mm256_add_epi16(h2, h3)),
                                     _mm256_add_epi16(_mm256_add_epi16(h4, h5), _mm256_add_epi16(h6, h7)));
  return _mm256_extract_epi16(s, 0);
}

__attribute__((target("avx512f,avx512vnni"), noinline)) static int avx512vnni(int seed) {
  __m512i w0 = _mm512_set1_epi8(char(seed)), w1 = _mm512_set1_epi8(char(seed + 1)), a = _mm512_set1_epi8(char(seed + 2));
  __m512i h[kChains];
  for (auto& v : h) v = _mm512_setzero_si512();
  for (int64_t i = 0; i < kIters; ++i) {
#pragma GCC unroll 12
    for (int r = 0; r < kChains; ++r) h[r] = _mm512_dpbusd_epi32(h[r], r & 1 ? w1 : w0, a);
    __asm__ volatile("" : "+v"(a));
  }
  __m512i s = h[0];
  for (int r = 1; r < kChains; ++r) s = _mm512_add_epi32(s, h[r]);
  return _mm512_reduce_add_epi32(s);
}

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: int8_peak avx2|avx512vnni THREADS\n");
    return 2;
  }
  const bool wide = std::strcmp(argv[1], "avx512vnni") == 0;
  const int threads = std::atoi(argv[2]);
  std::vector<int> sink(threads);
  std::vector<std::thread> pool;
  const auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { sink[t] = wide ? avx512vnni(t) : avx2(t); });
  for (auto& p : pool) p.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double macs = double(kIters) * (wide ? kChains * 64 : 8 * 32) * threads;
  std::printf("%.3f %d\n", macs / s / 1e9, sink[0] & 1);
  return 0;
}
