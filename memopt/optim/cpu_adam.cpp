// memopt's host AdamW kernel (CPUAdamW): what it computes, its layout and why are in cpu_adam.py's docstring.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if !defined(MEMOPT_PORTABLE) && (defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)))
#define MEMOPT_SIMD 1
#include <immintrin.h>
#else
#define MEMOPT_SIMD 0
#endif

namespace {

constexpr int64_t kChunk = 1 << 15;  // elements per work item (128 KiB of each fp32 stream)
enum Out { kNone = 0, kFp16 = 1, kBf16 = 2, kFp32 = 3 };  // what the optional copy of p is written as

struct Coeffs {
  float b1, omb1, b2, omb2, decay, step_size, inv_bc2_sqrt, eps, inv_grad_scale;
};

// Round to nearest even: the bits of Tensor.to(bfloat16) for every non-NaN value (denormals kept);
// NaN -> 0x7FC0 as c10::BFloat16(float) (torch's vectorised CPU cast writes 0xFFFF instead).
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return (f != f) ? uint16_t(0x7FC0) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <int K>
inline uint16_t lowp_bits(float f) {
  if constexpr (K == kBf16) return bf16_bits(f);
  else return c10::Half(f).x;  // IEEE round to nearest even, as Tensor.to(float16)
}

// Element i of the gradient (G: its dtype; fp16/bf16 gradients are read as the chunk engine keeps them).
enum Grad { kG32 = 0, kG16 = 1, kGbf = 2 };
template <int G>
inline float g_one(const void* g, int64_t i) {
  if constexpr (G == kG32) return static_cast<const float*>(g)[i];
  else if constexpr (G == kG16) {
    c10::Half h;
    h.x = static_cast<const uint16_t*>(g)[i];
    return float(h);
  } else {
    const uint32_t u = uint32_t(static_cast<const uint16_t*>(g)[i]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
}

// Element i of the optional copy of p (K: its dtype).
template <int K>
inline void out_one(void* o, int64_t i, float p) {
  if constexpr (K == kFp32) static_cast<float*>(o)[i] = p;
  else if constexpr (K != kNone) static_cast<uint16_t*>(o)[i] = lowp_bits<K>(p);
}

// One element, with the same operations (explicit FMAs) as the SIMD body below, so an element's
// result does not depend on whether it falls in a vector body or a tail.
inline void adamw_one(float& p, float g, float& m, float& v, const Coeffs& c) {
  const float gi = g * c.inv_grad_scale;
  const float mi = std::fma(c.b1, m, c.omb1 * gi);
  const float vi = std::fma(c.b2, v, (c.omb2 * gi) * gi);
  const float denom = std::fma(std::sqrt(vi), c.inv_bc2_sqrt, c.eps);
  p = std::fma(-c.step_size, mi / denom, p * c.decay);
  m = mi;
  v = vi;
}

#if MEMOPT_SIMD
#if defined(__AVX512F__)
using vec = __m512;
using hvec = __m256i;  // 16 x 16-bit
constexpr int kLanes = 16;
inline vec vset(float x) { return _mm512_set1_ps(x); }
inline vec vload(const float* a) { return _mm512_loadu_ps(a); }
inline void vstore(float* a, vec x) { _mm512_storeu_ps(a, x); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec vsqrt(vec a) { return _mm512_sqrt_ps(a); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline hvec to_fp16v(vec x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline hvec to_bf16v(vec x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
inline void hstore(uint16_t* d, hvec h) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), h); }
inline void hstream(uint16_t* d, hvec h) { _mm256_stream_si256(reinterpret_cast<__m256i*>(d), h); }
inline void vstream(float* a, vec x) { _mm512_stream_ps(a, x); }
inline vec load_h16(const uint16_t* h) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h))); }
inline vec load_bf16(const uint16_t* h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h))), 16));
}
inline __m512d dlo(vec x) { return _mm512_cvtps_pd(_mm512_castps512_ps256(x)); }
inline __m512d dhi(vec x) { return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))); }
using dvec = __m512d;
inline dvec dzero() { return _mm512_setzero_pd(); }
inline dvec dadd(dvec a, dvec b) { return _mm512_add_pd(a, b); }
inline double dsum(dvec a) { return _mm512_reduce_add_pd(a); }
#else
using vec = __m256;
using hvec = __m128i;  // 8 x 16-bit
constexpr int kLanes = 8;
inline vec vset(float x) { return _mm256_set1_ps(x); }
inline vec vload(const float* a) { return _mm256_loadu_ps(a); }
inline void vstore(float* a, vec x) { _mm256_storeu_ps(a, x); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
inline vec vsqrt(vec a) { return _mm256_sqrt_ps(a); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline hvec to_fp16v(vec x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT); }
inline hvec to_bf16v(vec x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)),
                                           _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  const __m256i packed = _mm256_packus_epi32(r, r);  // per 128-bit lane: r0..3 r0..3 | r4..7 r4..7
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));  // r0..7
}
inline void hstore(uint16_t* d, hvec h) { _mm_storeu_si128(reinterpret_cast<__m128i*>(d), h); }
inline void hstream(uint16_t* d, hvec h) { _mm_stream_si128(reinterpret_cast<__m128i*>(d), h); }
inline void vstream(float* a, vec x) { _mm256_stream_ps(a, x); }
inline vec load_h16(const uint16_t* h) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))); }
inline vec load_bf16(const uint16_t* h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))), 16));
}
inline __m256d dlo(vec x) { return _mm256_cvtps_pd(_mm256_castps256_ps128(x)); }
inline __m256d dhi(vec x) { return _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)); }
using dvec = __m256d;
inline dvec dzero() { return _mm256_setzero_pd(); }
inline dvec dadd(dvec a, dvec b) { return _mm256_add_pd(a, b); }
inline double dsum(dvec a) {
  const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}
#endif

// kLanes gradient elements from element i (G: their dtype), as fp32.
template <int G>
inline vec gload(const void* g, int64_t i) {
  if constexpr (G == kG32) return vload(static_cast<const float*>(g) + i);
  else if constexpr (G == kG16) return load_h16(static_cast<const uint16_t*>(g) + i);
  else return load_bf16(static_cast<const uint16_t*>(g) + i);
}

// Each iteration reads a 128-float tile (8 cache lines) of g, then of m, v and p, and writes p, m,
// v back tile by tile: bursts of consecutive lines per stream were measurably faster on one core
// than interleaving the four streams line by line (experiments/cpu_adam/README.md). The optional
// fp16/bf16/fp32 copy of p is written from registers with non-temporal stores when 64-byte aligned
// (it is read next by a DMA copy or the next forward, not now by this core, and this avoids the
// read-for-ownership).
constexpr int kTile = 128;
constexpr int kU = kTile / kLanes;

template <int K>
inline void copy_out(void* o, int64_t i, const vec* P, bool nt) {
  if constexpr (K == kFp32) {
    float* f = static_cast<float*>(o) + i;
#pragma GCC unroll 16
    for (int u = 0; u < kU; ++u) {
      if (nt) vstream(f + kLanes * u, P[u]);
      else vstore(f + kLanes * u, P[u]);
    }
  } else {
    uint16_t* h16 = static_cast<uint16_t*>(o) + i;
#pragma GCC unroll 16
    for (int u = 0; u < kU; ++u) {
      const hvec h = K == kFp16 ? to_fp16v(P[u]) : to_bf16v(P[u]);
      if (nt) hstream(h16 + kLanes * u, h);
      else hstore(h16 + kLanes * u, h);
    }
  }
}

// g and o may be the same memory (the chunk engine's fp16 payload holds the gradients and receives
// the parameters): a tile of g is loaded before the same tile of o is stored, and nothing else aliases.
template <int G, int K>
void adamw_block(float* __restrict p, const void* g, float* __restrict m, float* __restrict v,
                 void* o, int64_t n, const Coeffs& c) {
  const vec B1 = vset(c.b1), OMB1 = vset(c.omb1), B2 = vset(c.b2), OMB2 = vset(c.omb2), DEC = vset(c.decay),
            NSS = vset(-c.step_size), IBC = vset(c.inv_bc2_sqrt), EPS = vset(c.eps), IGS = vset(c.inv_grad_scale);
  const bool nt = K != kNone && reinterpret_cast<uintptr_t>(o) % 64 == 0;
  int64_t i = 0;
  for (; i + kTile <= n; i += kTile) {
    vec GV[kU], M[kU], V[kU], P[kU];
#pragma GCC unroll 16
    for (int u = 0; u < kU; ++u) GV[u] = gload<G>(g, i + kLanes * u);
#pragma GCC unroll 16
    for (int u = 0; u < kU; ++u) M[u] = vload(m + i + kLanes * u);
#pragma GCC unroll 16
    for (int u = 0; u < kU; ++u) V[u] = vload(v + i + kLanes * u);
#pragma GCC unroll 16
    for (int u = 0; u < kU; ++u) P[u] = vload(p + i + kLanes * u);
#pragma GCC unroll 16
    for (int u = 0; u < kU; ++u) {
      const vec gi = vmul(GV[u], IGS);
      M[u] = vfma(B1, M[u], vmul(OMB1, gi));
      V[u] = vfma(B2, V[u], vmul(vmul(OMB2, gi), gi));
      const vec denom = vfma(vsqrt(V[u]), IBC, EPS);
      P[u] = vfma(NSS, vdiv(M[u], denom), vmul(P[u], DEC));
    }
#pragma GCC unroll 16
    for (int u = 0; u < kU; ++u) vstore(p + i + kLanes * u, P[u]);
#pragma GCC unroll 16
    for (int u = 0; u < kU; ++u) vstore(m + i + kLanes * u, M[u]);
#pragma GCC unroll 16
    for (int u = 0; u < kU; ++u) vstore(v + i + kLanes * u, V[u]);
    if constexpr (K != kNone) copy_out<K>(o, i, P, nt);
  }
  for (; i < n; ++i) {
    adamw_one(p[i], g_one<G>(g, i), m[i], v[i], c);
    out_one<K>(o, i, p[i]);
  }
  if (nt) _mm_sfence();
}

// Sum of squares of n gradient elements in double: per 128-element tile the squares are summed in
// fp32 lanes (kU terms each), then added in double.
template <int G>
double sumsq_block(const void* g, int64_t n) {
  dvec lo = dzero(), hi = dzero();
  int64_t i = 0;
  for (; i + kTile <= n; i += kTile) {
    vec x = gload<G>(g, i);
    vec s = vmul(x, x);
#pragma GCC unroll 16
    for (int u = 1; u < kU; ++u) {
      x = gload<G>(g, i + kLanes * u);
      s = vfma(x, x, s);
    }
    lo = dadd(lo, dlo(s));
    hi = dadd(hi, dhi(s));
  }
  double acc = dsum(lo) + dsum(hi);
  for (; i < n; ++i) {
    const double x = g_one<G>(g, i);
    acc += x * x;
  }
  return acc;
}
#else
// Portable path (no AVX2+FMA+F16C / AVX-512, or -DMEMOPT_PORTABLE): a loop the compiler vectorises
// for the target; the fp16/bf16/fp32 copy is made per 1024-element sub-block while it is in L1.
template <int G>
inline void adamw_loop(float* __restrict p, const void* g, float* __restrict m, float* __restrict v,
                       int64_t n, const Coeffs& c) {
  const float b1 = c.b1, omb1 = c.omb1, b2 = c.b2, omb2 = c.omb2, decay = c.decay,
              step_size = c.step_size, inv_bc2_sqrt = c.inv_bc2_sqrt, eps = c.eps, inv_gs = c.inv_grad_scale;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g_one<G>(g, i) * inv_gs;
    const float mi = b1 * m[i] + omb1 * gi;
    const float vi = b2 * v[i] + (omb2 * gi) * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay - step_size * (mi / (std::sqrt(vi) * inv_bc2_sqrt + eps));
  }
}

template <int G>
inline const void* g_at(const void* g, int64_t b) {
  return static_cast<const char*>(g) + b * (G == kG32 ? 4 : 2);
}

// g and o may be the same memory: a 1024-element sub-block of g is read before o's is written.
template <int G, int K>
void adamw_block(float* __restrict p, const void* g, float* __restrict m, float* __restrict v,
                 void* o, int64_t n, const Coeffs& c) {
  if constexpr (K == kNone) {
    adamw_loop<G>(p, g, m, v, n, c);
  } else {
    constexpr int64_t kSub = 1024;
    for (int64_t b = 0; b < n; b += kSub) {
      const int64_t len = std::min(kSub, n - b);
      adamw_loop<G>(p + b, g_at<G>(g, b), m + b, v + b, len, c);
#pragma omp simd
      for (int64_t i = b; i < b + len; ++i) out_one<K>(o, i, p[i]);
    }
  }
}

template <int G>
double sumsq_block(const void* g, int64_t n) {
  double acc = 0.0;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) {
    const double x = g_one<G>(g, i);
    acc += x * x;
  }
  return acc;
}
#endif

struct Item {
  int64_t tensor, begin, end;
};

void check_fp32(const at::Tensor& t, int64_t numel, const char* what, size_t i) {
  TORCH_CHECK(t.device().is_cpu(), "CPUAdamW: ", what, "[", i, "] must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat, "CPUAdamW: ", what, "[", i, "] must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "CPUAdamW: ", what, "[", i, "] must be contiguous");
  TORCH_CHECK(t.numel() == numel, "CPUAdamW: ", what, "[", i, "] has ", t.numel(), " elements, param has ", numel);
}

int grad_kind(const at::Tensor& g) {
  return g.scalar_type() == at::kHalf ? kG16 : g.scalar_type() == at::kBFloat16 ? kGbf : kG32;
}

void check_grad(const at::Tensor& g, int64_t numel, size_t i) {
  TORCH_CHECK(g.device().is_cpu(), "CPUAdamW: grads[", i, "] must be a CPU tensor");
  TORCH_CHECK(g.scalar_type() == at::kFloat || g.scalar_type() == at::kHalf || g.scalar_type() == at::kBFloat16,
              "CPUAdamW: grads[", i, "] must be float32, float16 or bfloat16, got ", g.scalar_type());
  TORCH_CHECK(g.is_contiguous(), "CPUAdamW: grads[", i, "] must be contiguous");
  TORCH_CHECK(g.numel() == numel, "CPUAdamW: grads[", i, "] has ", g.numel(), " elements, param has ", numel);
}

template <int G>
void block_for(int kind, float* p, const void* g, float* m, float* v, void* o, int64_t len, const Coeffs& c) {
  switch (kind) {
    case kFp16: adamw_block<G, kFp16>(p, g, m, v, o, len, c); break;
    case kBf16: adamw_block<G, kBf16>(p, g, m, v, o, len, c); break;
    case kFp32: adamw_block<G, kFp32>(p, g, m, v, o, len, c); break;
    default: adamw_block<G, kNone>(p, g, m, v, nullptr, len, c);
  }
}

void adamw_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, at::TensorList out, at::ArrayRef<double> weight_decays,
                double lr, double beta1, double beta2, double eps, int64_t step, double grad_scale) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && weight_decays.size() == n,
              "CPUAdamW: params, grads, exp_avgs, exp_avg_sqs and weight_decays must have the same length");
  TORCH_CHECK(out.empty() || out.size() == n, "CPUAdamW: out must be empty or one per param");
  TORCH_CHECK(step >= 1, "CPUAdamW: step must be >= 1");
  TORCH_CHECK(grad_scale != 0.0, "CPUAdamW: grad_scale must be nonzero");

  const double bc1 = 1.0 - std::pow(beta1, double(step));
  const double bc2 = 1.0 - std::pow(beta2, double(step));
  std::vector<Coeffs> coeffs(n);
  std::vector<float*> P(n), M(n), V(n);
  std::vector<const void*> G(n);
  std::vector<void*> O(n, nullptr);
  std::vector<int> kind(n, kNone), gkind(n, kG32);
  std::vector<Item> items;
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = params[i].numel();
    check_fp32(params[i], numel, "params", i);
    check_grad(grads[i], numel, i);
    check_fp32(exp_avgs[i], numel, "exp_avgs", i);
    check_fp32(exp_avg_sqs[i], numel, "exp_avg_sqs", i);
    if (!out.empty()) {
      const at::Tensor& o = out[i];
      TORCH_CHECK(o.device().is_cpu() && o.is_contiguous() && o.numel() == numel &&
                      (o.scalar_type() == at::kHalf || o.scalar_type() == at::kBFloat16 ||
                       o.scalar_type() == at::kFloat),
                  "CPUAdamW: out[", i, "] must be a contiguous CPU float16/bfloat16/float32 tensor with ", numel,
                  " elements");
      TORCH_CHECK(o.data_ptr() != params[i].data_ptr(), "CPUAdamW: out[", i, "] is params[", i, "] itself");
      TORCH_CHECK(o.data_ptr() != grads[i].data_ptr() || o.scalar_type() == grads[i].scalar_type(),
                  "CPUAdamW: out[", i, "] shares grads[", i, "]'s memory with another dtype");
      O[i] = o.data_ptr();
      kind[i] = o.scalar_type() == at::kBFloat16 ? kBf16 : o.scalar_type() == at::kHalf ? kFp16 : kFp32;
    }
    P[i] = params[i].data_ptr<float>();
    G[i] = grads[i].data_ptr();
    gkind[i] = grad_kind(grads[i]);
    M[i] = exp_avgs[i].data_ptr<float>();
    V[i] = exp_avg_sqs[i].data_ptr<float>();
    coeffs[i] = Coeffs{float(beta1), float(1.0 - beta1), float(beta2), float(1.0 - beta2),
                       float(1.0 - lr * weight_decays[i]), float(lr / bc1), float(1.0 / std::sqrt(bc2)),
                       float(eps), float(1.0 / grad_scale)};
    for (int64_t b = 0; b < numel; b += kChunk) items.push_back(Item{int64_t(i), b, std::min(numel, b + kChunk)});
  }

  // One parallel region for the whole step (ATen's OpenMP pool, torch.set_num_threads applies);
  // each thread gets a contiguous run of chunks.
  at::parallel_for(0, int64_t(items.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      const Item& it = items[k];
      const size_t t = size_t(it.tensor);
      const int64_t b = it.begin, len = it.end - it.begin;
      const int gsz = gkind[t] == kG32 ? 4 : 2, osz = kind[t] == kFp32 ? 4 : 2;
      const void* g = static_cast<const char*>(G[t]) + b * gsz;
      void* o = O[t] ? static_cast<void*>(static_cast<char*>(O[t]) + b * osz) : nullptr;
      switch (gkind[t]) {
        case kG16: block_for<kG16>(kind[t], P[t] + b, g, M[t] + b, V[t] + b, o, len, coeffs[t]); break;
        case kGbf: block_for<kGbf>(kind[t], P[t] + b, g, M[t] + b, V[t] + b, o, len, coeffs[t]); break;
        default: block_for<kG32>(kind[t], P[t] + b, g, M[t] + b, V[t] + b, o, len, coeffs[t]);
      }
    }
  });
}

// Sum of the squares of every element of xs (fp32/fp16/bf16 CPU tensors), in double: per 32 Ki-element
// work item in parallel, the items then added in order, so the result does not depend on the threads.
double sumsq(at::TensorList xs) {
  std::vector<Item> items;
  std::vector<const void*> X(xs.size());
  std::vector<int> gk(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    check_grad(xs[i], xs[i].numel(), i);
    X[i] = xs[i].data_ptr();
    gk[i] = grad_kind(xs[i]);
    for (int64_t b = 0; b < xs[i].numel(); b += kChunk)
      items.push_back(Item{int64_t(i), b, std::min(xs[i].numel(), b + kChunk)});
  }
  std::vector<double> part(items.size(), 0.0);
  at::parallel_for(0, int64_t(items.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      const Item& it = items[k];
      const size_t t = size_t(it.tensor);
      const int64_t len = it.end - it.begin;
      switch (gk[t]) {
        case kG16: part[k] = sumsq_block<kG16>(static_cast<const uint16_t*>(X[t]) + it.begin, len); break;
        case kGbf: part[k] = sumsq_block<kGbf>(static_cast<const uint16_t*>(X[t]) + it.begin, len); break;
        default: part[k] = sumsq_block<kG32>(static_cast<const float*>(X[t]) + it.begin, len);
      }
    }
  });
  double acc = 0.0;
  for (double x : part) acc += x;
  return acc;
}

// fp32 lanes of the SIMD path this build uses (16: AVX-512, 8: AVX2; 1: portable loop).
int64_t simd_width() {
#if MEMOPT_SIMD
  return kLanes;
#else
  return 1;
#endif
}

}  // namespace

TORCH_LIBRARY(memopt_cpu_adam, m) {
  m.def("adamw_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] out, float[] weight_decays, float lr, float beta1, float beta2, float eps, int step, "
        "float grad_scale) -> ()");
  m.def("simd_width() -> int", &simd_width);
  m.def("sumsq(Tensor[] xs) -> float");
}
TORCH_LIBRARY_IMPL(memopt_cpu_adam, CPU, m) {
  m.impl("adamw_step", &adamw_step);
  m.impl("sumsq", &sumsq);
}
