/* Fused CPU kernels for attnscore (masked softmax, additive scores).
 *
 * Every kernel works on a half-open range of rows [r0, r1); Python splits the rows into
 * ranges of equal work. Two ways to run the ranges in parallel:
 *   - built with -fopenmp (only when torch's own OpenMP runtime is libgomp, so that loading
 *     this library reuses the copy torch loaded): the *_par drivers below run one range per
 *     thread of torch's OpenMP pool, the threads torch.compile's kernels also use, so no
 *     second set of threads competes with them for the cores;
 *   - otherwise (-fopenmp-simd, no runtime linked): Python threads call the kernels (ctypes
 *     releases the GIL), and the drivers' pragma is ignored (a serial loop).
 * `#pragma omp simd` plus -ffast-math lets gcc call glibc's libmvec vector expf/tanhf.
 * Padded positions are never read, so NaN/inf garbage there cannot leak into results. */
#include <math.h>
#include <sys/mman.h>
#include <stdint.h>
#include <string.h>

#define DEFINE_KERNELS(T, SUF, EXP, TANH)                                                     \
  /* y[r, :L] = softmax(x[r, :L]), y[r, L:] = 0, L = lengths[r]; rows with L == 0 are zero. */ \
  void ms_fwd_##SUF(const T *restrict x, const int64_t *restrict lengths, T *restrict y,      \
                    int64_t r0, int64_t r1, int64_t m) {                                    \
    for (int64_t r = r0; r < r1; ++r) {                                                     \
      const T *restrict xr = x + r * m;                                                     \
      T *restrict yr = y + r * m;                                                           \
      int64_t L = lengths[r];                                                                  \
      if (L > m) L = m;                                                                     \
      if (L <= 0) {                                                                         \
        memset(yr, 0, (size_t)m * sizeof(T));                                               \
        continue;                                                                           \
      }                                                                                     \
      T mx = xr[0];                                                                         \
      _Pragma("omp simd reduction(max : mx)") for (int64_t j = 0; j < L; ++j) {             \
        mx = xr[j] > mx ? xr[j] : mx;                                                       \
      }                                                                                     \
      T s = 0;                                                                              \
      _Pragma("omp simd reduction(+ : s)") for (int64_t j = 0; j < L; ++j) {                \
        T e = EXP(xr[j] - mx);                                                              \
        yr[j] = e;                                                                          \
        s += e;                                                                             \
      }                                                                                     \
      T inv = (T)1 / s;                                                                     \
      _Pragma("omp simd") for (int64_t j = 0; j < L; ++j) yr[j] *= inv;                     \
      if (L < m) memset(yr + L, 0, (size_t)(m - L) * sizeof(T));                            \
    }                                                                                       \
  }                                                                                         \
                                                                                            \
  /* dx = y * (g - sum(g * y)) on the first L positions, exact zeros elsewhere. */          \
  void ms_bwd_##SUF(const T *restrict y, const T *restrict g, const int64_t *restrict lengths, \
                    T *restrict dx, int64_t r0, int64_t r1, int64_t m) {                    \
    for (int64_t r = r0; r < r1; ++r) {                                                     \
      const T *restrict yr = y + r * m;                                                     \
      const T *restrict gr = g + r * m;                                                     \
      T *restrict dr = dx + r * m;                                                          \
      int64_t L = lengths[r];                                                                  \
      if (L > m) L = m;                                                                     \
      if (L < 0) L = 0;                                                                     \
      T s = 0;                                                                              \
      _Pragma("omp simd reduction(+ : s)") for (int64_t j = 0; j < L; ++j) s += gr[j] * yr[j]; \
      _Pragma("omp simd") for (int64_t j = 0; j < L; ++j) dr[j] = yr[j] * (gr[j] - s);      \
      if (L < m) memset(dr + L, 0, (size_t)(m - L) * sizeof(T));                            \
    }                                                                                       \
  }                                                                                         \
                                                                                            \
  /* s[r, j] = sum_k w[k] tanh(qh[r, k] + kh[b, j, k]) for j < lengths[r], else 0;            \
   * rows r index the flattened (B, n), b = r / n. */                                       \
  void add_fwd_##SUF(const T *restrict qh, const T *restrict kh, const T *restrict w,      \
                     const int64_t *restrict lengths, T *restrict s, int64_t r0, int64_t r1,   \
                     int64_t n, int64_t m, int64_t h) {                                     \
    for (int64_t r = r0; r < r1; ++r) {                                                     \
      const T *restrict q = qh + r * h;                                                     \
      const T *restrict K = kh + (r / n) * m * h;                                           \
      T *restrict sr = s + r * m;                                                           \
      int64_t L = lengths[r];                                                                  \
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
  /* Backward of add_fwd with tanh recomputed. dq rows [r0, r1) are owned by the caller's   \
   * range; dk (B, m, h) and dw (h) are per-range buffers summed by the caller. All are     \
   * accumulated into (pre-zeroed). */                                                      \
  void add_bwd_##SUF(const T *restrict qh, const T *restrict kh, const T *restrict w,      \
                     const int64_t *restrict lengths, const T *restrict g, T *restrict dq,     \
                     T *restrict dk, T *restrict dw, int64_t r0, int64_t r1, int64_t n,     \
                     int64_t m, int64_t h) {                                                \
    for (int64_t r = r0; r < r1; ++r) {                                                     \
      int64_t b = r / n;                                                                    \
      const T *restrict q = qh + r * h;                                                     \
      const T *restrict K = kh + b * m * h;                                                 \
      T *restrict dK = dk + b * m * h;                                                      \
      T *restrict dqr = dq + r * h;                                                         \
      const T *restrict gr = g + r * m;                                                     \
      int64_t L = lengths[r];                                                                  \
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

DEFINE_KERNELS(float, f32, expf, tanhf)
DEFINE_KERNELS(double, f64, exp, tanh)

/* Range t of `parts` is [cuts[t], cuts[t + 1]); one range per OpenMP thread. */
#define EACH_RANGE(CALL)                                                                    \
  _Pragma("omp parallel for num_threads((int)parts) schedule(static, 1)")                    \
  for (int64_t t = 0; t < parts; ++t) {                                                     \
    const int64_t r0 = cuts[t], r1 = cuts[t + 1];                                           \
    CALL;                                                                                   \
  }

#define DEFINE_DRIVERS(T, SUF)                                                              \
  void ms_fwd_par_##SUF(const T *x, const int64_t *lengths, T *y, const int64_t *cuts,      \
                        int64_t parts, int64_t m) {                                         \
    EACH_RANGE(ms_fwd_##SUF(x, lengths, y, r0, r1, m))                                      \
  }                                                                                         \
  void ms_bwd_par_##SUF(const T *y, const T *g, const int64_t *lengths, T *dx,              \
                        const int64_t *cuts, int64_t parts, int64_t m) {                    \
    EACH_RANGE(ms_bwd_##SUF(y, g, lengths, dx, r0, r1, m))                                  \
  }                                                                                         \
  void add_fwd_par_##SUF(const T *qh, const T *kh, const T *w, const int64_t *lengths,      \
                         T *s, const int64_t *cuts, int64_t parts, int64_t n, int64_t m,    \
                         int64_t h) {                                                       \
    EACH_RANGE(add_fwd_##SUF(qh, kh, w, lengths, s, r0, r1, n, m, h))                       \
  }                                                                                         \
  /* dk holds `parts` (B, m, h) accumulators and dw `parts` (h,) ones, range t owns the     \
   * t-th of each. */                                                                       \
  void add_bwd_par_##SUF(const T *qh, const T *kh, const T *w, const int64_t *lengths,      \
                         const T *g, T *dq, T *dk, T *dw, const int64_t *cuts, int64_t parts, \
                         int64_t n, int64_t m, int64_t h, int64_t batch) {                  \
    EACH_RANGE(add_bwd_##SUF(qh, kh, w, lengths, g, dq, dk + t * batch * m * h, dw + t * h,  \
                             r0, r1, n, m, h))                                              \
  }

DEFINE_DRIVERS(float, f32)
DEFINE_DRIVERS(double, f64)

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
int attnscore_kernels_abi(void) { return 2; }
