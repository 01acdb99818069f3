// Weights in blocks of 32 (GGUF's Q4_1 and Q8_0 layouts) times float32 activations, on AVX2 + FMA.
// Built at first use by fd_core/backends/cpu/blocks.py; runs on torch's own threads
// (at::parallel_for), so the norms and attention between two calls find those threads awake.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

struct Q41 {  // 16 bytes a block of 32: byte j holds element j (low nibble) and j + 16 (high)
  static constexpr int BYTES = 16;
  static inline void unpack(const uint8_t* b, float d, float m, __m256 w[4]) {
    __m128i bytes = _mm_loadu_si128((const __m128i*)b);
    __m128i mask = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(bytes, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), vd, vm);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), vd, vm);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), vd, vm);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), vd, vm);
  }
};

struct Q80 {  // 32 signed bytes a block, element j in byte j
  static constexpr int BYTES = 32;
  static inline void unpack(const uint8_t* b, float d, float m, __m256 w[4]) {
    __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + 8 * i)))),
                             vd, vm);
  }
};

// R rows of x against one weight row. A row's four FMAs a block form one dependency chain
// (~5 cycles each), so with few rows each row sums into A accumulators, A * R <= 4, to keep
// four chains in flight (one row: 2x faster than one accumulator on an AVX2 EPYC).
template <class B, int R>
static inline void rows(const float* x, int64_t K, const uint8_t* q, const float* d, const float* m,
                        int64_t G, float* y, int64_t N, bool add) {
  constexpr int A = R >= 4 ? 1 : (R >= 2 ? 2 : 4);
  __m256 acc[R][A];
  for (int i = 0; i < R; ++i)
    for (int a = 0; a < A; ++a) acc[i][a] = _mm256_setzero_ps();
  __m256 w[4];
  for (int64_t g = 0; g < G; ++g) {
    B::unpack(q + g * B::BYTES, d[g], m ? m[g] : 0.f, w);
    const float* xg = x + g * 32;
    for (int i = 0; i < R; ++i) {
      const float* xr = xg + i * K;
      for (int k = 0; k < 4; ++k)
        acc[i][k % A] = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(xr + 8 * k), acc[i][k % A]);
    }
  }
  for (int i = 0; i < R; ++i) {
    __m256 sum = acc[i][0];
    for (int a = 1; a < A; ++a) sum = _mm256_add_ps(sum, acc[i][a]);
    y[i * N] = add ? y[i * N] + hsum(sum) : hsum(sum);
  }
}

template <class B, int R>
static void tile(const float* x, int64_t K, const uint8_t* Q, const float* D, const float* Mn, int64_t g0,
                 int64_t G, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t blocks = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t at = n * blocks + g0;
    rows<B, R>(x + g0 * 32, K, Q + at * B::BYTES, D + at, Mn ? Mn + at : nullptr, G, y + n, N, g0 > 0);
  }
}

// Eight rows at a time, and for them the input in slices of at most 16 KB (TILE floats a row),
// every output row of the thread's share going through one slice before the next: the slice
// stays in L1 while the weights stream past it, where eight whole rows of a 1,536-wide input
// (48 KB) would be re-read from L2 for each output row.
template <class B>
static void linear(const float* X, int64_t M, int64_t K, const uint8_t* Q, const float* D, const float* Mn,
                   int64_t N, float* Y) {
  const int64_t G = K / 32;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t r = 0; r < M; r += 8) {
      const int64_t R = std::min<int64_t>(8, M - r);
      const int64_t step = std::max<int64_t>(1, 4096 / (R * 32));  // blocks a slice: R * 32 * step floats <= 16 KB
      const float* x = X + r * K;
      float* y = Y + r * N;
      for (int64_t g0 = 0; g0 < G; g0 += step) {
        const int64_t g = std::min<int64_t>(step, G - g0);
        switch (R) {
          case 1: tile<B, 1>(x, K, Q, D, Mn, g0, g, n0, n1, y, N); break;
          case 2: tile<B, 2>(x, K, Q, D, Mn, g0, g, n0, n1, y, N); break;
          case 3: tile<B, 3>(x, K, Q, D, Mn, g0, g, n0, n1, y, N); break;
          case 4: tile<B, 4>(x, K, Q, D, Mn, g0, g, n0, n1, y, N); break;
          case 5: tile<B, 5>(x, K, Q, D, Mn, g0, g, n0, n1, y, N); break;
          case 6: tile<B, 6>(x, K, Q, D, Mn, g0, g, n0, n1, y, N); break;
          case 7: tile<B, 7>(x, K, Q, D, Mn, g0, g, n0, n1, y, N); break;
          default: tile<B, 8>(x, K, Q, D, Mn, g0, g, n0, n1, y, N); break;
        }
      }
    }
  });
}

// y[M, N] = x[M, K] @ w^T, w[n, 32 g + j] = q * d[n, g] + m[n, g] (Q4_1: q the j-th nibble of the
// block's 16 bytes, low nibbles first) or q * d[n, g] (Q8_0: q the j-th signed byte). K % 32 == 0.
extern "C" void fd_q4_1_linear(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* d,
                               const float* m, int64_t N, float* y) {
  linear<Q41>(x, M, K, q, d, m, N, y);
}

extern "C" void fd_q8_0_linear(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* d,
                               const float* m, int64_t N, float* y) {
  linear<Q80>(x, M, K, q, d, m, N, y);
}
