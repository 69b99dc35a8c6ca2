// specdec's CPU GEMV kernels for the few-row products of decoding and verifying: int4 weights in groups of 32 (an
// asymmetric scale and zero per group) and int8 rows (one scale per row), both times bf16 activations, accumulated
// in float32. Hand-written because aten's kernels for these layouts (`_weight_int4pack_mm_for_cpu`,
// `_weight_int8pack_mm`) are slower at one row on AVX-512 BF16 CPUs and no kept library ships one (see
// docs/library.md; specdec/quant/native.py builds and loads this file).
//
// Every output row is computed by the same operations in the same order whatever the number of rows, their position
// in the batch and the thread count: a token's logits do not depend on how wide the forward that scored it was.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstring>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define SPECDEC_AVX512_BF16 1
#endif

namespace {

inline float from_bf16(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#ifdef SPECDEC_AVX512_BF16
inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif

// Rows n0 .. n0 + NB of y[m, n] = sum_k x[m, k] * w[n, k] for the MB activation rows from x:
//   w[n, k] = s[n, g] * (128 + q[n, k]) + c[n, g], g = k / 32, c = zero - 136 s (the same w as (q - 8) s + zero).
// q: [N, K / 2]; each group is 16 bytes, element j in byte j's low nibble, element j + 16 in its high one.
// sc: [N, 2, G] float32 (s, then c). x: [MB, K] bf16 bits; xs: [MB, G] the group sums of x.
// 128 + q is exact in bf16 (0x4300 | q), so a group's dot product is two bf16 dot-product instructions.
template <int MB, int NB>
void int4_block(const uint16_t* x, int64_t K, const float* xs, const uint8_t* q, const float* sc, int64_t n0,
                c10::BFloat16* y, int64_t N) {
  const int64_t G = K / 32;
#ifdef SPECDEC_AVX512_BF16
  __m256 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi16(0x000F), bias = _mm256_set1_epi16(0x4300);
  for (int64_t g = 0; g < G; ++g) {
    __m256i xa[MB], xb[MB];
    for (int m = 0; m < MB; ++m) {
      xa[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * K + g * 32));
      xb[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * K + g * 32 + 16));
    }
    for (int j = 0; j < NB; ++j) {
      const int64_t n = n0 + j;
      __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * (K / 2) + g * 16)));
      __m256i lo = _mm256_ternarylogic_epi32(b, nibble, bias, 0xEA);  // (b & 15) | bias
      __m256i hi = _mm256_ternarylogic_epi32(_mm256_srli_epi16(b, 4), nibble, bias, 0xEA);
      __m256 s = _mm256_broadcast_ss(sc + n * 2 * G + g);
      for (int m = 0; m < MB; ++m) {
        __m256 d = _mm256_dpbf16_ps(_mm256_setzero_ps(), (__m256bh)xa[m], (__m256bh)lo);
        d = _mm256_dpbf16_ps(d, (__m256bh)xb[m], (__m256bh)hi);
        acc[m][j] = _mm256_fmadd_ps(d, s, acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) {  // the zero terms: sum_g c[n, g] xs[m, g], into the same accumulator
      const float* c = sc + (n0 + j) * 2 * G + G;
      const float* xm = xs + m * G;
      int64_t g = 0;
      for (; g + 8 <= G; g += 8) acc[m][j] = _mm256_fmadd_ps(_mm256_loadu_ps(c + g), _mm256_loadu_ps(xm + g), acc[m][j]);
      if (g < G) {
        const __mmask8 tail = (__mmask8)((1u << (G - g)) - 1);
        acc[m][j] = _mm256_fmadd_ps(_mm256_maskz_loadu_ps(tail, c + g), _mm256_maskz_loadu_ps(tail, xm + g), acc[m][j]);
      }
    }
    for (int j = 0; j < NB; j += 4) {  // four rows' sums at once, each in the same order whatever NB is
      const __m256 zero = _mm256_setzero_ps();
      __m256 a = _mm256_hadd_ps(acc[m][j], NB > j + 1 ? acc[m][(j + 1) % NB] : zero);
      __m256 b = _mm256_hadd_ps(NB > j + 2 ? acc[m][(j + 2) % NB] : zero, NB > j + 3 ? acc[m][(j + 3) % NB] : zero);
      __m256 h = _mm256_hadd_ps(a, b);
      __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));  // rows j .. j + 3
      alignas(16) uint16_t out[8];
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out), (__m128i)_mm_cvtneps_pbh(sums));
      for (int i = 0; i < 4 && j + i < NB; ++i) std::memcpy(y + m * N + n0 + j + i, out + i, 2);
    }
  }
#else
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) {
      const int64_t n = n0 + j;
      float total = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* b = q + n * (K / 2) + g * 16;
        const uint16_t* xg = x + m * K + g * 32;
        float dot = 0.f;
        for (int i = 0; i < 16; ++i)
          dot += from_bf16(xg[i]) * float(128 + (b[i] & 15)) + from_bf16(xg[i + 16]) * float(128 + (b[i] >> 4));
        total += dot * sc[n * 2 * G + g] + sc[n * 2 * G + G + g] * xs[m * G + g];
      }
      y[m * N + n] = c10::BFloat16(total);
    }
#endif
}

template <int MB>
void int4_rows(const uint16_t* x, int64_t K, const float* xs, const uint8_t* q, const float* sc, c10::BFloat16* y,
               int64_t N) {
  at::parallel_for(0, N / 4, 32, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) int4_block<MB, 4>(x, K, xs, q, sc, b * 4, y, N);
  });
  for (int64_t n = N / 4 * 4; n < N; ++n) int4_block<MB, 1>(x, K, xs, q, sc, n, y, N);
}

// x [M, K] bf16, q [N, K / 2] uint8, sc [N, 2, K / 32] float32 -> [M, N] bf16.
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sc) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "int4_mm: x must be [M, K] bf16");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), G = K / 32;
  TORCH_CHECK(K % 32 == 0 && q.scalar_type() == at::kByte && q.dim() == 2 && q.size(1) == K / 2 && q.is_contiguous(),
              "int4_mm: q must be contiguous [N, K / 2] uint8 with K a multiple of 32");
  TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.dim() == 3 && sc.size(0) == N && sc.size(1) == 2 &&
              sc.size(2) == G && sc.is_contiguous(), "int4_mm: sc must be contiguous [N, 2, K / 32] float32");
  const at::Tensor xc = x.contiguous();
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  std::vector<float> xs(M * G);
  for (int64_t i = 0; i < M * G; ++i) {
    float t = 0.f;
    for (int e = 0; e < 32; ++e) t += from_bf16(xp[i * 32 + e]);
    xs[i] = t;
  }
  at::Tensor y = at::empty({M, N}, x.options());
  auto* yp = y.data_ptr<c10::BFloat16>();
  const auto* qp = q.data_ptr<uint8_t>();
  const float* sp = sc.data_ptr<float>();
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) int4_rows<4>(xp + m * K, K, xs.data() + m * G, qp, sp, yp + m * N, N);
  switch (M - m) {
    case 3: int4_rows<3>(xp + m * K, K, xs.data() + m * G, qp, sp, yp + m * N, N); break;
    case 2: int4_rows<2>(xp + m * K, K, xs.data() + m * G, qp, sp, yp + m * N, N); break;
    case 1: int4_rows<1>(xp + m * K, K, xs.data() + m * G, qp, sp, yp + m * N, N); break;
    default: break;
  }
  return y;
}

// One int8 row times MB float32 activation rows (each K apart): per row, four float32 accumulators over 32-element
// steps, summed; the same operations for a row whatever MB is.
template <int MB>
[[gnu::always_inline]] inline void int8_dots(const int8_t* p, const float* x, int64_t K, float* out) {
  int64_t k = 0;
  float t[MB];
#ifdef SPECDEC_AVX512_BF16
  __m256 a[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < 4; ++i) a[m][i] = _mm256_setzero_ps();
  for (; k + 32 <= K; k += 32)
    for (int i = 0; i < 4; ++i) {
      const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + k + 8 * i))));
      for (int m = 0; m < MB; ++m) a[m][i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + m * K + k + 8 * i), a[m][i]);
    }
  for (int m = 0; m < MB; ++m) t[m] = hsum(_mm256_add_ps(_mm256_add_ps(a[m][0], a[m][1]), _mm256_add_ps(a[m][2], a[m][3])));
#else
  for (int m = 0; m < MB; ++m) t[m] = 0.f;
#endif
  for (; k < K; ++k)
    for (int m = 0; m < MB; ++m) t[m] += float(p[k]) * x[m * K + k];
  for (int m = 0; m < MB; ++m) out[m] = t[m];
}

// x [M, K] bf16, q [N, K] int8, s [N] bf16 -> [M, N] bf16: y[m, n] = s[n] * sum_k x[m, k] q[n, k].
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "int8_mm: x must be [M, K] bf16");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.size(1) == K && q.is_contiguous(),
              "int8_mm: q must be contiguous [N, K] int8");
  TORCH_CHECK(s.scalar_type() == at::kBFloat16 && s.numel() == N && s.is_contiguous(), "int8_mm: s must be [N] bf16");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(s.data_ptr());
  at::Tensor y = at::empty({M, N}, x.options());
  auto* yp = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, N, 256, [&](int64_t begin, int64_t end) {
    float t[4];
    for (int64_t n = begin; n < end; ++n) {
      const float scale = from_bf16(sp[n]);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {
        int8_dots<4>(qp + n * K, xp + m * K, K, t);
        for (int i = 0; i < 4; ++i) yp[(m + i) * N + n] = c10::BFloat16(t[i] * scale);
      }
      const int rest = int(M - m);
      if (rest == 3) int8_dots<3>(qp + n * K, xp + m * K, K, t);
      if (rest == 2) int8_dots<2>(qp + n * K, xp + m * K, K, t);
      if (rest == 1) int8_dots<1>(qp + n * K, xp + m * K, K, t);
      for (int i = 0; i < rest; ++i) yp[(m + i) * N + n] = c10::BFloat16(t[i] * scale);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(specdec_lowbit, m) {
  m.def("int4_mm(Tensor x, Tensor q, Tensor sc) -> Tensor");
  m.def("int8_mm(Tensor x, Tensor q, Tensor s) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec_lowbit, CPU, m) {
  m.impl("int4_mm", &int4_mm);
  m.impl("int8_mm", &int8_mm);
}
