/* Fused CPU kernels for attnscore (masked softmax, additive scores, dot-product attention by
 * lengths).
 *
 * Every kernel works on a half-open range of rows [r0, r1); Python splits the rows into
 * ranges of equal work. The attention kernels by lengths take tasks from a shared counter
 * instead (FA_NEXT). Two ways to run the ranges in parallel:
 *   - built with -fopenmp (only when torch's own OpenMP runtime is libgomp, so that loading
 *     this library reuses the copy torch loaded): the *_par drivers below run one range per
 *     thread of torch's OpenMP pool, the threads torch.compile's kernels also use, so no
 *     second set of threads competes with them for the cores;
 *   - otherwise (-fopenmp-simd, no runtime linked): Python threads call the kernels (ctypes
 *     releases the GIL), and the drivers' pragma is ignored (a serial loop).
 * `#pragma omp simd` plus -ffast-math lets gcc vectorize the loops (and call glibc's libmvec
 * tanhf); float32 softmaxes use exp_neg below, float64 ones libm's exp.
 * Padded positions are never read, so NaN/inf garbage there cannot leak into results. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#if defined(__F16C__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

/* ---- exp of a non-positive float32 ---------------------------------------------------------
 * Softmax takes exp(x - max) <= 1 only. Cephes' expf (range reduction by ln 2 in two parts, a
 * degree-5 polynomial; about 1 ulp, checked against float64 in the tests) in plain arithmetic
 * that vectorizes, several times cheaper than libm's expf. Below -87.3 (where 2^n leaves the
 * normal range) it is 0; NaN stays NaN. */
static inline float exp_neg(float x) {
  /* an integer test: -ffast-math may assume that no float is NaN, and NaN must propagate */
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  const int nan = (u & 0x7fffffffu) > 0x7f800000u;
  /* The exponent is computed from x clamped to [-88, 88] (NaN as 0), so that the conversion
   * to int below is always defined; below -87.3 the result is chosen at the end. */
  const float xc = nan ? 0.0f : (x < -88.0f ? -88.0f : (x > 88.0f ? 88.0f : x));
  const float n = floorf(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = ((int32_t)n + 127) * (1 << 23);
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  const float e = x < -87.3f ? 0.0f : p * scale;
  return nan ? x : e;
}

/* ---- masked softmax: one row ------------------------------------------------------------
 * y[:L] = softmax(x[:L]) over the first L > 0 entries; y may be x (in place). */
#define DEFINE_SOFTMAX_ROW(CT, SUF, EXP)                                                    \
  static inline void softmax_row_##SUF(const CT *x, CT *y, int64_t L) {                     \
    CT mx = x[0];                                                                           \
    _Pragma("omp simd reduction(max : mx)") for (int64_t j = 0; j < L; ++j) {               \
      mx = x[j] > mx ? x[j] : mx;                                                           \
    }                                                                                       \
    CT s = 0;                                                                               \
    _Pragma("omp simd reduction(+ : s)") for (int64_t j = 0; j < L; ++j) {                  \
      CT e = EXP(x[j] - mx);                                                                \
      y[j] = e;                                                                             \
      s += e;                                                                               \
    }                                                                                       \
    CT inv = (CT)1 / s;                                                                     \
    _Pragma("omp simd") for (int64_t j = 0; j < L; ++j) y[j] *= inv;                        \
  }                                                                                         \
  /* dx[:L] = y * (g - sum(g * y)); dx may be g (in place). */                              \
  static inline void softmax_backward_row_##SUF(const CT *y, const CT *g, CT *dx, int64_t L) { \
    CT s = 0;                                                                               \
    _Pragma("omp simd reduction(+ : s)") for (int64_t j = 0; j < L; ++j) s += g[j] * y[j];  \
    _Pragma("omp simd") for (int64_t j = 0; j < L; ++j) dx[j] = y[j] * (g[j] - s);          \
  }

DEFINE_SOFTMAX_ROW(double, f64, exp)
DEFINE_SOFTMAX_ROW(float, f32, exp_neg)

static inline int64_t clamp_length(int64_t L, int64_t m) { return L < 0 ? 0 : (L > m ? m : L); }

/* ---- software prefetch of the rows ahead --------------------------------------------------
 * Rows read up to their length only leave gaps in the stream of addresses that the hardware
 * prefetcher follows: on the 2-core Zen 4 VM a masked softmax backward over bfloat16 rows of
 * uniform lengths ran 15-25% faster with the next rows' valid entries prefetched (a C harness,
 * four alternating rounds). Before row r, rows_ahead tops up the prefetched window to
 * PREFETCH_AHEAD bytes of valid entries per array: `next` is the first row not yet prefetched
 * and `ahead` the valid bytes prefetched beyond row r (both start at 0). Prefetching never
 * faults, and these addresses are the ones the row loop reads next. */
#define PREFETCH_AHEAD 2048

static inline void prefetch_bytes(const char *p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

static inline void rows_ahead(const void *a, const void *b, int64_t esize,
                              const int64_t *lengths, int64_t r, int64_t r1, int64_t m,
                              int64_t div, int64_t *next, int64_t *ahead) {
  if (*next <= r) {
    *next = r + 1; /* row r itself is read now: start after it */
    *ahead = 0;
  } else {
    *ahead -= clamp_length(lengths[r / div], m) * esize;
  }
  while (*next < r1 && *ahead < PREFETCH_AHEAD) {
    const int64_t bytes = clamp_length(lengths[*next / div], m) * esize;
    prefetch_bytes((const char *)a + *next * m * esize, bytes);
    if (b) prefetch_bytes((const char *)b + *next * m * esize, bytes);
    *ahead += bytes;
    ++*next;
  }
}

/* ---- masked softmax: float32 and float64 rows, in place in the output -------------------
 * y[r, :L] = softmax(x[r, :L]), y[r, L:] = 0 with L = min(lengths[r / div], m) (div rows share
 * a length: the queries and heads of one example); rows with L == 0 are zero. Padded
 * positions are never read. */
#define DEFINE_MASKED_SOFTMAX(T, SUF)                                                       \
  void masked_softmax_##SUF(const T *x, const int64_t *lengths, T *y, int64_t r0,           \
                            int64_t r1, int64_t m, int64_t div) {                           \
    int64_t next = 0, ahead = 0;                                                            \
    for (int64_t r = r0; r < r1; ++r) {                                                     \
      int64_t L = clamp_length(lengths[r / div], m);                                        \
      T *yr = y + r * m;                                                                    \
      rows_ahead(x, NULL, sizeof(T), lengths, r, r1, m, div, &next, &ahead);                \
      if (L > 0) softmax_row_##SUF(x + r * m, yr, L);                                       \
      if (L < m) memset(yr + L, 0, (size_t)(m - L) * sizeof(T));                            \
    }                                                                                       \
  }                                                                                         \
  /* dx = y * (g - sum(g * y)) on the first L positions, exact zeros elsewhere; g's rows are \
     gs apart (m, or 0 for one row broadcast to all, as the gradient of a sum). */          \
  void masked_softmax_backward_##SUF(const T *y, const T *g, const int64_t *lengths, T *dx, \
                                     int64_t r0, int64_t r1, int64_t m, int64_t div,        \
                                     int64_t gs) {                                          \
    int64_t next = 0, ahead = 0;                                                            \
    for (int64_t r = r0; r < r1; ++r) {                                                     \
      int64_t L = clamp_length(lengths[r / div], m);                                        \
      T *dr = dx + r * m;                                                                   \
      rows_ahead(y, gs ? g : NULL, sizeof(T), lengths, r, r1, m, div, &next, &ahead);       \
      if (L > 0) softmax_backward_row_##SUF(y + r * m, g + r * gs, dr, L);                  \
      if (L < m) memset(dr + L, 0, (size_t)(m - L) * sizeof(T));                            \
    }                                                                                       \
  }

DEFINE_MASKED_SOFTMAX(double, f64)
DEFINE_MASKED_SOFTMAX(float, f32)

/* ---- 16-bit rows ------------------------------------------------------------------------
 * A 16-bit softmax reads and writes 16-bit memory only (like torch.softmax) and computes in
 * float32: each row helper converts as it reads and rounds (to nearest even) as it writes:
 *   <t>_row_max(src, dst, L)            dst = float(src), returns the max
 *   <t>_row_scaled(src, dst, L, scale)  dst = round(src * scale)
 *   <t>_dot(a, b, L)                    sum float(a) * float(b)
 *   <t>_row_backward(y, g, dx, L, s)    dx = round(y * (g - s))
 * bfloat16 in plain C (shifts, which gcc vectorizes); float16 with F16C's 8-wide conversions
 * (or the compiler's _Float16, one at a time, where F16C is missing). */
static inline float bf16_value(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint16_t bf16_round(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  /* integer tests: -ffast-math may assume that no float is NaN */
  uint32_t is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (uint16_t)(is_nan ? ((u >> 16) | 0x40u) : rounded);
}

static float bf16_row_max(const uint16_t *src, float *dst, int64_t L) {
  float mx = bf16_value(src[0]);
  _Pragma("omp simd reduction(max : mx)") for (int64_t j = 0; j < L; ++j) {
    float v = bf16_value(src[j]);
    dst[j] = v;
    mx = v > mx ? v : mx;
  }
  return mx;
}

static void bf16_row_scaled(const float *src, uint16_t *dst, int64_t L, float scale) {
  _Pragma("omp simd") for (int64_t j = 0; j < L; ++j) dst[j] = bf16_round(src[j] * scale);
}

static float bf16_dot(const uint16_t *a, const uint16_t *b, int64_t L) {
  float s = 0;
  _Pragma("omp simd reduction(+ : s)") for (int64_t j = 0; j < L; ++j) {
    s += bf16_value(a[j]) * bf16_value(b[j]);
  }
  return s;
}

static void bf16_row_backward(const uint16_t *y, const uint16_t *g, uint16_t *dx, int64_t L,
                              float s) {
  _Pragma("omp simd") for (int64_t j = 0; j < L; ++j) {
    dx[j] = bf16_round(bf16_value(y[j]) * (bf16_value(g[j]) - s));
  }
}

static void bf16_to_f32_row(const uint16_t *src, float *dst, int64_t L) {
  _Pragma("omp simd") for (int64_t j = 0; j < L; ++j) dst[j] = bf16_value(src[j]);
}

#if defined(__F16C__) /* x86-64 with F16C: 8 conversions per instruction */
#define ATTNSCORE_HAVE_F16 1
#define F16_LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define F16_STORE8(p, v) _mm_storeu_si128((__m128i *)(p), _mm256_cvtps_ph((v), _MM_FROUND_TO_NEAREST_INT))

static inline float f16_value(uint16_t h) { return _cvtsh_ss(h); }

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static float f16_row_max(const uint16_t *src, float *dst, int64_t L) {
  int64_t j = 0;
  float mx = _cvtsh_ss(src[0]);
  if (L >= 8) {
    __m256 vmax = F16_LOAD8(src);
    for (; j + 8 <= L; j += 8) {
      __m256 v = F16_LOAD8(src + j);
      _mm256_storeu_ps(dst + j, v);
      vmax = _mm256_max_ps(vmax, v);
    }
    mx = hmax8(vmax);
  }
  for (; j < L; ++j) {
    dst[j] = _cvtsh_ss(src[j]);
    mx = dst[j] > mx ? dst[j] : mx;
  }
  return mx;
}

static void f16_row_scaled(const float *src, uint16_t *dst, int64_t L, float scale) {
  int64_t j = 0;
  const __m256 vs = _mm256_set1_ps(scale);
  for (; j + 8 <= L; j += 8) F16_STORE8(dst + j, _mm256_mul_ps(_mm256_loadu_ps(src + j), vs));
  for (; j < L; ++j) dst[j] = _cvtss_sh(src[j] * scale, _MM_FROUND_TO_NEAREST_INT);
}

static float f16_dot(const uint16_t *a, const uint16_t *b, int64_t L) {
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 acc16 = _mm512_setzero_ps();
  for (; j + 16 <= L; j += 16) {
    __m512 va = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(a + j)));
    __m512 vb = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + j)));
    acc16 = _mm512_fmadd_ps(va, vb, acc16);
  }
  float s16 = _mm512_reduce_add_ps(acc16);
#else
  float s16 = 0.0f;
#endif
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= L; j += 8) acc = _mm256_fmadd_ps(F16_LOAD8(a + j), F16_LOAD8(b + j), acc);
  float s = s16 + hsum8(acc);
  for (; j < L; ++j) s += _cvtsh_ss(a[j]) * _cvtsh_ss(b[j]);
  return s;
}

static void f16_row_backward(const uint16_t *y, const uint16_t *g, uint16_t *dx, int64_t L,
                             float s) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 vs16 = _mm512_set1_ps(s);
  for (; j + 16 <= L; j += 16) {
    __m512 vy = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(y + j)));
    __m512 vg = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + j)));
    __m256i h = _mm512_cvtps_ph(_mm512_mul_ps(vy, _mm512_sub_ps(vg, vs16)),
                                _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256((__m256i *)(dx + j), h);
  }
#endif
  const __m256 vs = _mm256_set1_ps(s);
  for (; j + 8 <= L; j += 8) {
    F16_STORE8(dx + j, _mm256_mul_ps(F16_LOAD8(y + j), _mm256_sub_ps(F16_LOAD8(g + j), vs)));
  }
  for (; j < L; ++j) {
    dx[j] = _cvtss_sh(_cvtsh_ss(y[j]) * (_cvtsh_ss(g[j]) - s), _MM_FROUND_TO_NEAREST_INT);
  }
}

static void f16_to_f32_row(const uint16_t *src, float *dst, int64_t L) {
  int64_t j = 0;
  for (; j + 8 <= L; j += 8) _mm256_storeu_ps(dst + j, F16_LOAD8(src + j));
  for (; j < L; ++j) dst[j] = _cvtsh_ss(src[j]);
}

static void f32_to_f16_row(const float *src, uint16_t *dst, int64_t L) {
  f16_row_scaled(src, dst, L, 1.0f);
}
#elif defined(__FLT16_MANT_DIG__) /* elsewhere, the compiler's _Float16 */
#define ATTNSCORE_HAVE_F16 1
static inline float f16_value(uint16_t h) {
  _Float16 f;
  memcpy(&f, &h, sizeof f);
  return (float)f;
}

static inline uint16_t f16_round(float v) {
  _Float16 f = (_Float16)v;
  uint16_t h;
  memcpy(&h, &f, sizeof h);
  return h;
}

static float f16_row_max(const uint16_t *src, float *dst, int64_t L) {
  float mx = f16_value(src[0]);
  for (int64_t j = 0; j < L; ++j) {
    dst[j] = f16_value(src[j]);
    mx = dst[j] > mx ? dst[j] : mx;
  }
  return mx;
}

static void f16_row_scaled(const float *src, uint16_t *dst, int64_t L, float scale) {
  for (int64_t j = 0; j < L; ++j) dst[j] = f16_round(src[j] * scale);
}

static float f16_dot(const uint16_t *a, const uint16_t *b, int64_t L) {
  float s = 0;
  for (int64_t j = 0; j < L; ++j) s += f16_value(a[j]) * f16_value(b[j]);
  return s;
}

static void f16_row_backward(const uint16_t *y, const uint16_t *g, uint16_t *dx, int64_t L,
                             float s) {
  for (int64_t j = 0; j < L; ++j) dx[j] = f16_round(f16_value(y[j]) * (f16_value(g[j]) - s));
}

static void f16_to_f32_row(const uint16_t *src, float *dst, int64_t L) {
  for (int64_t j = 0; j < L; ++j) dst[j] = f16_value(src[j]);
}

static void f32_to_f16_row(const float *src, uint16_t *dst, int64_t L) {
  f16_row_scaled(src, dst, L, 1.0f);
}
#else
#define ATTNSCORE_HAVE_F16 0
#endif

static void f32_to_bf16_row(const float *src, uint16_t *dst, int64_t L) {
  bf16_row_scaled(src, dst, L, 1.0f);
}

/* exps of row - mx in place; returns their sum */
static inline float exp_sum_row(float *row, int64_t L, float mx) {
  float s = 0;
  _Pragma("omp simd reduction(+ : s)") for (int64_t j = 0; j < L; ++j) {
    float e = exp_neg(row[j] - mx);
    row[j] = e;
    s += e;
  }
  return s;
}

#define DEFINE_MASKED_SOFTMAX_16(SUF)                                                       \
  void masked_softmax_##SUF(const uint16_t *x, const int64_t *lengths, uint16_t *y,         \
                            int64_t r0, int64_t r1, int64_t m, int64_t div) {               \
    float *row = (float *)malloc((size_t)(m > 0 ? m : 1) * sizeof(float));                  \
    int64_t next = 0, ahead = 0;                                                            \
    for (int64_t r = r0; r < r1; ++r) {                                                     \
      int64_t L = clamp_length(lengths[r / div], m);                                        \
      uint16_t *yr = y + r * m;                                                             \
      rows_ahead(x, NULL, 2, lengths, r, r1, m, div, &next, &ahead);                        \
      if (L > 0) {                                                                          \
        float mx = SUF##_row_max(x + r * m, row, L);                                        \
        float s = exp_sum_row(row, L, mx);                                                  \
        SUF##_row_scaled(row, yr, L, 1.0f / s);                                             \
      }                                                                                     \
      if (L < m) memset(yr + L, 0, (size_t)(m - L) * sizeof(uint16_t));                     \
    }                                                                                       \
    free(row);                                                                              \
  }                                                                                         \
  void masked_softmax_backward_##SUF(const uint16_t *y, const uint16_t *g,                  \
                                     const int64_t *lengths, uint16_t *dx, int64_t r0,      \
                                     int64_t r1, int64_t m, int64_t div, int64_t gs) {      \
    int64_t next = 0, ahead = 0;                                                            \
    for (int64_t r = r0; r < r1; ++r) {                                                     \
      int64_t L = clamp_length(lengths[r / div], m);                                        \
      const uint16_t *yr = y + r * m, *gr = g + r * gs;                                     \
      uint16_t *dr = dx + r * m;                                                            \
      rows_ahead(y, gs ? g : NULL, 2, lengths, r, r1, m, div, &next, &ahead);               \
      if (L > 0) SUF##_row_backward(yr, gr, dr, L, SUF##_dot(gr, yr, L));                   \
      if (L < m) memset(dr + L, 0, (size_t)(m - L) * sizeof(uint16_t));                     \
    }                                                                                       \
  }

DEFINE_MASKED_SOFTMAX_16(bf16)
#if ATTNSCORE_HAVE_F16
DEFINE_MASKED_SOFTMAX_16(f16)
#endif

/* ---- float16 matrix products, accumulated in float32 -------------------------------------
 * PyTorch's CPU matmul in float16 runs 10-30x slower than in float32 where the CPU has no
 * float16 arithmetic. Here a panel of MM_COLS columns of B is converted to float32 once per
 * batch entry and row range, MM_ROWS rows of A at a time are converted and multiplied into
 * MM_ROWS x MM_COLS float32 accumulators held in vector registers, and each result is rounded
 * once to float16 (as PyTorch's own float16 products accumulate in float32). Scratch: the
 * panel (k x MM_COLS floats) and the rows (MM_ROWS x k floats), per range.
 * A's element (b, i, p) is A[b*sab + i*sar + p*sak], B's (b, p, j) B[b*sbb + p*sbk + j*sbc];
 * C is contiguous (batch, rows, cols); [r0, r1) ranges over the flattened (batch, rows). */
#if ATTNSCORE_HAVE_F16
#define MM_COLS 64
#define MM_ROWS 4
typedef float mm_vec __attribute__((vector_size(64))); /* 16 floats: MM_COLS / 4 */

static void mm_convert(const uint16_t *src, int64_t stride, float *dst, int64_t L) {
  if (stride == 1) {
    f16_to_f32_row(src, dst, L);
    return;
  }
  for (int64_t j = 0; j < L; ++j) dst[j] = f16_value(src[j * stride]);
}

void matmul_f16(const uint16_t *A, const uint16_t *B, uint16_t *C, int64_t r0, int64_t r1,
                int64_t rows, int64_t k, int64_t cols, int64_t sab, int64_t sar, int64_t sak,
                int64_t sbb, int64_t sbk, int64_t sbc) {
  const size_t kk = (size_t)(k > 0 ? k : 1);
  float *panel = (float *)aligned_alloc(64, kk * MM_COLS * sizeof(float));
  float *arows = (float *)malloc(kk * MM_ROWS * sizeof(float));
  for (int64_t r = r0; r < r1;) {
    const int64_t b = r / rows, i0 = r % rows;
    const int64_t i1 = i0 + (r1 - r) < rows ? i0 + (r1 - r) : rows;
    for (int64_t j0 = 0; j0 < cols; j0 += MM_COLS) {
      const int64_t nc = cols - j0 < MM_COLS ? cols - j0 : MM_COLS;
      for (int64_t p = 0; p < k; ++p) {
        float *dst = panel + p * MM_COLS;
        mm_convert(B + b * sbb + p * sbk + j0 * sbc, sbc, dst, nc);
        for (int64_t j = nc; j < MM_COLS; ++j) dst[j] = 0.0f;
      }
      for (int64_t i = i0; i < i1; i += MM_ROWS) {
        const int64_t nr = i1 - i < MM_ROWS ? i1 - i : MM_ROWS;
        for (int64_t q = 0; q < MM_ROWS; ++q) {
          if (q < nr) mm_convert(A + b * sab + (i + q) * sar, sak, arows + q * k, k);
          else memset(arows + q * k, 0, (size_t)k * sizeof(float));
        }
        mm_vec acc[MM_ROWS][4];
        memset(acc, 0, sizeof(acc));
        for (int64_t p = 0; p < k; ++p) {
          const mm_vec *bv = (const mm_vec *)(panel + p * MM_COLS);
          const mm_vec b0 = bv[0], b1 = bv[1], b2 = bv[2], b3 = bv[3];
          for (int q = 0; q < MM_ROWS; ++q) {
            const float a = arows[q * k + p];
            acc[q][0] += a * b0;
            acc[q][1] += a * b1;
            acc[q][2] += a * b2;
            acc[q][3] += a * b3;
          }
        }
        for (int64_t q = 0; q < nr; ++q) {
          f32_to_f16_row((const float *)acc[q], C + (b * rows + i + q) * cols + j0, nc);
        }
      }
    }
    r += i1 - i0;
  }
  free(panel);
  free(arows);
}
#endif

/* ---- dot-product attention by per-query lengths, forward ---------------------------------
 * out[b, h, i] = softmax(scale * q[b, h, i] . k[b, h, :L]) @ v[b, h, :L] with L the length of
 * query i (clamped to m), and zeros where L == 0. PyTorch's CPU flash kernel takes keys in
 * blocks of 512, so a mask inside a call saves nothing; here the work follows each query's own
 * length instead. One task is one (example, head): its queries are taken in order of length
 * (`order`: each example's queries sorted by length, `sorted`: those lengths, ascending),
 * FA_ROWS at a time, and each tile of queries computes over the keys its longest query
 * attends. Keys and values beyond the example's longest length, and queries that attend
 * nothing, are never read.
 *
 * Everything is computed in float32 (16-bit inputs are converted as they are read, the output
 * rounded once): per task, the keys the example attends are packed as K^T in panels of FA_KEYS
 * keys and the values as float32 rows; per tile, the queries' scores are products of
 * FA_ROWS x FA_KEYS held in vector registers, their softmax runs row by row over the row's
 * own length (exact zeros beyond it), and the output is FA_ROWS x 32 products at a time.
 * A task with fewer queries than a tile (decoder steps) takes them row by row, unpacked.
 * With `lse`, each row's logsumexp of its scaled scores is written as PyTorch's flash op
 * keeps it (0 for a row of length 0), for the backward below.
 * Scratch per thread: the panels, the values and one tile of scores (about 4 m (d + dv)
 * bytes).
 *
 * Strides are in elements, the last dimension contiguous: st = {q's b, h, i; k's b, h, j;
 * v's b, h, j; out's b, h, i; order and sorted's b, h} (their h stride is 0 when the heads
 * share the lengths). Tasks 0..tasks range over (b * H + h) * chunks + c, chunk c of the
 * sorted queries (longest first); `next`, where threads share the tasks, is their counter
 * (NULL: this thread takes them all). */
#define FA_ROWS 8
#define FA_KEYS 32
/* The next task: from the shared counter where threads share the tasks, else `serial`. */
#define FA_NEXT(next, serial) ((next) ? __atomic_fetch_add((next), 1, __ATOMIC_RELAXED) : (serial))
typedef float fa_vec __attribute__((vector_size(64)));

/* The queries [*lo, *hi) of the sorted ones that chunk c of `chunks` takes, cut between
 * tiles (the last chunk takes the rest). */
static inline void fa_chunk(int64_t c, int64_t n, int64_t chunks, int64_t *lo, int64_t *hi) {
  *lo = c * n / chunks / FA_ROWS * FA_ROWS;
  *hi = c + 1 == chunks ? n : (c + 1) * n / chunks / FA_ROWS * FA_ROWS;
}

/* (b, h, c) of task t: each (example, head)'s chunks longest first. */
#define FA_TASK(t, H, chunks, b, h, c)                                                      \
  const int64_t b = (t) / (chunks) / (H), h = (t) / (chunks) % (H);                         \
  const int64_t c = (chunks)-1 - (t) % (chunks)

typedef struct {
  int64_t work, task;
} fa_task;

/* Most work first, ties in task order: a total order, so every thread sorts alike. */
static int fa_task_cmp(const void *a, const void *b) {
  const fa_task *x = (const fa_task *)a, *y = (const fa_task *)b;
  if (x->work != y->work) return x->work > y->work ? -1 : 1;
  return (x->task > y->task) - (x->task < y->task);
}

/* The work of task t: the sum of its chunk's query lengths. */
static int64_t fa_task_work(const int64_t *sorted, const int64_t *st, int64_t t, int64_t H,
                            int64_t n, int64_t m, int64_t chunks) {
  FA_TASK(t, H, chunks, b, h, c);
  int64_t lo, hi, work = 0;
  fa_chunk(c, n, chunks, &lo, &hi);
  const int64_t *len = sorted + b * st[12] + h * st[13];
  for (int64_t i = lo; i < hi; ++i) work += clamp_length(len[i], m);
  return work;
}

/* The order in which threads sharing the tasks take them: most work first (the sum of the
 * chunk's query lengths), so that they finish together. Taken in index order, a long
 * (example, head) drawn last keeps one thread working alone while the others wait: with 8
 * tasks of lengths uniform in [1, m] on 2 threads, the last to finish carried 3.6% more
 * than half the work where most-work-first leaves 0.2%. Every thread computes the same
 * order (no state shared beyond the counter); the order never changes a task's arithmetic,
 * so results are the same bits either way. NULL (index order) for a thread that takes
 * every task, for decoder steps (fewer queries than a tile: a step lasts tens of
 * microseconds, of which working out an order took 2%, and it has as many tasks as
 * (example, head) pairs, which balance as they come), where every task has the same work,
 * or where memory runs out; the caller frees it. */
static int64_t *fa_task_order(const int64_t *sorted, const int64_t *st, const int64_t *next,
                              int64_t tasks, int64_t H, int64_t n, int64_t m, int64_t chunks) {
  if (next == NULL || tasks < 2 || n < FA_ROWS) return NULL;
  const int64_t first = fa_task_work(sorted, st, 0, H, n, m, chunks);
  int64_t t = 1;
  while (t < tasks && fa_task_work(sorted, st, t, H, n, m, chunks) == first) ++t;
  if (t == tasks) return NULL;
  fa_task *w = (fa_task *)malloc((size_t)tasks * sizeof(fa_task));
  int64_t *order = (int64_t *)malloc((size_t)tasks * sizeof(int64_t));
  if (w == NULL || order == NULL) {
    free(w);
    free(order);
    return NULL;
  }
  for (t = 0; t < tasks; ++t) w[t] = (fa_task){fa_task_work(sorted, st, t, H, n, m, chunks), t};
  qsort(w, (size_t)tasks, sizeof(fa_task), fa_task_cmp);
  for (t = 0; t < tasks; ++t) order[t] = w[t].task;
  free(w);
  return order;
}

static void f32_copy_row(const float *src, float *dst, int64_t L) {
  memcpy(dst, src, (size_t)L * sizeof(float));
}

/* s[r, :FA_KEYS * panels] = qt[r] . kt for the FA_ROWS rows of qt (d floats each, ldq apart;
 * s's rows ls apart). */
static void fa_scores(const float *qt, const float *kt, float *s, int64_t panels, int64_t d,
                      int64_t ldq, int64_t ls) {
  for (int64_t p = 0; p < panels; ++p) {
    const float *kp = kt + p * d * FA_KEYS;
    fa_vec a0[FA_ROWS], a1[FA_ROWS];
    for (int r = 0; r < FA_ROWS; ++r) a0[r] = a1[r] = (fa_vec){0};
    for (int64_t c = 0; c < d; ++c) {
      const fa_vec k0 = *(const fa_vec *)(kp + c * FA_KEYS);
      const fa_vec k1 = *(const fa_vec *)(kp + c * FA_KEYS + 16);
      _Pragma("GCC unroll 8") for (int r = 0; r < FA_ROWS; ++r) {
        const float x = qt[r * ldq + c];
        a0[r] += x * k0;
        a1[r] += x * k1;
      }
    }
    for (int r = 0; r < FA_ROWS; ++r) {
      *(fa_vec *)(s + r * ls + p * FA_KEYS) = a0[r];
      *(fa_vec *)(s + r * ls + p * FA_KEYS + 16) = a1[r];
    }
  }
}

/* o[r, :dvp] = p[r, :keys] @ vp[:keys] for the FA_ROWS rows of p (rows ls apart); vp's rows
 * (and o's) are dvp floats, a multiple of 32. */
static void fa_values(const float *p, const float *vp, float *o, int64_t keys, int64_t ls,
                      int64_t dvp) {
  for (int64_t c0 = 0; c0 < dvp; c0 += 32) {
    fa_vec a0[FA_ROWS], a1[FA_ROWS];
    for (int r = 0; r < FA_ROWS; ++r) a0[r] = a1[r] = (fa_vec){0};
    for (int64_t j = 0; j < keys; ++j) {
      const fa_vec v0 = *(const fa_vec *)(vp + j * dvp + c0);
      const fa_vec v1 = *(const fa_vec *)(vp + j * dvp + c0 + 16);
      _Pragma("GCC unroll 8") for (int r = 0; r < FA_ROWS; ++r) {
        const float x = p[r * ls + j];
        a0[r] += x * v0;
        a1[r] += x * v1;
      }
    }
    for (int r = 0; r < FA_ROWS; ++r) {
      *(fa_vec *)(o + r * dvp + c0) = a0[r];
      *(fa_vec *)(o + r * dvp + c0 + 16) = a1[r];
    }
  }
}

static inline float fa_dot(const float *a, const float *b, int64_t n) {
  float acc = 0.0f;
  _Pragma("omp simd reduction(+ : acc)") for (int64_t c = 0; c < n; ++c) acc += a[c] * b[c];
  return acc;
}

/* The softmax of one tile row in place: s[:L] scaled by `scale` -> probabilities, zeros on
 * [L, keys); returns 1 / their sum (0 when L == 0: the row is zeros) and sets *top to the
 * largest scaled score. */
static float fa_softmax_row(float *s, int64_t L, int64_t keys, float scale, float *top) {
  float inv = 0.0f;
  if (L > 0) {
    float mx = s[0];
    _Pragma("omp simd reduction(max : mx)") for (int64_t j = 0; j < L; ++j) {
      mx = s[j] > mx ? s[j] : mx;
    }
    float sum = 0.0f;
    _Pragma("omp simd reduction(+ : sum)") for (int64_t j = 0; j < L; ++j) {
      const float e = exp_neg((s[j] - mx) * scale);
      s[j] = e;
      sum += e;
    }
    inv = 1.0f / sum;
    *top = mx * scale;
  }
  if (keys > L) memset(s + L, 0, (size_t)(keys - L) * sizeof(float));
  return inv;
}

/* Rows [0, rows) of src (each `width` values, `stride` apart, in the source's dtype) into dst
 * as float32: K^T in panels of FA_KEYS keys when `panel`, else rows of `pad` floats (zeros
 * beyond width). `row` is scratch of `width` floats. */
#define FA_PACK(TO_F32, src, stride, rows, width, dst, pad, panel, row)                     \
  for (int64_t j = 0; j < (rows); ++j) {                                                    \
    if (panel) {                                                                            \
      TO_F32((src) + j * (stride), row, width);                                             \
      float *kr_ = (dst) + (j / FA_KEYS) * (width) * FA_KEYS + j % FA_KEYS;                 \
      for (int64_t c_ = 0; c_ < (width); ++c_) kr_[c_ * FA_KEYS] = row[c_];                 \
    } else {                                                                                \
      TO_F32((src) + j * (stride), (dst) + j * (pad), width);                               \
      for (int64_t c_ = (width); c_ < (pad); ++c_) (dst)[j * (pad) + c_] = 0.0f;            \
    }                                                                                       \
  }

/* A row of `width` values of src (in the source's dtype) as float32: src itself for float32
 * (no copy), else converted into `buf`. */
#define FA_F32_ROW(T, TO_F32, src, buf, width)                                              \
  (sizeof(T) == sizeof(float) ? (const float *)(const void *)(src)                          \
                              : (TO_F32((src), (buf), (width)), (const float *)(buf)))

/* One query (float32, d values) over its first L keys, unpacked (decoder steps: too few
 * queries to repay packing): s[:L] = q . k_j, their softmax, o[:dv] = the unnormalised
 * weighted values, float32 rows read in place. Returns 1 / the sum of the weights (0 when
 * L == 0: o is zeros) and sets *top to the largest scaled score. `row` is scratch of
 * max(d, dv) floats (16-bit rows are converted into it). */
#define DEFINE_FA_ONE_ROW(T, SUF, TO_F32)                                                   \
  static float fa_one_row_##SUF(const float *qt, const T *kb, const T *vb, int64_t sk,      \
                                int64_t sv, int64_t L, int64_t d, int64_t dv, float scale,  \
                                float *s, float *o, float *row, float *top) {               \
    memset(o, 0, (size_t)dv * sizeof(float));                                               \
    if (L <= 0) return 0.0f;                                                                \
    for (int64_t j = 0; j < L; ++j) {                                                       \
      s[j] = fa_dot(qt, FA_F32_ROW(T, TO_F32, kb + j * sk, row, d), d);                     \
    }                                                                                       \
    const float inv = fa_softmax_row(s, L, L, scale, top);                                  \
    for (int64_t j = 0; j < L; ++j) {                                                       \
      const float *vr = FA_F32_ROW(T, TO_F32, vb + j * sv, row, dv);                        \
      const float w = s[j];                                                                 \
      _Pragma("omp simd") for (int64_t c = 0; c < dv; ++c) o[c] += w * vr[c];               \
    }                                                                                       \
    return inv;                                                                             \
  }

#define DEFINE_FLASH_LENGTHS(T, SUF, TO_F32, FROM_F32)                                      \
  DEFINE_FA_ONE_ROW(T, SUF, TO_F32)                                                         \
  void flash_lengths_##SUF(const T *q, const T *k, const T *v, T *out, float *lse,         \
                           const int64_t *order, const int64_t *sorted, const int64_t *st,  \
                           int64_t *next, int64_t tasks, int64_t H, int64_t n, int64_t m,   \
                           int64_t d, int64_t dv, int64_t chunks, double scale) {           \
    const int64_t mp = (m + FA_KEYS - 1) / FA_KEYS * FA_KEYS, dvp = (dv + 31) / 32 * 32;    \
    const int64_t wide = d > dv ? d : dv;                                                   \
    /* scores of one tile and its output; the packed keys and values (kt, vp) only once a  \
       task has a tile of queries: decoder steps never pack (and never allocate them) */    \
    /* one block on cache lines of its own (16-bit rows are converted into `row` for every \
       key: beside another thread's block in one line, that took twice the time) */        \
    const size_t floats = (size_t)(FA_ROWS * mp + FA_ROWS * dvp + FA_ROWS * d + wide);      \
    float *s = (float *)aligned_alloc(64, (floats + 15) / 16 * 16 * sizeof(float));         \
    float *o = s + FA_ROWS * mp, *kt = NULL, *vp = NULL;                                    \
    float *qt = o + FA_ROWS * dvp, *row = qt + FA_ROWS * d;                                 \
    int64_t Ls[FA_ROWS];                                                                    \
    int64_t *const tasks_by_work = fa_task_order(sorted, st, next, tasks, H, n, m, chunks); \
    for (int64_t u = FA_NEXT(next, 0); u < tasks; u = FA_NEXT(next, u + 1)) {               \
      const int64_t t = tasks_by_work ? tasks_by_work[u] : u;                               \
      FA_TASK(t, H, chunks, b, h, c);                                                       \
      int64_t lo, hi; /* the chunk's queries of the sorted ones */                          \
      fa_chunk(c, n, chunks, &lo, &hi);                                                     \
      float *lb = lse ? lse + (b * H + h) * n : NULL;                                       \
      const int64_t *ord = order + b * st[12] + h * st[13];                                 \
      const int64_t *len = sorted + b * st[12] + h * st[13];                                \
      const T *qb = q + b * st[0] + h * st[1], *kb = k + b * st[3] + h * st[4];             \
      const T *vb = v + b * st[6] + h * st[7];                                              \
      T *ob = out + b * st[9] + h * st[10];                                                 \
      if (hi - lo < FA_ROWS) { /* too few queries to repay packing: row by row */          \
        for (int64_t i = lo; i < hi; ++i) {                                                 \
          const int64_t L = clamp_length(len[i], m);                                        \
          float top = 0.0f;                                                                 \
          if (L > 0) TO_F32(qb + ord[i] * st[2], qt, d);                                    \
          const float inv = fa_one_row_##SUF(qt, kb, vb, st[5], st[8], L, d, dv,            \
                                             (float)scale, s, o, row, &top);                \
          if (lb) lb[ord[i]] = inv > 0.0f ? top - logf(inv) : 0.0f;                         \
          _Pragma("omp simd") for (int64_t c = 0; c < dv; ++c) o[c] *= inv;                 \
          FROM_F32(o, ob + ord[i] * st[11], dv);                                            \
        }                                                                                   \
        continue;                                                                           \
      }                                                                                     \
      if (kt == NULL) {                                                                     \
        kt = (float *)aligned_alloc(64, (size_t)(mp * d + mp * dvp) * sizeof(float));       \
        vp = kt + mp * d;                                                                   \
      }                                                                                     \
      const int64_t longest = hi > lo ? clamp_length(len[hi - 1], m) : 0;                   \
      /* keys beyond `longest` in the last panel are computed from stale scratch and never \
         read: each row's softmax stops at its length, the products at the tile's */        \
      FA_PACK(TO_F32, kb, st[5], longest, d, kt, d, 1, row)                                 \
      FA_PACK(TO_F32, vb, st[8], longest, dv, vp, dvp, 0, row)                              \
      memset(row, 0, (size_t)wide * sizeof(float));                                         \
      for (int64_t i0 = lo; i0 < hi; i0 += FA_ROWS) {                                       \
        const int64_t rows = hi - i0 < FA_ROWS ? hi - i0 : FA_ROWS;                         \
        const int64_t keys = clamp_length(len[i0 + rows - 1], m); /* the tile's longest */  \
        for (int64_t r = 0; r < FA_ROWS; ++r) {                                             \
          Ls[r] = r < rows ? clamp_length(len[i0 + r], m) : 0;                              \
          if (Ls[r] > 0) TO_F32(qb + ord[i0 + r] * st[2], qt + r * d, d);                   \
          else memset(qt + r * d, 0, (size_t)d * sizeof(float));                            \
        }                                                                                   \
        float inv[FA_ROWS] = {0}, lmax[FA_ROWS] = {0};                                      \
        if (keys > 0) {                                                                     \
          const int64_t panels = (keys + FA_KEYS - 1) / FA_KEYS;                            \
          fa_scores(qt, kt, s, panels, d, d, mp);                                           \
          for (int64_t r = 0; r < FA_ROWS; ++r) {                                           \
            inv[r] = fa_softmax_row(s + r * mp, Ls[r], keys, (float)scale, lmax + r);       \
          }                                                                                 \
          fa_values(s, vp, o, keys, mp, dvp);                                               \
        }                                                                                   \
        for (int64_t r = 0; r < rows; ++r) {                                                \
          T *dst = ob + ord[i0 + r] * st[11];                                               \
          /* logsumexp as PyTorch's flash kernel keeps it: 0 for a row with no key */       \
          if (lb) lb[ord[i0 + r]] = inv[r] > 0.0f ? lmax[r] - logf(inv[r]) : 0.0f;           \
          if (keys == 0) {                                                                  \
            FROM_F32(row, dst, dv);                                                         \
            continue;                                                                       \
          }                                                                                 \
          float *orow = o + r * dvp;                                                        \
          const float w = inv[r];                                                           \
          _Pragma("omp simd") for (int64_t c = 0; c < dv; ++c) orow[c] *= w;                \
          FROM_F32(orow, dst, dv);                                                          \
        }                                                                                   \
      }                                                                                     \
    }                                                                                       \
    free(s);                                                                                \
    free(kt);                                                                               \
    free(tasks_by_work);                                                                    \
  }

/* The attention kernels by lengths, once per dtype: DEFINE(T, SUF, TO_F32, FROM_F32). */
#if ATTNSCORE_HAVE_F16
#define FA_F16(DEFINE) DEFINE(uint16_t, f16, f16_to_f32_row, f32_to_f16_row)
#else
#define FA_F16(DEFINE)
#endif
#define FA_EACH_DTYPE(DEFINE)                                                               \
  DEFINE(float, f32, f32_copy_row, f32_copy_row)                                            \
  DEFINE(uint16_t, bf16, bf16_to_f32_row, f32_to_bf16_row)                                  \
  FA_F16(DEFINE)

/* The dtypes whose kernels by lengths compute in float32 (DEFINE as FA_EACH_DTYPE's): all
 * but bfloat16 on AVX512-BF16, which has kernels of its own (below, after the backward's
 * helpers). */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define FA_BF16_DOTS 1
#define FA_FLOAT32_DTYPES(DEFINE)                                                           \
  DEFINE(float, f32, f32_copy_row, f32_copy_row)                                            \
  FA_F16(DEFINE)
#else
#define FA_FLOAT32_DTYPES(DEFINE) FA_EACH_DTYPE(DEFINE)
#endif

FA_FLOAT32_DTYPES(DEFINE_FLASH_LENGTHS)

/* acc[j, :wp] += sum_r p[r, j] * x[r, :wp] for j < keys: the FA_ROWS rows of x (wp floats
 * each, a multiple of 32) weighted by a tile's column j of p (rows ls apart). */
static void fa_accumulate(const float *p, const float *x, float *acc, int64_t keys, int64_t ls,
                          int64_t wp) {
  for (int64_t c0 = 0; c0 < wp; c0 += 32) {
    fa_vec x0[FA_ROWS], x1[FA_ROWS];
    for (int r = 0; r < FA_ROWS; ++r) {
      x0[r] = *(const fa_vec *)(x + r * wp + c0);
      x1[r] = *(const fa_vec *)(x + r * wp + c0 + 16);
    }
    for (int64_t j = 0; j < keys; ++j) {
      fa_vec a0 = *(fa_vec *)(acc + j * wp + c0), a1 = *(fa_vec *)(acc + j * wp + c0 + 16);
      _Pragma("GCC unroll 8") for (int r = 0; r < FA_ROWS; ++r) {
        const float w = p[r * ls + j];
        a0 += w * x0[r];
        a1 += w * x1[r];
      }
      *(fa_vec *)(acc + j * wp + c0) = a0;
      *(fa_vec *)(acc + j * wp + c0 + 16) = a1;
    }
  }
}

/* ---- its backward -------------------------------------------------------------------------
 * The gradients of flash_lengths given the output `out`, the upstream gradient `g` and the
 * logsumexps `lse` (B, H, n) float32 its forward wrote: for each query i of length L,
 * P = exp(scale q_i . k_j - lse_i) and dS = P (g_i . v_j - g_i . out_i) over j < L, then
 * dq_i = scale sum_j dS_j k_j, dk_j += scale dS_j q_i, dv_j += P_j g_i; zeros elsewhere. The
 * same tiles of 8 sorted queries over the keys their longest attends; one task is one
 * (example, head), whose dk and dv add up in float32 and are rounded once. Keys beyond its
 * longest length and queries of length 0 are never read (their gradients are zeros).
 * st: as flash_lengths' (14 strides), then g's, dq's, dk's and dv's (b, h, row). */
#define DEFINE_FLASH_LENGTHS_BACKWARD(T, SUF, TO_F32, FROM_F32)                             \
  void flash_lengths_backward_##SUF(                                                        \
      const T *q, const T *k, const T *v, const T *out, const T *g, const float *lse,       \
      T *dq, T *dk, T *dv, const int64_t *order, const int64_t *sorted, const int64_t *st,  \
      int64_t *next, int64_t tasks, int64_t H, int64_t n, int64_t m, int64_t d, int64_t dv_, \
      double scale) {                                                                       \
    const int64_t mp = (m + FA_KEYS - 1) / FA_KEYS * FA_KEYS;                               \
    const int64_t dp = (d + 31) / 32 * 32, dvp = (dv_ + 31) / 32 * 32;                      \
    const int64_t wide = d > dv_ ? d : dv_;                                                 \
    const size_t floats = (size_t)(mp * d + mp * dv_ + mp * dp + mp * dp + mp * dvp +       \
                                   2 * FA_ROWS * mp + FA_ROWS * (dp + dvp + dp) + wide);    \
    /* aligned_alloc takes a multiple of the alignment: 16 floats */                        \
    float *kt = (float *)aligned_alloc(64, (floats + 15) / 16 * 16 * sizeof(float));        \
    float *vt = kt + mp * d, *kr = vt + mp * dv_, *dka = kr + mp * dp, *dva = dka + mp * dp; \
    float *s = dva + mp * dvp, *ds = s + FA_ROWS * mp, *qt = ds + FA_ROWS * mp;             \
    float *gt = qt + FA_ROWS * dp, *o = gt + FA_ROWS * dvp, *row = o + FA_ROWS * dp;        \
    float Ds[FA_ROWS], lses[FA_ROWS];                                                       \
    int64_t Ls[FA_ROWS];                                                                    \
    int64_t *const tasks_by_work = fa_task_order(sorted, st, next, tasks, H, n, m, 1);     \
    for (int64_t u = FA_NEXT(next, 0); u < tasks; u = FA_NEXT(next, u + 1)) {               \
      const int64_t t = tasks_by_work ? tasks_by_work[u] : u, b = t / H, h = t % H;         \
      const int64_t *ord = order + b * st[12] + h * st[13];                                 \
      const int64_t *len = sorted + b * st[12] + h * st[13];                                \
      const T *qb = q + b * st[0] + h * st[1], *kb = k + b * st[3] + h * st[4];             \
      const T *vb = v + b * st[6] + h * st[7], *ob = out + b * st[9] + h * st[10];          \
      const T *gb = g + b * st[14] + h * st[15];                                            \
      T *dqb = dq + b * st[17] + h * st[18], *dkb = dk + b * st[20] + h * st[21];           \
      T *dvb = dv + b * st[23] + h * st[24];                                                \
      const float *lb = lse + (b * H + h) * n;                                              \
      const int64_t longest = n ? clamp_length(len[n - 1], m) : 0;                          \
      FA_PACK(TO_F32, kb, st[5], longest, d, kt, d, 1, row)                                 \
      FA_PACK(TO_F32, vb, st[8], longest, dv_, vt, dv_, 1, row)                             \
      FA_PACK(TO_F32, kb, st[5], longest, d, kr, dp, 0, row)                                \
      memset(dka, 0, (size_t)(longest * dp) * sizeof(float));                               \
      memset(dva, 0, (size_t)(longest * dvp) * sizeof(float));                              \
      for (int64_t i0 = 0; i0 < n; i0 += FA_ROWS) {                                         \
        const int64_t rows = n - i0 < FA_ROWS ? n - i0 : FA_ROWS;                           \
        const int64_t keys = clamp_length(len[i0 + rows - 1], m);                           \
        for (int64_t r = 0; r < FA_ROWS; ++r) {                                             \
          Ls[r] = r < rows ? clamp_length(len[i0 + r], m) : 0;                              \
          float *qr = qt + r * dp, *gr = gt + r * dvp;                                      \
          memset(qr, 0, (size_t)dp * sizeof(float));                                        \
          memset(gr, 0, (size_t)dvp * sizeof(float));                                      \
          Ds[r] = 0.0f;                                                                     \
          lses[r] = 0.0f;                                                                   \
          if (Ls[r] == 0) continue;                                                         \
          const int64_t i = ord[i0 + r];                                                    \
          TO_F32(qb + i * st[2], qr, d);                                                    \
          TO_F32(gb + i * st[16], gr, dv_);                                                 \
          TO_F32(ob + i * st[11], row, dv_);                                                \
          Ds[r] = fa_dot(gr, row, dv_);                                                     \
          lses[r] = lb[i];                                                                  \
        }                                                                                   \
        if (keys > 0) {                                                                     \
          const int64_t panels = (keys + FA_KEYS - 1) / FA_KEYS;                            \
          fa_scores(qt, kt, s, panels, d, dp, mp);                                       \
          fa_scores(gt, vt, ds, panels, dv_, dvp, mp);                                   \
          for (int64_t r = 0; r < FA_ROWS; ++r) {                                           \
            float *sr = s + r * mp, *dr = ds + r * mp;                                      \
            const int64_t L = Ls[r];                                                        \
            const float lr = lses[r], Dr = Ds[r], sc = (float)scale;                        \
            _Pragma("omp simd") for (int64_t j = 0; j < L; ++j) {                           \
              const float p = exp_neg(sr[j] * sc - lr);                                     \
              sr[j] = p;                                                                    \
              dr[j] = p * (dr[j] - Dr) * sc;                                                \
            }                                                                               \
            if (keys > L) {                                                                 \
              memset(sr + L, 0, (size_t)(keys - L) * sizeof(float));                        \
              memset(dr + L, 0, (size_t)(keys - L) * sizeof(float));                        \
            }                                                                               \
          }                                                                                 \
          fa_values(ds, kr, o, keys, mp, dp);               /* dq = dS K */                 \
          fa_accumulate(s, gt, dva, keys, mp, dvp);          /* dv += P^T g */              \
          fa_accumulate(ds, qt, dka, keys, mp, dp);          /* dk += dS^T q */             \
        }                                                                                   \
        for (int64_t r = 0; r < rows; ++r) {                                                \
          T *dst = dqb + ord[i0 + r] * st[19];                                              \
          if (keys == 0 || Ls[r] == 0) {                                                    \
            memset(row, 0, (size_t)d * sizeof(float));                                      \
            FROM_F32(row, dst, d);                                                          \
          } else {                                                                          \
            FROM_F32(o + r * dp, dst, d);                                                   \
          }                                                                                 \
        }                                                                                   \
      }                                                                                     \
      memset(row, 0, (size_t)wide * sizeof(float));                                         \
      for (int64_t j = 0; j < m; ++j) {                                                     \
        FROM_F32(j < longest ? dka + j * dp : row, dkb + j * st[22], d);                    \
        FROM_F32(j < longest ? dva + j * dvp : row, dvb + j * st[25], dv_);                 \
      }                                                                                     \
    }                                                                                       \
    free(kt);                                                                               \
    free(tasks_by_work);                                                                    \
  }

#if defined(FA_BF16_DOTS)
/* ---- bfloat16 on AVX512-BF16 ---------------------------------------------------------------
 * Where the CPU has them (-march=native defines __AVX512BF16__: Zen 4, Intel from Cooper
 * Lake), the bfloat16 kernels by lengths make their products with VDPBF16PS: each instruction
 * multiplies 16 pairs of bfloat16 and adds both products of a pair to a float32 accumulator,
 * twice the multiply-adds of a float32 FMA. The products of q and k (the scores) and of g and
 * v read the inputs as they are (bfloat16 products are exact in float32); P and dS, computed
 * in float32, are rounded to bfloat16 for the products they enter (out = P V in the forward,
 * whose normaliser stays the float32 sum; dq = dS K, dv += P^T g, dk += dS^T q), as
 * PyTorch's bfloat16 kernels round them (their products take bfloat16 operands). Sums stay
 * float32; dk and dv are rounded once, at the end of a task.
 * Operands are packed as pairs along the dimension summed over (one 32-bit lane, the lower
 * element first): K and V^T in panels of FA_KEYS keys by pairs of features; K by pairs of
 * keys for dq; a tile's q and g by pairs of features (scores) and by pairs of rows (dk, dv);
 * P and dS by pairs of keys (dq) and pairs of rows (dk, dv). An odd last pair has a zero in
 * its upper half, so what lies beyond a sum's end is never multiplied. */
#define FA_BH(x) ((__m512bh)(x))

/* Two float32 rounded to bfloat16, as one pair (lo first). */
static inline uint32_t bf16_pair(float lo, float hi) {
  return (uint32_t)bf16_round(lo) | (uint32_t)bf16_round(hi) << 16;
}

/* Two bfloat16 as one pair (lo first). */
static inline uint32_t bf16_join(uint16_t lo, uint16_t hi) {
  return (uint32_t)lo | (uint32_t)hi << 16;
}

/* A row of `width` bfloat16 as pairs: dst[c2] = (src[2 c2], src[2 c2 + 1]), zero beyond. */
static void bf16_pairs_row(const uint16_t *src, uint32_t *dst, int64_t width) {
  for (int64_t c = 0; c + 1 < width; c += 2) dst[c / 2] = bf16_join(src[c], src[c + 1]);
  if (width & 1) dst[width / 2] = src[width - 1];
}

/* s[r, :FA_KEYS * panels] = sum over pairs c2 < w2 of x[r] . kp for FA_ROWS rows of pairs
 * (x's rows lx apart), kp: panels of FA_KEYS keys, each w2 pairs x FA_KEYS keys. */
static void fa_scores_bh(const uint32_t *x, const uint32_t *kp, float *s, int64_t panels,
                         int64_t w2, int64_t lx, int64_t ls) {
  for (int64_t p = 0; p < panels; ++p) {
    const uint32_t *kq = kp + p * w2 * FA_KEYS;
    __m512 a0[FA_ROWS], a1[FA_ROWS];
    for (int r = 0; r < FA_ROWS; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t c2 = 0; c2 < w2; ++c2) {
      const __m512i k0 = _mm512_loadu_si512(kq + c2 * FA_KEYS);
      const __m512i k1 = _mm512_loadu_si512(kq + c2 * FA_KEYS + 16);
      _Pragma("GCC unroll 8") for (int r = 0; r < FA_ROWS; ++r) {
        const __m512i b = _mm512_set1_epi32((int)x[r * lx + c2]);
        a0[r] = _mm512_dpbf16_ps(a0[r], FA_BH(k0), FA_BH(b));
        a1[r] = _mm512_dpbf16_ps(a1[r], FA_BH(k1), FA_BH(b));
      }
    }
    for (int r = 0; r < FA_ROWS; ++r) {
      _mm512_storeu_ps(s + r * ls + p * FA_KEYS, a0[r]);
      _mm512_storeu_ps(s + r * ls + p * FA_KEYS + 16, a1[r]);
    }
  }
}

/* o[r, :wp] = sum_j w[r, j] x[j, :] for j < keys, FA_ROWS rows: w by pairs of keys (rows lw
 * pairs apart), x by pairs of keys (pair j2's row of wp lanes at x + j2 wp; wp a multiple of
 * 32). With an odd count the last pair's upper half (key `keys`, outside the sum) is masked
 * out of x, so that whatever that key holds is never multiplied. */
static void fa_values_bh(const uint32_t *w, const uint32_t *x, float *o, int64_t keys,
                         int64_t lw, int64_t wp) {
  const int64_t full = keys / 2, pairs = (keys + 1) / 2; /* pair `full`: the odd one */
  const __m512i lower = _mm512_set1_epi32(0xffff);
  for (int64_t c0 = 0; c0 < wp; c0 += 32) {
    __m512 a0[FA_ROWS], a1[FA_ROWS];
    for (int r = 0; r < FA_ROWS; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t j2 = 0; j2 < pairs; ++j2) {
      __m512i x0 = _mm512_loadu_si512(x + j2 * wp + c0);
      __m512i x1 = _mm512_loadu_si512(x + j2 * wp + c0 + 16);
      if (j2 == full) {
        x0 = _mm512_and_si512(x0, lower);
        x1 = _mm512_and_si512(x1, lower);
      }
      _Pragma("GCC unroll 8") for (int r = 0; r < FA_ROWS; ++r) {
        const __m512i b = _mm512_set1_epi32((int)w[r * lw + j2]);
        a0[r] = _mm512_dpbf16_ps(a0[r], FA_BH(x0), FA_BH(b));
        a1[r] = _mm512_dpbf16_ps(a1[r], FA_BH(x1), FA_BH(b));
      }
    }
    for (int r = 0; r < FA_ROWS; ++r) {
      _mm512_storeu_ps(o + r * wp + c0, a0[r]);
      _mm512_storeu_ps(o + r * wp + c0 + 16, a1[r]);
    }
  }
}

/* acc[j, :wp] += sum_r w[r, j] x[r, :wp] for j < keys: w by pairs of the tile's rows (key
 * j's FA_ROWS / 2 pairs at w + j FA_ROWS / 2), x the tile's rows by pairs (row pair r2's wp
 * lanes at x + r2 wp). */
static void fa_accumulate_bh(const uint32_t *w, const uint32_t *x, float *acc, int64_t keys,
                             int64_t wp) {
  enum { R2 = FA_ROWS / 2 };
  for (int64_t c0 = 0; c0 < wp; c0 += 32) {
    __m512i x0[R2], x1[R2];
    for (int r2 = 0; r2 < R2; ++r2) {
      x0[r2] = _mm512_loadu_si512(x + r2 * wp + c0);
      x1[r2] = _mm512_loadu_si512(x + r2 * wp + c0 + 16);
    }
    for (int64_t j = 0; j < keys; ++j) {
      float *aj = acc + j * wp + c0;
      __m512 a0 = _mm512_loadu_ps(aj), a1 = _mm512_loadu_ps(aj + 16);
      _Pragma("GCC unroll 4") for (int r2 = 0; r2 < R2; ++r2) {
        const __m512i b = _mm512_set1_epi32((int)w[j * R2 + r2]);
        a0 = _mm512_dpbf16_ps(a0, FA_BH(x0[r2]), FA_BH(b));
        a1 = _mm512_dpbf16_ps(a1, FA_BH(x1[r2]), FA_BH(b));
      }
      _mm512_storeu_ps(aj, a0);
      _mm512_storeu_ps(aj + 16, a1);
    }
  }
}

/* A tile's rows by pairs: dst[r2 wp + c] = (rows[2 r2][c], rows[2 r2 + 1][c]) for c < width,
 * zero up to wp; a NULL row is zeros. */
static void bf16_row_pairs(const uint16_t *const *rows, uint32_t *dst, int64_t width,
                           int64_t wp) {
  for (int r2 = 0; r2 < FA_ROWS / 2; ++r2) {
    const uint16_t *a = rows[2 * r2], *b = rows[2 * r2 + 1];
    uint32_t *d = dst + r2 * wp;
    for (int64_t c = 0; c < width; ++c) d[c] = bf16_join(a ? a[c] : 0, b ? b[c] : 0);
    for (int64_t c = width; c < wp; ++c) d[c] = 0;
  }
}

DEFINE_FA_ONE_ROW(uint16_t, bf16, bf16_to_f32_row)

/* K (rows of width values, stride apart) packed for fa_scores_bh: panels of FA_KEYS keys by
 * feature pairs, keys [0, keys). */
static void bf16_key_panels(const uint16_t *src, int64_t stride, int64_t keys, int64_t width,
                            uint32_t *dst) {
  const int64_t w2 = (width + 1) / 2;
  for (int64_t j = 0; j < keys; ++j) {
    uint32_t *dj = dst + (j / FA_KEYS) * w2 * FA_KEYS + j % FA_KEYS;
    const uint16_t *row = src + j * stride;
    for (int64_t c = 0; c < width; c += 2) {
      dj[c / 2 * FA_KEYS] = bf16_join(row[c], c + 1 < width ? row[c + 1] : 0);
    }
  }
}

/* Rows [0, keys) of src (width values, stride apart) by pairs of rows for fa_values_bh:
 * dst[j2 wp + c] = (src[2 j2][c], src[2 j2 + 1][c]), zeros beyond width (up to wp) and for
 * a missing last row. */
static void bf16_key_pairs(const uint16_t *src, int64_t stride, int64_t keys, int64_t width,
                           int64_t wp, uint32_t *dst) {
  for (int64_t j2 = 0; j2 < (keys + 1) / 2; ++j2) {
    const uint16_t *a = src + 2 * j2 * stride, *b = 2 * j2 + 1 < keys ? a + stride : NULL;
    uint32_t *row2 = dst + j2 * wp;
    for (int64_t c = 0; c < width; ++c) row2[c] = bf16_join(a[c], b ? b[c] : 0);
    for (int64_t c = width; c < wp; ++c) row2[c] = 0;
  }
}

/* Row r of a tile's P or dS (keys values; zeros from the row's length up to `keys` rounded up
 * to even) by pairs of keys: dst[j2] = (x[2 j2], x[2 j2 + 1]). */
static void bf16_row_of_pairs(const float *x, int64_t keys, uint32_t *dst) {
  for (int64_t j = 0; j < keys; j += 2) dst[j / 2] = bf16_pair(x[j], x[j + 1]);
}

/* flash_lengths_bf16 (the contract of flash_lengths) with the products on VDPBF16PS. */
void flash_lengths_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                        float *lse, const int64_t *order, const int64_t *sorted,
                        const int64_t *st, int64_t *next, int64_t tasks, int64_t H, int64_t n,
                        int64_t m, int64_t d, int64_t dv, int64_t chunks, double scale) {
  const int64_t mp = (m + FA_KEYS - 1) / FA_KEYS * FA_KEYS, m2 = mp / 2;
  const int64_t dvp = (dv + 31) / 32 * 32, d2 = (d + 1) / 2, wide = d > dv ? d : dv;
  /* a tile's scores and output, its queries (float32 for the row path, pairs for tiles)
     and P by pairs; the packed keys and values only once a task has a tile of queries */
  /* one block on cache lines of its own, as flash_lengths' */
  const size_t words = (size_t)(FA_ROWS * mp + FA_ROWS * dvp + d + wide + FA_ROWS * (d2 + m2));
  float *s = (float *)aligned_alloc(64, (words + 15) / 16 * 16 * sizeof(float));
  float *o = s + FA_ROWS * mp, *qt = o + FA_ROWS * dvp, *row = qt + d;
  uint32_t *qx = (uint32_t *)(row + wide), *p2 = qx + FA_ROWS * d2, *kp = NULL, *vp = NULL;
  int64_t Ls[FA_ROWS];
  int64_t *const tasks_by_work = fa_task_order(sorted, st, next, tasks, H, n, m, chunks);
  for (int64_t u = FA_NEXT(next, 0); u < tasks; u = FA_NEXT(next, u + 1)) {
    const int64_t t = tasks_by_work ? tasks_by_work[u] : u;
    FA_TASK(t, H, chunks, b, h, c);
    int64_t lo, hi; /* the chunk's queries of the sorted ones */
    fa_chunk(c, n, chunks, &lo, &hi);
    float *lb = lse ? lse + (b * H + h) * n : NULL;
    const int64_t *ord = order + b * st[12] + h * st[13];
    const int64_t *len = sorted + b * st[12] + h * st[13];
    const uint16_t *qb = q + b * st[0] + h * st[1], *kb = k + b * st[3] + h * st[4];
    const uint16_t *vb = v + b * st[6] + h * st[7];
    uint16_t *ob = out + b * st[9] + h * st[10];
    if (hi - lo < FA_ROWS) { /* too few queries to repay packing: row by row */
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t L = clamp_length(len[i], m);
        float top = 0.0f;
        if (L > 0) bf16_to_f32_row(qb + ord[i] * st[2], qt, d);
        const float inv = fa_one_row_bf16(qt, kb, vb, st[5], st[8], L, d, dv, (float)scale, s,
                                          o, row, &top);
        if (lb) lb[ord[i]] = inv > 0.0f ? top - logf(inv) : 0.0f;
        _Pragma("omp simd") for (int64_t c2 = 0; c2 < dv; ++c2) o[c2] *= inv;
        f32_to_bf16_row(o, ob + ord[i] * st[11], dv);
      }
      continue;
    }
    if (kp == NULL) {
      const size_t words = (size_t)(mp * d2 + m2 * dvp);
      kp = (uint32_t *)aligned_alloc(64, (words + 15) / 16 * 16 * sizeof(uint32_t));
      vp = kp + mp * d2;
    }
    const int64_t longest = hi > lo ? clamp_length(len[hi - 1], m) : 0;
    bf16_key_panels(kb, st[5], longest, d, kp);
    bf16_key_pairs(vb, st[8], longest, dv, dvp, vp);
    for (int64_t i0 = lo; i0 < hi; i0 += FA_ROWS) {
      const int64_t rows = hi - i0 < FA_ROWS ? hi - i0 : FA_ROWS;
      const int64_t keys = clamp_length(len[i0 + rows - 1], m); /* the tile's longest */
      for (int64_t r = 0; r < FA_ROWS; ++r) {
        Ls[r] = r < rows ? clamp_length(len[i0 + r], m) : 0;
        memset(qx + r * d2, 0, (size_t)d2 * sizeof(uint32_t));
        if (Ls[r] > 0) bf16_pairs_row(qb + ord[i0 + r] * st[2], qx + r * d2, d);
      }
      float inv[FA_ROWS] = {0}, lmax[FA_ROWS] = {0};
      if (keys > 0) {
        fa_scores_bh(qx, kp, s, (keys + FA_KEYS - 1) / FA_KEYS, d2, d2, mp);
        for (int64_t r = 0; r < FA_ROWS; ++r) {
          float *sr = s + r * mp;
          inv[r] = fa_softmax_row(sr, Ls[r], keys, (float)scale, lmax + r);
          if (keys & 1) sr[keys] = 0.0f; /* (mp is even: within the row) */
          bf16_row_of_pairs(sr, keys, p2 + r * m2);
        }
        fa_values_bh(p2, vp, o, keys, m2, dvp);
      }
      for (int64_t r = 0; r < rows; ++r) {
        uint16_t *dst = ob + ord[i0 + r] * st[11];
        /* logsumexp as PyTorch's flash kernel keeps it: 0 for a row with no key */
        if (lb) lb[ord[i0 + r]] = inv[r] > 0.0f ? lmax[r] - logf(inv[r]) : 0.0f;
        if (keys == 0) {
          memset(dst, 0, (size_t)dv * sizeof(uint16_t)); /* +0.0 in bfloat16 */
          continue;
        }
        float *orow = o + r * dvp;
        const float w = inv[r];
        _Pragma("omp simd") for (int64_t c2 = 0; c2 < dv; ++c2) orow[c2] *= w;
        f32_to_bf16_row(orow, dst, dv);
      }
    }
  }
  free(s);
  free(kp);
  free(tasks_by_work);
}

/* flash_lengths_backward_bf16 (the contract above it) with the products on VDPBF16PS. */
void flash_lengths_backward_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                 const uint16_t *out, const uint16_t *g, const float *lse,
                                 uint16_t *dq, uint16_t *dk, uint16_t *dv, const int64_t *order,
                                 const int64_t *sorted, const int64_t *st, int64_t *next,
                                 int64_t tasks, int64_t H, int64_t n, int64_t m, int64_t d,
                                 int64_t dv_, double scale) {
  const int64_t mp = (m + FA_KEYS - 1) / FA_KEYS * FA_KEYS, m2 = mp / 2;
  const int64_t dp = (d + 31) / 32 * 32, dvp = (dv_ + 31) / 32 * 32;
  const int64_t d2 = (d + 1) / 2, dv2 = (dv_ + 1) / 2;
  /* 32-bit pairs, then float32 sums: K and V^T panels, K by key pairs, the tile's q and g
     by feature pairs and by row pairs, P and dS by key pairs and by row pairs */
  const size_t pairs = (size_t)(mp * d2 + mp * dv2 + m2 * dp + FA_ROWS * (d2 + dv2) +
                                FA_ROWS / 2 * (dp + dvp) + FA_ROWS * m2 + 2 * mp * FA_ROWS / 2);
  const size_t floats = (size_t)(mp * dp + mp * dvp + 2 * FA_ROWS * mp + FA_ROWS * dp);
  const size_t bytes = ((pairs + floats) * 4 + 63) / 64 * 64; /* a multiple of 64 */
  uint32_t *kp = (uint32_t *)aligned_alloc(64, bytes);
  uint32_t *vp = kp + mp * d2, *kr2 = vp + mp * dv2, *qx = kr2 + m2 * dp;
  uint32_t *gx = qx + FA_ROWS * d2;
  uint32_t *qr = gx + FA_ROWS * dv2, *gr = qr + FA_ROWS / 2 * dp, *ds2 = gr + FA_ROWS / 2 * dvp;
  uint32_t *pt = ds2 + FA_ROWS * m2, *dst_ = pt + mp * FA_ROWS / 2;
  float *dka = (float *)(dst_ + mp * FA_ROWS / 2), *dva = dka + mp * dp;
  float *s = dva + mp * dvp, *ds = s + FA_ROWS * mp, *o = ds + FA_ROWS * mp;
  float Ds[FA_ROWS], lses[FA_ROWS];
  int64_t Ls[FA_ROWS];
  const uint16_t *qrows[FA_ROWS], *grows[FA_ROWS];
  int64_t *const tasks_by_work = fa_task_order(sorted, st, next, tasks, H, n, m, 1);
  for (int64_t u = FA_NEXT(next, 0); u < tasks; u = FA_NEXT(next, u + 1)) {
    const int64_t t = tasks_by_work ? tasks_by_work[u] : u, b = t / H, h = t % H;
    const int64_t *ord = order + b * st[12] + h * st[13];
    const int64_t *len = sorted + b * st[12] + h * st[13];
    const uint16_t *qb = q + b * st[0] + h * st[1], *kb = k + b * st[3] + h * st[4];
    const uint16_t *vb = v + b * st[6] + h * st[7], *ob = out + b * st[9] + h * st[10];
    const uint16_t *gb = g + b * st[14] + h * st[15];
    uint16_t *dqb = dq + b * st[17] + h * st[18], *dkb = dk + b * st[20] + h * st[21];
    uint16_t *dvb = dv + b * st[23] + h * st[24];
    const float *lb = lse + (b * H + h) * n;
    const int64_t longest = n ? clamp_length(len[n - 1], m) : 0;
    bf16_key_panels(kb, st[5], longest, d, kp);       /* K and V^T panels (scores, dP) */
    bf16_key_panels(vb, st[8], longest, dv_, vp);
    bf16_key_pairs(kb, st[5], longest, d, dp, kr2);   /* K by key pairs (dq) */
    memset(dka, 0, (size_t)(longest * dp) * sizeof(float));
    memset(dva, 0, (size_t)(longest * dvp) * sizeof(float));
    for (int64_t i0 = 0; i0 < n; i0 += FA_ROWS) {
      const int64_t rows = n - i0 < FA_ROWS ? n - i0 : FA_ROWS;
      const int64_t keys = clamp_length(len[i0 + rows - 1], m);
      for (int64_t r = 0; r < FA_ROWS; ++r) {
        Ls[r] = r < rows ? clamp_length(len[i0 + r], m) : 0;
        Ds[r] = lses[r] = 0.0f;
        qrows[r] = grows[r] = NULL;
        memset(qx + r * d2, 0, (size_t)d2 * sizeof(uint32_t));
        memset(gx + r * dv2, 0, (size_t)dv2 * sizeof(uint32_t));
        if (Ls[r] == 0) continue;
        const int64_t i = ord[i0 + r];
        qrows[r] = qb + i * st[2];
        grows[r] = gb + i * st[16];
        bf16_pairs_row(qrows[r], qx + r * d2, d);
        bf16_pairs_row(grows[r], gx + r * dv2, dv_);
        Ds[r] = bf16_dot(grows[r], ob + i * st[11], dv_);
        lses[r] = lb[i];
      }
      if (keys > 0) {
        const int64_t panels = (keys + FA_KEYS - 1) / FA_KEYS;
        fa_scores_bh(qx, kp, s, panels, d2, d2, mp);
        fa_scores_bh(gx, vp, ds, panels, dv2, dv2, mp);
        for (int64_t r = 0; r < FA_ROWS; ++r) {
          float *sr = s + r * mp, *dr = ds + r * mp;
          const int64_t L = Ls[r];
          const float lr = lses[r], Dr = Ds[r], sc = (float)scale;
          _Pragma("omp simd") for (int64_t j = 0; j < L; ++j) {
            const float p = exp_neg(sr[j] * sc - lr);
            sr[j] = p;
            dr[j] = p * (dr[j] - Dr) * sc;
          }
          /* zeros up to the tile's pairs' end (keys rounded up: mp is even) */
          const int64_t end = keys + (keys & 1);
          if (end > L) {
            memset(sr + L, 0, (size_t)(end - L) * sizeof(float));
            memset(dr + L, 0, (size_t)(end - L) * sizeof(float));
          }
          bf16_row_of_pairs(dr, keys, ds2 + r * m2);
        }
        for (int64_t j = 0; j < keys; ++j) { /* P and dS by row pairs */
          for (int r2 = 0; r2 < FA_ROWS / 2; ++r2) {
            const int64_t a = 2 * r2 * mp + j, b2 = a + mp; /* rows 2 r2 and 2 r2 + 1 */
            pt[j * (FA_ROWS / 2) + r2] = bf16_pair(s[a], s[b2]);
            dst_[j * (FA_ROWS / 2) + r2] = bf16_pair(ds[a], ds[b2]);
          }
        }
        bf16_row_pairs(grows, gr, dv_, dvp);
        bf16_row_pairs(qrows, qr, d, dp);
        fa_values_bh(ds2, kr2, o, keys, m2, dp);     /* dq = dS K */
        fa_accumulate_bh(pt, gr, dva, keys, dvp);    /* dv += P^T g */
        fa_accumulate_bh(dst_, qr, dka, keys, dp);   /* dk += dS^T q */
      }
      for (int64_t r = 0; r < rows; ++r) {
        uint16_t *dst = dqb + ord[i0 + r] * st[19];
        if (keys == 0 || Ls[r] == 0) {
          memset(dst, 0, (size_t)d * sizeof(uint16_t)); /* +0.0 in bfloat16 */
        } else {
          f32_to_bf16_row(o + r * dp, dst, d);
        }
      }
    }
    for (int64_t j = 0; j < m; ++j) {
      if (j < longest) {
        f32_to_bf16_row(dka + j * dp, dkb + j * st[22], d);
        f32_to_bf16_row(dva + j * dvp, dvb + j * st[25], dv_);
      } else {
        memset(dkb + j * st[22], 0, (size_t)d * sizeof(uint16_t));
        memset(dvb + j * st[25], 0, (size_t)dv_ * sizeof(uint16_t));
      }
    }
  }
  free(kp);
  free(tasks_by_work);
}

#endif /* FA_BF16_DOTS */

/* 1 where this build's bfloat16 kernels by lengths multiply on AVX512-BF16, else 0. */
int fa_bf16_dots(void) {
#if defined(FA_BF16_DOTS)
  return 1;
#else
  return 0;
#endif
}

FA_FLOAT32_DTYPES(DEFINE_FLASH_LENGTHS_BACKWARD)

/* ---- masked softmax by a boolean mask ----------------------------------------------------
 * Row r of x (R x m) is normalised over the positions its mask row allows (mask + offsets[r],
 * m bytes, nonzero = may attend): y = softmax there, exact 0 elsewhere, and a row that allows
 * nothing is all 0. Masked positions are never used (a select picks them out before any
 * arithmetic, so NaN there cannot leak in). The backward is masked_softmax_backward with
 * every length m: y is exactly 0 where the mask forbids, so is the gradient. */
#define DEFINE_SOFTMAX_ROW_MASKED(CT, SUF, EXP)                                             \
  /* returns 0 (and writes zeros) when the row allows nothing; y may be x */                \
  static inline int softmax_row_masked_##SUF(const CT *x, const uint8_t *mask, CT *y,       \
                                             int64_t m) {                                   \
    CT mx = -(CT)1e30;                                                                      \
    int any = 0;                                                                            \
    _Pragma("omp simd reduction(max : mx) reduction(| : any)") for (int64_t j = 0; j < m; ++j) { \
      CT v = mask[j] ? x[j] : -(CT)1e30;                                                    \
      mx = v > mx ? v : mx;                                                                 \
      any |= mask[j];                                                                       \
    }                                                                                       \
    if (!any) {                                                                             \
      memset(y, 0, (size_t)m * sizeof(CT));                                                 \
      return 0;                                                                             \
    }                                                                                       \
    CT s = 0;                                                                               \
    _Pragma("omp simd reduction(+ : s)") for (int64_t j = 0; j < m; ++j) {                  \
      CT d = mask[j] ? x[j] - mx : -(CT)1e30;                                               \
      CT e = mask[j] ? EXP(d) : (CT)0;                                                      \
      y[j] = e;                                                                             \
      s += e;                                                                               \
    }                                                                                       \
    CT inv = (CT)1 / s; /* NaN when an allowed score is: it must not reach masked places */ \
    _Pragma("omp simd") for (int64_t j = 0; j < m; ++j) y[j] = mask[j] ? y[j] * inv : (CT)0; \
    return 1;                                                                               \
  }

DEFINE_SOFTMAX_ROW_MASKED(double, f64, exp)
DEFINE_SOFTMAX_ROW_MASKED(float, f32, exp_neg)

#define DEFINE_MASKED_SOFTMAX_DENSE(T, SUF)                                                 \
  void masked_softmax_dense_##SUF(const T *x, const uint8_t *mask, const int64_t *offsets,  \
                                  T *y, int64_t r0, int64_t r1, int64_t m) {                \
    for (int64_t r = r0; r < r1; ++r) {                                                     \
      softmax_row_masked_##SUF(x + r * m, mask + offsets[r], y + r * m, m);                 \
    }                                                                                       \
  }

DEFINE_MASKED_SOFTMAX_DENSE(double, f64)
DEFINE_MASKED_SOFTMAX_DENSE(float, f32)

#define DEFINE_MASKED_SOFTMAX_DENSE_16(SUF)                                                 \
  void masked_softmax_dense_##SUF(const uint16_t *x, const uint8_t *mask,                   \
                                  const int64_t *offsets, uint16_t *y, int64_t r0,          \
                                  int64_t r1, int64_t m) {                                  \
    float *row = (float *)malloc((size_t)(m > 0 ? m : 1) * sizeof(float));                  \
    for (int64_t r = r0; r < r1; ++r) {                                                     \
      SUF##_to_f32_row(x + r * m, row, m);                                                  \
      softmax_row_masked_f32(row, mask + offsets[r], row, m);                               \
      f32_to_##SUF##_row(row, y + r * m, m);                                                \
    }                                                                                       \
    free(row);                                                                              \
  }

DEFINE_MASKED_SOFTMAX_DENSE_16(bf16)
#if ATTNSCORE_HAVE_F16
DEFINE_MASKED_SOFTMAX_DENSE_16(f16)
#endif

/* ---- a boolean mask made ready for SDPA -------------------------------------------------
 * mask: groups x rows x m bytes (nonzero = may attend). row_any[g * rows + i]: whether row i
 * of group g allows any key; col_any[g * m + j]: whether any row of group g allows key j
 * (keys no row allows are padding); out, when not NULL: the additive form SDPA's fused
 * kernels take, 0 where allowed and -inf elsewhere, in the queries' type (bit patterns
 * below, so that -ffast-math cannot touch the infinities). One read of the mask. */
#define DEFINE_MASK_SUMMARY(ST, SUF, ZERO, NEG_INF)                                         \
  void mask_summary_##SUF(const uint8_t *mask, ST *out, uint8_t *row_any, uint8_t *col_any, \
                          int64_t g0, int64_t g1, int64_t rows, int64_t m) {               \
    const ST zero = ZERO, neg_inf = NEG_INF;                                                \
    for (int64_t g = g0; g < g1; ++g) {                                                     \
      uint8_t *col = col_any + g * m;                                                       \
      memset(col, 0, (size_t)m);                                                            \
      for (int64_t i = 0; i < rows; ++i) {                                                  \
        const uint8_t *mr = mask + (g * rows + i) * m;                                      \
        uint8_t any = 0;                                                                    \
        if (out != NULL) {                                                                  \
          ST *o = out + (g * rows + i) * m;                                                 \
          _Pragma("omp simd reduction(| : any)") for (int64_t j = 0; j < m; ++j) {          \
            any |= mr[j];                                                                   \
            col[j] |= mr[j];                                                                \
            o[j] = mr[j] ? zero : neg_inf;                                                  \
          }                                                                                 \
        } else {                                                                            \
          _Pragma("omp simd reduction(| : any)") for (int64_t j = 0; j < m; ++j) {          \
            any |= mr[j];                                                                   \
            col[j] |= mr[j];                                                                \
          }                                                                                 \
        }                                                                                   \
        row_any[g * rows + i] = any != 0;                                                   \
      }                                                                                     \
    }                                                                                       \
  }

static inline float f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline double f64_from_bits(uint64_t u) {
  double f;
  memcpy(&f, &u, sizeof f);
  return f;
}

DEFINE_MASK_SUMMARY(double, f64, 0.0, f64_from_bits(0xfff0000000000000ull))
DEFINE_MASK_SUMMARY(float, f32, 0.0f, f32_from_bits(0xff800000u))
DEFINE_MASK_SUMMARY(uint16_t, bf16, (uint16_t)0, (uint16_t)0xff80u)
DEFINE_MASK_SUMMARY(uint16_t, f16, (uint16_t)0, (uint16_t)0xfc00u)

/* ---- a mask by lengths made ready for SDPA ----------------------------------------------
 * out (rows x m): the additive form of "key j < lengths[r]" (lengths clamped to [0, m]), 0
 * then -inf, in the queries' type; written straight from the lengths, no boolean mask in
 * between. */
#define DEFINE_LENGTHS_MASK(ST, SUF, ZERO, NEG_INF)                                         \
  void lengths_mask_##SUF(const int64_t *lengths, ST *out, int64_t r0, int64_t r1,          \
                          int64_t m) {                                                      \
    const ST zero = ZERO, neg_inf = NEG_INF;                                                \
    for (int64_t r = r0; r < r1; ++r) {                                                     \
      const int64_t L = lengths[r] < 0 ? 0 : (lengths[r] > m ? m : lengths[r]);             \
      ST *o = out + r * m;                                                                  \
      _Pragma("omp simd") for (int64_t j = 0; j < L; ++j) o[j] = zero;                      \
      _Pragma("omp simd") for (int64_t j = L; j < m; ++j) o[j] = neg_inf;                   \
    }                                                                                       \
  }

DEFINE_LENGTHS_MASK(double, f64, 0.0, f64_from_bits(0xfff0000000000000ull))
DEFINE_LENGTHS_MASK(float, f32, 0.0f, f32_from_bits(0xff800000u))
DEFINE_LENGTHS_MASK(uint16_t, bf16, (uint16_t)0, (uint16_t)0xff80u)
DEFINE_LENGTHS_MASK(uint16_t, f16, (uint16_t)0, (uint16_t)0xfc00u)

/* ---- additive scores (float32 and float64; 16-bit inputs are converted by the caller) -- */
#define DEFINE_ADDITIVE(T, SUF, TANH)                                                       \
  /* s[r, j] = sum_k w[k] tanh(qh[r, k] + kh[b, j, k]) for j < lengths[r], else 0;           \
   * rows r index the flattened (B, n), b = r / n. */                                       \
  void additive_scores_##SUF(const T *restrict qh, const T *restrict kh, const T *restrict w, \
                             const int64_t *restrict lengths, T *restrict s, int64_t r0,    \
                             int64_t r1, int64_t n, int64_t m, int64_t h) {                 \
    for (int64_t r = r0; r < r1; ++r) {                                                     \
      const T *restrict q = qh + r * h;                                                     \
      const T *restrict K = kh + (r / n) * m * h;                                           \
      T *restrict sr = s + r * m;                                                           \
      int64_t L = lengths[r];                                                               \
      if (L > m) L = m;                                                                     \
      if (L < 0) L = 0;                                                                     \
      for (int64_t j = 0; j < L; ++j) {                                                     \
        const T *restrict kj = K + j * h;                                                   \
        T acc = 0;                                                                          \
        _Pragma("omp simd reduction(+ : acc)") for (int64_t c = 0; c < h; ++c) {            \
          acc += w[c] * TANH(q[c] + kj[c]);                                                 \
        }                                                                                   \
        sr[j] = acc;                                                                        \
      }                                                                                     \
      if (L < m) memset(sr + L, 0, (size_t)(m - L) * sizeof(T));                            \
    }                                                                                       \
  }                                                                                         \
                                                                                            \
  /* Backward of additive_scores with tanh recomputed. dq rows [r0, r1) are owned by the    \
   * caller's range; dk (B, m, h) and dw (h) are per-range buffers summed by the caller.    \
   * All are accumulated into (pre-zeroed). */                                              \
  void additive_scores_backward_##SUF(                                                      \
      const T *restrict qh, const T *restrict kh, const T *restrict w,                      \
      const int64_t *restrict lengths, const T *restrict g, T *restrict dq, T *restrict dk,  \
      T *restrict dw, int64_t r0, int64_t r1, int64_t n, int64_t m, int64_t h) {            \
    for (int64_t r = r0; r < r1; ++r) {                                                     \
      int64_t b = r / n;                                                                    \
      const T *restrict q = qh + r * h;                                                     \
      const T *restrict K = kh + b * m * h;                                                 \
      T *restrict dK = dk + b * m * h;                                                      \
      T *restrict dqr = dq + r * h;                                                         \
      const T *restrict gr = g + r * m;                                                     \
      int64_t L = lengths[r];                                                               \
      if (L > m) L = m;                                                                     \
      for (int64_t j = 0; j < L; ++j) {                                                     \
        const T gj = gr[j];                                                                 \
        const T *restrict kj = K + j * h;                                                   \
        T *restrict dkj = dK + j * h;                                                       \
        _Pragma("omp simd") for (int64_t c = 0; c < h; ++c) {                               \
          T t = TANH(q[c] + kj[c]);                                                         \
          T d = gj * w[c] * ((T)1 - t * t);                                                 \
          dw[c] += gj * t;                                                                  \
          dqr[c] += d;                                                                      \
          dkj[c] += d;                                                                      \
        }                                                                                   \
      }                                                                                     \
    }                                                                                       \
  }

DEFINE_ADDITIVE(float, f32, tanhf)
DEFINE_ADDITIVE(double, f64, tanh)

/* ---- drivers: range t of `parts` is [cuts[t], cuts[t + 1]), one per OpenMP thread ------ */
#define EACH_RANGE(CALL)                                                                    \
  _Pragma("omp parallel for num_threads((int)parts) schedule(static, 1)")                    \
  for (int64_t t = 0; t < parts; ++t) {                                                     \
    const int64_t r0 = cuts[t], r1 = cuts[t + 1];                                           \
    CALL;                                                                                   \
  }

/* The drivers below are alike in shape (`duplicates`): each exports one ctypes symbol per
   op and dtype around EACH_RANGE, which holds their shared body. */
#define DEFINE_SOFTMAX_DRIVERS(ST, SUF)                                                     \
  void masked_softmax_par_##SUF(const ST *x, const int64_t *lengths, ST *y,                 \
                                const int64_t *cuts, int64_t parts, int64_t m, int64_t div) { \
    EACH_RANGE(masked_softmax_##SUF(x, lengths, y, r0, r1, m, div))                         \
  }                                                                                         \
  void masked_softmax_backward_par_##SUF(const ST *y, const ST *g, const int64_t *lengths,  \
                                         ST *dx, const int64_t *cuts, int64_t parts,        \
                                         int64_t m, int64_t div, int64_t gs) {              \
    EACH_RANGE(masked_softmax_backward_##SUF(y, g, lengths, dx, r0, r1, m, div, gs))        \
  }

DEFINE_SOFTMAX_DRIVERS(double, f64)
DEFINE_SOFTMAX_DRIVERS(float, f32)
DEFINE_SOFTMAX_DRIVERS(uint16_t, bf16)
#if ATTNSCORE_HAVE_F16
DEFINE_SOFTMAX_DRIVERS(uint16_t, f16)
#endif

#define DEFINE_DENSE_DRIVERS(ST, SUF)                                                       \
  void masked_softmax_dense_par_##SUF(const ST *x, const uint8_t *mask,                     \
                                      const int64_t *offsets, ST *y, const int64_t *cuts,   \
                                      int64_t parts, int64_t m) {                           \
    EACH_RANGE(masked_softmax_dense_##SUF(x, mask, offsets, y, r0, r1, m))                  \
  }                                                                                         \
  void mask_summary_par_##SUF(const uint8_t *mask, ST *out, uint8_t *row_any,               \
                              uint8_t *col_any, const int64_t *cuts, int64_t parts,         \
                              int64_t rows, int64_t m) {                                    \
    EACH_RANGE(mask_summary_##SUF(mask, out, row_any, col_any, r0, r1, rows, m))            \
  }

DEFINE_DENSE_DRIVERS(double, f64)
DEFINE_DENSE_DRIVERS(float, f32)
DEFINE_DENSE_DRIVERS(uint16_t, bf16)
#if ATTNSCORE_HAVE_F16
DEFINE_DENSE_DRIVERS(uint16_t, f16)
#else
void mask_summary_par_f16(const uint8_t *mask, uint16_t *out, uint8_t *row_any,
                          uint8_t *col_any, const int64_t *cuts, int64_t parts, int64_t rows,
                          int64_t m) {
  EACH_RANGE(mask_summary_f16(mask, out, row_any, col_any, r0, r1, rows, m))
}
#endif

/* ---- attention of a small call, by lengths ----------------------------------------------
 * Rows r of the flattened (B*H, n) queries: out[r] = softmax(s[r, :L]) v[bh, :L] with
 * L = lengths[r / div] clamped to [0, m] and bh = r / n; zeros for L = 0. The scores are
 * dot products (small_attention: scale * q[r] . k[bh, j]) or additive (small_additive:
 * w . tanh(qh[r] + kh[bh, j])). Keys and values at j >= L are never read. All inputs
 * contiguous: q (rows, d), k (B*H, m, d), v (B*H, m, dv), out (rows, dv). Plain finite
 * arithmetic only (-ffast-math may assume it): a row whose scores or output are not all
 * finite (integer tests) is counted, and the caller then takes the general path for the
 * whole call. Each returns that count. */
static inline int f32_finite(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return (u & 0x7f800000u) != 0x7f800000u;
}

static inline int f64_finite(double x) {
  uint64_t u;
  memcpy(&u, &x, sizeof u);
  return (u & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}

/* o[:dv] = softmax(s[:L]) v[:L] for L > 0 finite scores (s overwritten); 1 if o is finite. */
#define DEFINE_SMALL_POOL(T, SUF, EXP)                                                      \
  static int small_pool_##SUF(T *s, int64_t L, const T *v, int64_t dv, T *o) {              \
    T mx = s[0];                                                                            \
    for (int64_t j = 1; j < L; ++j) mx = s[j] > mx ? s[j] : mx;                             \
    T sum = 0;                                                                              \
    for (int64_t j = 0; j < L; ++j) {                                                       \
      s[j] = EXP(s[j] - mx);                                                                \
      sum += s[j];                                                                          \
    }                                                                                       \
    const T inv = (T)1 / sum;                                                               \
    for (int64_t j = 0; j < L; ++j) {                                                       \
      const T w = s[j] *= inv; /* s keeps the weights, for the caller to write out */       \
      for (int64_t c = 0; c < dv; ++c) o[c] += w * v[j * dv + c];                           \
    }                                                                                       \
    int finite = 1;                                                                         \
    for (int64_t c = 0; c < dv; ++c) finite &= SUF##_finite(o[c]);                          \
    return finite;                                                                          \
  }

/* The row loop around SCORE (an expression of j, with qr, kb the row's query and its
   example's keys, of size d each) shared by both kinds of scores. Where `weights` is not
   NULL, each row's weights are written there too (rows x m, exact zeros beyond the row's
   length): the weights the call used, cheaper to keep than copies of its inputs. */
#define SMALL_ROWS(T, SUF, SCORE)                                                           \
  T stack[64];                                                                              \
  T *s = m <= 64 ? stack : (T *)malloc(sizeof(T) * (size_t)m);                              \
  int64_t bad = 0;                                                                          \
  for (int64_t r = 0; r < rows; ++r) {                                                      \
    const int64_t bh = r / n;                                                               \
    int64_t L = lengths[r / div];                                                           \
    L = L < 0 ? 0 : (L > m ? m : L);                                                        \
    T *o = out + r * dv;                                                                    \
    for (int64_t c = 0; c < dv; ++c) o[c] = 0;                                              \
    T *wr = weights ? weights + r * m : NULL;                                               \
    if (wr)                                                                                 \
      for (int64_t j = L; j < m; ++j) wr[j] = 0;                                            \
    if (L == 0) continue;                                                                   \
    const T *qr = q + r * d, *kb = k + bh * m * d;                                          \
    int finite = 1;                                                                         \
    for (int64_t j = 0; j < L; ++j) {                                                       \
      s[j] = (SCORE);                                                                       \
      finite &= SUF##_finite(s[j]);                                                         \
    }                                                                                       \
    bad += !(finite && small_pool_##SUF(s, L, v + bh * m * dv, dv, o));                     \
    if (wr)                                                                                 \
      for (int64_t j = 0; j < L; ++j) wr[j] = s[j];                                         \
  }                                                                                         \
  if (s != stack) free(s);                                                                  \
  return bad;

#define DEFINE_SMALL_ATTENTION(T, SUF, EXP, TANH)                                           \
  DEFINE_SMALL_POOL(T, SUF, EXP)                                                            \
  static inline T small_dot_##SUF(const T *a, const T *b, int64_t d) {                      \
    T acc = 0;                                                                              \
    for (int64_t c = 0; c < d; ++c) acc += a[c] * b[c];                                     \
    return acc;                                                                             \
  }                                                                                         \
  static inline T small_tanh_##SUF(const T *a, const T *b, const T *w, int64_t d) {         \
    T acc = 0;                                                                              \
    for (int64_t c = 0; c < d; ++c) acc += w[c] * TANH(a[c] + b[c]);                        \
    return acc;                                                                             \
  }                                                                                         \
  int64_t small_attention_##SUF(const T *q, const T *k, const T *v, const int64_t *lengths,  \
                                T *out, T *weights, int64_t rows, int64_t n, int64_t m,     \
                                int64_t d, int64_t dv, int64_t div, double scale) {         \
    SMALL_ROWS(T, SUF, small_dot_##SUF(qr, kb + j * d, d) * (T)scale)                       \
  }                                                                                         \
  int64_t small_additive_##SUF(const T *q, const T *k, const T *w, const T *v,               \
                               const int64_t *lengths, T *out, T *weights, int64_t rows,    \
                               int64_t n, int64_t m, int64_t d, int64_t dv, int64_t div) {  \
    SMALL_ROWS(T, SUF, small_tanh_##SUF(qr, kb + j * d, w, d))                              \
  }

DEFINE_SMALL_ATTENTION(float, f32, exp_neg, tanhf)
DEFINE_SMALL_ATTENTION(double, f64, exp, tanh)

#define DEFINE_LENGTHS_MASK_DRIVER(ST, SUF)                                                 \
  void lengths_mask_par_##SUF(const int64_t *lengths, ST *out, const int64_t *cuts,         \
                              int64_t parts, int64_t m) {                                   \
    EACH_RANGE(lengths_mask_##SUF(lengths, out, r0, r1, m))                                 \
  }

/* The tasks of flash_lengths (and of its backward) on `threads` OpenMP threads, each taking
 * the next task when it finishes one (tasks differ in work by the lengths). */
#define DEFINE_FLASH_LENGTHS_DRIVER(T, SUF, TO_F32_, FROM_F32_)                            \
  void flash_lengths_par_##SUF(const T *q, const T *k, const T *v, T *out, float *lse,     \
                               const int64_t *order, const int64_t *sorted, const int64_t *st, \
                               int64_t tasks, int64_t threads, int64_t H, int64_t n,        \
                               int64_t m, int64_t d, int64_t dv, int64_t chunks,            \
                               double scale) {                                              \
    int64_t next = 0;                                                                       \
    _Pragma("omp parallel num_threads((int)threads)")                                       \
    flash_lengths_##SUF(q, k, v, out, lse, order, sorted, st, &next, tasks, H, n, m, d, dv,  \
                        chunks, scale);                                                     \
  }

#define DEFINE_FLASH_LENGTHS_BACKWARD_DRIVER(T, SUF, TO_F32_, FROM_F32_)                   \
  void flash_lengths_backward_par_##SUF(                                                    \
      const T *q, const T *k, const T *v, const T *out, const T *g, const float *lse,       \
      T *dq, T *dk, T *dv, const int64_t *order, const int64_t *sorted, const int64_t *st,  \
      int64_t tasks, int64_t threads, int64_t H, int64_t n, int64_t m, int64_t d,           \
      int64_t dv_, double scale) {                                                          \
    int64_t next = 0;                                                                       \
    _Pragma("omp parallel num_threads((int)threads)")                                       \
    flash_lengths_backward_##SUF(q, k, v, out, g, lse, dq, dk, dv, order, sorted, st, &next, \
                                 tasks, H, n, m, d, dv_, scale);                            \
  }

FA_EACH_DTYPE(DEFINE_FLASH_LENGTHS_BACKWARD_DRIVER)

FA_EACH_DTYPE(DEFINE_FLASH_LENGTHS_DRIVER)

DEFINE_LENGTHS_MASK_DRIVER(double, f64)
DEFINE_LENGTHS_MASK_DRIVER(float, f32)
DEFINE_LENGTHS_MASK_DRIVER(uint16_t, bf16)
DEFINE_LENGTHS_MASK_DRIVER(uint16_t, f16)

#if ATTNSCORE_HAVE_F16
void matmul_par_f16(const uint16_t *A, const uint16_t *B, uint16_t *C, const int64_t *cuts,
                    int64_t parts, int64_t rows, int64_t k, int64_t cols, int64_t sab,
                    int64_t sar, int64_t sak, int64_t sbb, int64_t sbk, int64_t sbc) {
  EACH_RANGE(matmul_f16(A, B, C, r0, r1, rows, k, cols, sab, sar, sak, sbb, sbk, sbc))
}
#endif

#define DEFINE_ADDITIVE_DRIVERS(T, SUF)                                                     \
  void additive_scores_par_##SUF(const T *qh, const T *kh, const T *w, const int64_t *lengths, \
                                 T *s, const int64_t *cuts, int64_t parts, int64_t n,       \
                                 int64_t m, int64_t h) {                                    \
    EACH_RANGE(additive_scores_##SUF(qh, kh, w, lengths, s, r0, r1, n, m, h))               \
  }                                                                                         \
  /* dk holds `parts` (B, m, h) accumulators and dw `parts` (h,) ones, range t owns the     \
   * t-th of each. */                                                                       \
  void additive_scores_backward_par_##SUF(const T *qh, const T *kh, const T *w,             \
                                          const int64_t *lengths, const T *g, T *dq, T *dk, \
                                          T *dw, const int64_t *cuts, int64_t parts,        \
                                          int64_t n, int64_t m, int64_t h, int64_t batch) { \
    EACH_RANGE(additive_scores_backward_##SUF(qh, kh, w, lengths, g, dq,                    \
                                              dk + t * batch * m * h, dw + t * h, r0, r1,   \
                                              n, m, h))                                     \
  }

DEFINE_ADDITIVE_DRIVERS(float, f32)
DEFINE_ADDITIVE_DRIVERS(double, f64)

/* ---- finiteness of inputs -----------------------------------------------------------------
 * 1 when an entry among the first n of p has all its exponent bits set (inf or NaN), else 0,
 * by their bits (-ffast-math may assume no float is NaN): a fused kernel takes a call only
 * when its inputs hold none, since where a query's mask differs from its neighbours' the
 * kernels (like SDPA) multiply exact zero weights into keys and values it does not attend,
 * and 0 x NaN is NaN. One read, vectorized, an OR of comparisons in the entries' own width
 * (a count would widen every lane to 64 bits); the caller passes each buffer it will read. */
#define DEFINE_NONFINITE(UT, SUF, EXPONENT)                                                 \
  int64_t any_nonfinite_##SUF(const UT *p, int64_t n) {                                     \
    UT bad = 0;                                                                             \
    _Pragma("omp simd reduction(| : bad)") for (int64_t i = 0; i < n; ++i) {                \
      bad |= (UT)((p[i] & EXPONENT) == EXPONENT);                                           \
    }                                                                                       \
    return bad != 0;                                                                        \
  }                                                                                         \
  /* The three inputs of an attention call at once (one call from Python, not three); with \
   * `ka`, `kb` not NULL, a and b are also copied there: the copies of queries and keys a  \
   * call keeps for its weights, in the same call. */                                      \
  int64_t any_nonfinite3_##SUF(const UT *a, int64_t na, const UT *b, int64_t nb,            \
                               const UT *c, int64_t nc, UT *ka, UT *kb) {                   \
    if (ka && kb) {                                                                         \
      memcpy(ka, a, (size_t)na * sizeof(UT));                                               \
      memcpy(kb, b, (size_t)nb * sizeof(UT));                                               \
    }                                                                                       \
    return any_nonfinite_##SUF(a, na) || any_nonfinite_##SUF(b, nb) ||                      \
           any_nonfinite_##SUF(c, nc);                                                      \
  }
DEFINE_NONFINITE(uint64_t, f64, UINT64_C(0x7ff0000000000000))
DEFINE_NONFINITE(uint32_t, f32, UINT32_C(0x7f800000))
DEFINE_NONFINITE(uint16_t, bf16, (uint16_t)0x7f80)
DEFINE_NONFINITE(uint16_t, f16, (uint16_t)0x7c00)

/* 1 when the float16 kernels exist (the compiler has _Float16). */
int attnscore_have_f16(void) { return ATTNSCORE_HAVE_F16; }

/* 1 when built with an OpenMP runtime (-fopenmp), 0 with -fopenmp-simd only. */
int attnscore_openmp(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

/* Fresh outputs of many MiB are mmap'ed and untouched: with 4 KiB pages the first write faults
 * once per page, which costs several times more than the kernel itself (64 MiB: ~40 ms against
 * ~9 ms). Asking for transparent huge pages on the 2 MiB-aligned interior cuts the faults 512x.
 * Harmless when THP is off or the memory is already mapped. */
void attnscore_advise_huge(void *p, int64_t nbytes) {
#ifdef MADV_HUGEPAGE
  const uintptr_t huge = (uintptr_t)2 << 20;
  uintptr_t start = ((uintptr_t)p + huge - 1) & ~(huge - 1);
  uintptr_t end = ((uintptr_t)p + (uintptr_t)nbytes) & ~(huge - 1);
  if (end > start) madvise((void *)start, end - start, MADV_HUGEPAGE);
#else
  (void)p;
  (void)nbytes;
#endif
}

/* Lets Python check it loaded the library built from the expected source. */
int attnscore_kernels_abi(void) { return 15; }
