// A weight-only int8 product for a few rows: y[m, n] = scale[n] * sum_k x[m, k] * w[n, k].
//
// Why a kernel of our own: River's quantized layers read a quarter of the bytes of the float32
// ones, but torch's CPU kernel for them (`_weight_int8pack_mm`) takes bf16 activations and, on a
// CPU without native bf16 (AVX2), streamed its int8 weights at about half the speed oneDNN streams
// float32 ones: a layer cost 0.5-0.65x the float32 layer instead of about a quarter. Decode is a
// chain of matrix-vector products, so its speed is how fast the weights stream from memory; this
// one reads each weight row once for all `x` rows (decode feeds 1-16), widens 16 codes at a time
// to float32 and accumulates in float32, so the activations stay float32 (no bf16 rounding).
//
// Layout: x `[M, K]` float32 (rows contiguous), w `[N, K]` int8 contiguous, scale `[N]` float32.
// Work: output columns are split over torch's threads in chunks; within a chunk, four weight rows
// at a time against every x row.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define BW_INT8_AVX2 1
#endif

#include <algorithm>

namespace {

constexpr int64_t kRowsPerPass = 4;  // weight rows sharing one pass over an x row
constexpr int64_t kPrefetchBytes = 512;  // how far ahead each weight row is requested
constexpr int64_t kMaxXRows = 4;     // x rows a pass keeps in registers (more: several passes)

#ifdef BW_INT8_AVX2
inline float hsum(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 int8 codes at `p` as 8 floats
inline __m256 widen8(const int8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}
#endif

// rows [n0, n0 + R) of w against x rows [0, MB): out[m * N + n] (unscaled). Both counts are
// compile-time constants so the accumulators stay in registers.
template <int R, int MB>
void rows_pass(const float* x, const int8_t* w, int64_t K, int64_t n0, int64_t N, float* out) {
  int64_t k_vec = 0;
#ifdef BW_INT8_AVX2
  k_vec = K - K % 8;
  __m256 acc[MB][R];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_vec; k += 8) {
    if ((k & 63) == 0)
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + r) * K + k + kPrefetchBytes), _MM_HINT_T0);
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = widen8(w + (n0 + r) * K + k);
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * K + k);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm256_fmadd_ps(xv, wv[r], acc[i][r]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < R; ++r) out[i * N + n0 + r] = hsum(acc[i][r]);
#else
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < R; ++r) out[i * N + n0 + r] = 0.f;
#endif
  for (int i = 0; i < MB; ++i) {  // the tail of K that fills no vector (all of it without AVX2)
    for (int r = 0; r < R; ++r) {
      const int8_t* wr = w + (n0 + r) * K;
      float s = 0.f;
      for (int64_t k = k_vec; k < K; ++k) s += x[i * K + k] * static_cast<float>(wr[k]);
      out[i * N + n0 + r] += s;
    }
  }
}

// weight rows [begin, end) against `mb` (1..kMaxXRows) x rows
template <int MB>
void rows_range(const float* x, const int8_t* w, int64_t K, int64_t begin, int64_t end, int64_t N, float* out) {
  int64_t n = begin;
  for (; n + kRowsPerPass <= end; n += kRowsPerPass) rows_pass<kRowsPerPass, MB>(x, w, K, n, N, out);
  for (; n < end; ++n) rows_pass<1, MB>(x, w, K, n, N, out);
}

at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "int8_linear: x must be float32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous(),
              "int8_linear: w must be contiguous int8 [N, K]");
  TORCH_CHECK(scale.dim() == 1 && scale.scalar_type() == at::kFloat, "int8_linear: scale must be float32 [N]");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "int8_linear: x has ", K, " columns, w ", w.size(1));
  TORCH_CHECK(scale.numel() == N, "int8_linear: scale has ", scale.numel(), " values for ", N, " rows");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor s = scale.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // chunks of whole passes, a few per thread, so threads finish together
  const int64_t grain = std::max<int64_t>(kRowsPerPass, (N / (at::get_num_threads() * 8)) / kRowsPerPass * kRowsPerPass);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxXRows) {
      const int64_t mb = std::min<int64_t>(kMaxXRows, M - m0);
      const float* xm = xp + m0 * K;
      float* om = op + m0 * N;
      switch (mb) {
        case 1: rows_range<1>(xm, wp, K, begin, end, N, om); break;
        case 2: rows_range<2>(xm, wp, K, begin, end, N, om); break;
        case 3: rows_range<3>(xm, wp, K, begin, end, N, om); break;
        default: rows_range<4>(xm, wp, K, begin, end, N, om); break;
      }
      for (int64_t i = 0; i < mb; ++i)
        for (int64_t j = begin; j < end; ++j) om[i * N + j] *= sp[j];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(branchwise, m) { m.def("int8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor"); }

TORCH_LIBRARY_IMPL(branchwise, CPU, m) { m.impl("int8_linear", &int8_linear); }
