"""Host-side AdamW for ZeRO-Offload and the chunk engine's Hybrid Adam (``CPUAdamW``).

What it computes
----------------
``torch.optim.AdamW``'s math (Loshchilov & Hutter decoupled weight decay, bias-corrected), in
fp32, in place on fp32 CPU tensors (typically flat master-weight shards), with one step counter
shared by all tensors. For step ``t`` (1-based), per element::

    g  = grad / grad_scale
    m  = beta1 * m + (1 - beta1) * g
    v  = beta2 * v + (1 - beta2) * g * g
    p  = p * (1 - lr * wd) - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

The gradients may be fp16 or bf16 (the chunk engine's payloads), read and widened in the same pass, and
may share their memory with ``out`` (a chunk's payload holds the gradients and receives the parameters).

Optionally the updated ``p`` is also written into a second tensor in the same pass (``out``;
DeepSpeed's "fused copy back"): fp16 or bf16 (rounded to nearest even), or fp32 (a plain copy: the
fp32 parameters of a ZeRO-Offload run on a CPU device, whose host master is a separate tensor).
That costs 2 (4) more bytes per parameter instead of a second pass that reads 4 and writes 2 (4)
plus the write-allocate.

Implementations (chosen on measurements: ``experiments/cpu_adam/README.md``)
----------------------------------------------------------------------------
The step is memory bound: it reads p, g, m, v (16 B/param) and writes p, m, v (12 B/param),
28 B/param (30 with the low-precision copy). Candidates timed on the same tensors:

* ``"cpp"`` (the default when it builds): memopt's own C++ kernel in ``_CPP_SOURCE``, compiled
  on first use with ``torch.utils.cpp_extension.load_inline`` (``-O3 -march=native -fopenmp``).
  - SIMD body with AVX-512 (or AVX2+FMA+F16C) intrinsics that moves each stream in 128-float
    tiles (8 consecutive cache lines of g, then m, v, p; stores likewise). On one core this ran
    ~6 % faster than the same math as a plain ``#pragma omp simd`` loop, which interleaves the
    four streams line by line, and matched DeepSpeed's AVX-512 kernel (which also moves 8 vectors
    per stream at a time). Without those ISAs (or with ``-DMEMOPT_PORTABLE``) the ``omp simd``
    loop is used. Scalar tails use the same FMA sequence, so every element's result is
    independent of tensor splits, alignment and thread count.
  - One parallel region per step: all tensors of a step form one list of 32 Ki-element chunks
    handed to ``at::parallel_for`` (ATen's OpenMP pool, so ``torch.set_num_threads`` applies).
    DeepSpeed and ``torch._fused_adamw_`` open at least one region per tensor; on a shared,
    oversubscribed 2-core machine each extra fork/join can wait a scheduler time slice, which is
    where most of the 2-thread gap in the benchmark comes from.
  - Fused extras: the fp16/bf16/fp32 copy-out (``out``, written from registers with
    non-temporal stores when 64-B aligned, so it costs ~2 (4) B/param and no read-for-ownership) and
    the gradient unscale (``grad_scale``).
  - Compile cost: the source includes only ``torch/library.h`` and ATen's parallel header (no
    pybind, no ``torch/extension.h``) and registers a ``torch.ops.memopt_cpu_adam`` op, which
    keeps the one-time build at ~7 s on 2 cores (``torch/extension.h`` alone took ~23 s). The
    build is cached in torch's extension directory (``~/.cache/torch_extensions/...`` or
    ``$TORCH_EXTENSIONS_DIR``) under a name hashing the source, flags, torch version and the
    CPU's feature flags, so a ``-march=native`` binary is never reused on a different CPU.
* ``"torch"`` (fallback): ``torch._fused_adamw_``, PyTorch's own fused CPU kernel (what
  ``torch.optim.AdamW(fused=True)`` calls), one call per distinct weight decay; the
  copy into ``out`` (any of the three dtypes) is a second pass (``out.copy_(p)``): torch's
  kernel has no second output. Used when the kernel cannot be built
  (no compiler / ninja: a warning says why), or when asked for with ``impl="torch"`` or
  ``MEMOPT_CPU_ADAM=torch``. About as fast on one thread, slower on two and with the copy-out.
* ``_foreach_*`` ops (``torch.optim.AdamW(foreach=True)``) make one memory pass per elementary
  op and were ~8x slower; they appear only in the benchmark.

The two paths differ by fp32 rounding only (the kernel uses FMAs and multiplies by
``1/grad_scale``; torch divides).
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import warnings

import torch

__all__ = ["CPUAdamW", "kernel_available", "kernel_error", "kernel_simd_width", "load_kernel", "sumsq"]

log = logging.getLogger(__name__)

_NAMESPACE = "memopt_cpu_adam"

_CPP_SOURCE = r"""
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
"""

_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
_LDFLAGS = ["-fopenmp"]


def _cflags() -> list[str]:
    """``_CFLAGS`` plus ``$MEMOPT_CPU_ADAM_CFLAGS`` (``-mno-avx512f``: the AVX2 path; ``-DMEMOPT_PORTABLE``: the
    portable loop)."""
    return _CFLAGS + os.environ.get("MEMOPT_CPU_ADAM_CFLAGS", "").split()


_lock = threading.Lock()
_kernel = None  # the torch.ops op once loaded
_kernel_error: str | None = None
_tried = False


def _cpu_tag() -> str:
    """The CPU's feature flags (Linux) so a ``-march=native`` build is never reused on another CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _extension_name() -> str:
    key = "\n".join([_CPP_SOURCE, " ".join(_cflags() + _LDFLAGS), torch.__version__, _cpu_tag()])
    return f"memopt_cpu_adam_{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def load_kernel():
    """Compile (first use; cached in torch's extension dir) and load the C++ kernel.

    Returns the op, or ``None`` when it cannot be built here; ``kernel_error()`` then says why.
    """
    global _kernel, _kernel_error, _tried
    with _lock:
        if _tried:
            return _kernel
        _tried = True
        if hasattr(torch.ops, _NAMESPACE) and hasattr(getattr(torch.ops, _NAMESPACE), "adamw_step"):
            _kernel = torch.ops.memopt_cpu_adam.adamw_step  # already registered in this process
            return _kernel
        try:
            from torch.utils.cpp_extension import load_inline, verify_ninja_availability

            verify_ninja_availability()
            log.info("memopt CPUAdamW: compiling the C++ kernel (one time, ~10 s; cached in torch's extension dir)")
            load_inline(
                name=_extension_name(),
                cpp_sources=_CPP_SOURCE,
                extra_cflags=_cflags(),
                extra_ldflags=_LDFLAGS,
                is_python_module=False,
                no_implicit_headers=True,
                verbose=False,
            )
            _kernel = torch.ops.memopt_cpu_adam.adamw_step
        except Exception as e:  # no compiler, no ninja, unsupported flags, ...
            _kernel_error = _summarize(e)
            _kernel = None
        return _kernel


_SUMSQ_SLICE = 1 << 22  # elements per fp32 temporary of sumsq's torch path (16 MiB)


def sumsq(xs: list[torch.Tensor]) -> float:
    """Sum of the squares of every element of ``xs`` (contiguous fp32/fp16/bf16 CPU tensors), accumulated in
    double: not finite when an element is inf or NaN. Why not ``torch.linalg.vector_norm(x, dtype=float32)``:
    on a CPU it reads 2e8 bf16 elements 3% low (its fp32 accumulator), and ``x.float().pow(2).sum()`` holds a
    4 B/element copy. The C++ kernel reads each element once; without it, slices of 4 Mi elements are
    converted one at a time. Fake tensors (the planner's step) have no values: 0.0."""
    if any(type(x).__name__ == "FakeTensor" for x in xs):
        return 0.0
    if load_kernel() is not None and os.environ.get("MEMOPT_CPU_ADAM", "") != "torch":
        return float(torch.ops.memopt_cpu_adam.sumsq([x.contiguous() for x in xs]))
    acc = 0.0
    for x in xs:
        flat = x.reshape(-1)
        for a in range(0, flat.numel(), _SUMSQ_SLICE):
            acc += float(flat[a:a + _SUMSQ_SLICE].to(torch.float64).pow_(2).sum())
    return acc


def _summarize(e: Exception) -> str:
    """The exception type, its first line and the compiler's error lines, for a one-line message."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    head = lines[0].split(": [", 1)[0][:200]  # torch puts the ninja log after "...extension 'x': "
    errors = [ln[:200] for ln in lines[1:] if ("error" in ln.lower() or "not found" in ln.lower())
              and "-isystem" not in ln]
    return f"{type(e).__name__}: " + " | ".join([head] + errors[:3])


def kernel_available() -> bool:
    return load_kernel() is not None


def kernel_simd_width() -> int | None:
    """fp32 lanes of the built kernel's SIMD path: 16 AVX-512, 8 AVX2, 1 portable loop; None if unbuilt."""
    return int(torch.ops.memopt_cpu_adam.simd_width()) if load_kernel() is not None else None


def kernel_error() -> str | None:
    """Why the C++ kernel could not be built (``None`` if it was, or was not tried yet)."""
    return _kernel_error


class CPUAdamW:
    """AdamW (decoupled weight decay, torch.optim.AdamW math, bias-corrected) over fp32 CPU tensors.

    ``params`` are contiguous fp32 CPU tensors (e.g. flat master shards), updated in place.
    The states ``exp_avg`` / ``exp_avg_sq`` (lists, fp32, same shapes) are allocated eagerly
    here, zero-filled, so a caller can account their bytes (``state_nbytes``) before the first
    step. One step counter (``step_count``) is shared by all tensors.

    ``impl``: ``"auto"`` (C++ kernel, falling back to torch with a warning if it cannot be
    built; the environment variable ``MEMOPT_CPU_ADAM=cpp|torch`` overrides ``auto``), ``"cpp"``
    (error if it cannot be built) or ``"torch"`` (``torch._fused_adamw_``). ``self.impl`` says
    which one runs.
    """

    def __init__(self, params: list[torch.Tensor], lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, impl: str = "auto"):
        params = list(params)
        for i, p in enumerate(params):
            if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
                raise ValueError(f"CPUAdamW: params[{i}] must be a contiguous fp32 CPU tensor, "
                                 f"got {p.dtype} on {p.device} (contiguous={p.is_contiguous()})")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"CPUAdamW: betas must be in [0, 1), got {betas}")
        self.params = params
        self.lr = float(lr)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.step_count = 0
        with torch.no_grad():
            self.exp_avg = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in params]
            self.exp_avg_sq = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in params]
        self.impl = self._resolve_impl(impl)
        self._kernel = load_kernel() if self.impl == "cpp" else None

    @staticmethod
    def _resolve_impl(impl: str) -> str:
        if impl == "auto":
            impl = os.environ.get("MEMOPT_CPU_ADAM", "auto") or "auto"
        if impl not in ("auto", "cpp", "torch"):
            raise ValueError(f"CPUAdamW: impl must be auto, cpp or torch, got {impl!r}")
        if impl == "torch":
            return "torch"
        if load_kernel() is not None:
            return "cpp"
        if impl == "cpp":
            raise RuntimeError(f"CPUAdamW: the C++ kernel could not be built ({kernel_error()}); it needs a C++ "
                               "compiler with OpenMP and ninja (`pip install ninja`). "
                               "Use impl='torch' to run without it.")
        warnings.warn(f"memopt CPUAdamW: C++ kernel unavailable ({kernel_error()}); using the slower "
                      "torch._fused_adamw_ path. Install a C++ compiler and ninja to get the fast one.",
                      RuntimeWarning, stacklevel=3)
        return "torch"

    @property
    def state_nbytes(self) -> int:
        """Bytes held by exp_avg and exp_avg_sq."""
        return sum(t.numel() * t.element_size() for t in self.exp_avg + self.exp_avg_sq)

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor | None], lr: float | None = None,
             weight_decays: list[float] | None = None, out: list[torch.Tensor] | None = None,
             grad_scale: float = 1.0) -> None:
        """One AdamW step, in place on ``self.params``.

        ``grads[i]``: fp32 (or fp16/bf16, read as they are) CPU tensor with ``params[i]``'s numel, or ``None`` to leave that
        tensor (and its states) untouched this step. ``lr`` / ``weight_decays`` override the
        constructor's values for this step (``weight_decays``: one per param). ``out``: one
        fp16/bf16/fp32 CPU tensor per param (same numel, not the param itself) that receives the
        updated params (fp16/bf16 rounded to nearest even). ``grad_scale``: grads are divided by it before use (loss scale times
        clip factor); the C++ kernel leaves ``grads`` unchanged, the torch fallback unscales them
        in place, so treat them as consumed.
        """
        n = len(self.params)
        if len(grads) != n:
            raise ValueError(f"CPUAdamW.step: got {len(grads)} grads for {n} params")
        if weight_decays is None:
            weight_decays = [self.weight_decay] * n
        elif len(weight_decays) != n:
            raise ValueError(f"CPUAdamW.step: got {len(weight_decays)} weight_decays for {n} params")
        if out is not None and len(out) != n:
            raise ValueError(f"CPUAdamW.step: got {len(out)} out tensors for {n} params")
        lr = self.lr if lr is None else float(lr)
        step = self.step_count + 1
        idx = [i for i, g in enumerate(grads) if g is not None]
        if not idx:
            self.step_count = step
            return
        ps = [self.params[i] for i in idx]
        gs = [grads[i].contiguous() for i in idx]
        ms = [self.exp_avg[i] for i in idx]
        vs = [self.exp_avg_sq[i] for i in idx]
        wds = [float(weight_decays[i]) for i in idx]
        outs = [out[i] for i in idx] if out is not None else []
        b1, b2 = self.betas
        if self.impl == "cpp":
            self._kernel(ps, gs, ms, vs, outs, wds, lr, b1, b2, self.eps, step, float(grad_scale))
        else:
            _torch_adamw(ps, gs, ms, vs, outs, wds, lr, b1, b2, self.eps, step, float(grad_scale))
        self.step_count = step

    @torch.no_grad()
    def step_views(self, ps: list[torch.Tensor], gs: list[torch.Tensor], ms: list[torch.Tensor],
                   vs: list[torch.Tensor], weight_decays: list[float], out: list[torch.Tensor] | None = None,
                   lr: float | None = None, grad_scale: float = 1.0) -> None:
        """One step over caller-chosen contiguous views of ``params`` and of the states (the same split
        for all four lists, e.g. a flat shard cut where the weight decay changes), so decay, unscale,
        clip and the copy into ``out`` run in the one pass of ``step``. Advances ``step_count``."""
        lr = self.lr if lr is None else float(lr)
        step = self.step_count + 1
        b1, b2 = self.betas
        outs = list(out) if out else []
        if self.impl == "cpp":
            self._kernel(ps, gs, ms, vs, outs, [float(w) for w in weight_decays], lr, b1, b2, self.eps, step,
                         float(grad_scale))
        else:
            _torch_adamw(ps, gs, ms, vs, outs, [float(w) for w in weight_decays], lr, b1, b2, self.eps, step,
                         float(grad_scale))
        self.step_count = step

    def state_dict(self) -> dict:
        """Hyper-parameters, the step counter and references (not copies) to the state tensors."""
        return {
            "step": self.step_count,
            "lr": self.lr,
            "betas": self.betas,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "exp_avg": list(self.exp_avg),
            "exp_avg_sq": list(self.exp_avg_sq),
        }

    def load_state_dict(self, sd: dict) -> None:
        """Copy ``sd``'s states into this optimizer's own buffers (which keep their identity)."""
        for key in ("exp_avg", "exp_avg_sq"):
            src, dst = sd[key], getattr(self, key)
            if len(src) != len(dst):
                raise ValueError(f"CPUAdamW.load_state_dict: {key} has {len(src)} tensors, expected {len(dst)}")
            for i, (s, d) in enumerate(zip(src, dst)):
                if s.shape != d.shape:
                    raise ValueError(f"CPUAdamW.load_state_dict: {key}[{i}] has shape {tuple(s.shape)}, "
                                     f"expected {tuple(d.shape)}")
        with torch.no_grad():
            for key in ("exp_avg", "exp_avg_sq"):
                for s, d in zip(sd[key], getattr(self, key)):
                    d.copy_(s)
        self.step_count = int(sd["step"])
        self.lr = float(sd.get("lr", self.lr))
        self.betas = tuple(float(b) for b in sd.get("betas", self.betas))
        self.eps = float(sd.get("eps", self.eps))
        self.weight_decay = float(sd.get("weight_decay", self.weight_decay))


_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _torch_adamw(ps, gs, ms, vs, outs, wds, lr, b1, b2, eps, step, grad_scale) -> None:
    """The pure-torch path: PyTorch's fused CPU AdamW kernel, one call per distinct weight decay."""
    for i, (p, g) in enumerate(zip(ps, gs)):
        if g.device.type != "cpu" or g.dtype not in _GRAD_DTYPES or g.numel() != p.numel():
            raise ValueError(f"CPUAdamW: grads[{i}] must be a float32/float16/bfloat16 CPU tensor with {p.numel()} "
                             f"elements, got {g.dtype} on {g.device} with {g.numel()}")
    gs = [g if g.dtype == torch.float32 else g.float() for g in gs]  # an fp32 copy (the kernel reads them as they are)
    for i, (o, p) in enumerate(zip(outs, ps)):
        if (o.dtype not in (torch.float16, torch.bfloat16, torch.float32) or o.device.type != "cpu"
                or o.numel() != p.numel() or o.data_ptr() == p.data_ptr()):
            raise ValueError(f"CPUAdamW: out[{i}] must be a float16/bfloat16/float32 CPU tensor with {p.numel()} "
                             "elements, other than the param itself")
    gs = [g.view_as(p) for g, p in zip(gs, ps)]
    steps = [torch.tensor(float(step))] * len(ps)  # only read by the kernel
    scale = torch.tensor(grad_scale) if grad_scale != 1.0 else None
    for wd in dict.fromkeys(wds):
        sel = [i for i, w in enumerate(wds) if w == wd]
        torch._fused_adamw_(
            [ps[i] for i in sel], [gs[i] for i in sel], [ms[i] for i in sel], [vs[i] for i in sel], [],
            [steps[i] for i in sel], lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps, amsgrad=False,
            maximize=False, grad_scale=scale, found_inf=None,
        )
    for o, p in zip(outs, ps):
        o.copy_(p.view_as(o))
