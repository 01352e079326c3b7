// TIDE CUDA kernels: fused final-norm + router MLP scoring, and row gather / scatter for skip mode.
//
// Built on first use by tide_hf/kernels/build.py through torch.utils.cpp_extension.load (name "tide_hf_cuda",
// bindings in tide_cuda.cpp). Same numerics as cuda/tide_cpu.cpp and the PyTorch reference: fp32 statistics
// and dot products, half / bfloat16 rounding exactly where HF's norm modules round. Everything runs on the
// current PyTorch stream; outputs and scratch come from the caching allocator (at::empty), never cudaMalloc.
//
// Router scoring, scores = sigmoid(b2 + w2 . relu(b1 + w1 @ norm(x))), runs as up to three launches:
//   1. row_stats_kernel: one warp per row computes the norm statistics (mean, rstd) -> float2 per row;
//   2. a split kernel computes fc1 pre-activations over one slice of the hidden size (split K), normalising
//      the rows on the fly from (1): partial[s, i, j] = sum_{k in slice s} w1[j, k] * norm(x)[i, k];
//        - router_small_kernel (few rows, any dtype): CUDA cores, blocks split over bottleneck units and K,
//          so all SMs stream w1 once; with very few rows it computes (1) itself and (1) is not launched;
//        - router_tc_kernel (bf16 / fp16 rows): tensor cores (WMMA, fp32 accumulate) on 128-row tiles; the
//          normalised rows are exact in the input dtype, and fp32 w1 is split into hi + lo halves of that
//          dtype (two MMAs), so the products keep ~16 bits of w1 (relative error ~1e-5 against fp32);
//   3. finalize_kernel: one warp per row sums the splits in a fixed order, then b1, relu, w2, b2, sigmoid.
// No float atomics anywhere: results are bitwise reproducible. A NaN / inf row gives a NaN score.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>

namespace tide {
namespace {

// Norm kinds; values shared with NORM_KINDS in tide_hf/kernels/reference.py.
constexpr int kNormNone = 0;
constexpr int kNormRms = 1;        // Llama: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)
constexpr int kNormRmsGemma = 2;   // Gemma: (x * rsqrt(mean(x^2) + eps) * (1 + weight)).to(dtype)
constexpr int kNormLayerNorm = 3;  // torch.nn.LayerNorm (biased variance)
constexpr int kNormRmsFp32 = 4;    // OLMo-2 / GPT-OSS: (weight * x * rsqrt(mean(x^2) + eps)).to(dtype)

// Routes of norm_router_scores; values shared with ROUTER_PATHS in tide_hf/eval/kernels.py.
constexpr int64_t kPathAuto = 0;
constexpr int64_t kPathSmall = 1;   // CUDA cores, split over bottleneck units and hidden size
constexpr int64_t kPathTensor = 2;  // tensor cores (bf16 / fp16 rows)
constexpr int64_t kPathGemm = 3;    // normalised fp32 rows + cuBLAS (fp32 rows beyond the small route)

// Dtype tags of the norm weight / bias, read in their own dtype (no per-call conversion kernel).
constexpr int kParamF32 = 0;
constexpr int kParamF16 = 1;
constexpr int kParamBF16 = 2;

constexpr int kWarp = 32;
constexpr int kThreads = 256;  // per block: 8 warps
constexpr int kWarps = kThreads / kWarp;
constexpr int kVecBytes = 16;  // 128-bit loads

// Small route. Rows per register pass (each weight load feeds this many FMAs), the most rows it takes, the
// rows up to which auto picks it for bf16 / fp16 (tensor cores beyond), the rows up to which each block
// computes the statistics itself (one launch fewer; every block re-reads those rows from L2), the blocks per
// SM its split aims at (all SMs stream w1 once).
constexpr int kRowGroup = 16;
constexpr int64_t kSmallMaxRows = 64;
constexpr int64_t kSmallAutoRows = 16;
constexpr int64_t kFuseStatsRows = 4;
constexpr int64_t kSmallBlocksPerSm = 2;
// dynamic shared memory without an opt-in: 48 KiB less the kernel's static row statistics
constexpr int64_t kSmallSmemBytes = 48 * 1024 - kSmallMaxRows * static_cast<int64_t>(sizeof(float2));

// Tensor-core route: 128 rows x 128 bottleneck units per block (8 warps of 32 x 64), K staged 32 at a time
// through shared memory (rows padded by 8 elements against bank conflicts, as WMMA allows); the split over
// K aims at one block per SM (more splits only add partial sums to reduce).
constexpr int kTcM = 128;
constexpr int kTcN = 128;
constexpr int kTcK = 32;
constexpr int kTcLd = kTcK + 8;
constexpr int kWmma = 16;
constexpr int64_t kTcBlocksPerSm = 1;
constexpr int kTcMinBlocks = 2;  // resident blocks per SM the register budget allows (one hides the other's syncs)
constexpr float kHalfMax = 65504.f;  // largest finite fp16: a w1 entry beyond it cannot be split into fp16

// Gather / scatter: threads per block, and blocks per SM of the grid-stride copy.
constexpr int kCopyThreads = 256;
constexpr int kCopyBlocksPerSm = 4;

struct NormParams {
  int kind;
  float eps;
  bool round_product;  // kind rms: weight * y is computed in the input dtype (HF type promotion)
  const void* weight;  // norm weight (kParam* dtype) or nullptr
  const void* bias;    // LayerNorm bias (kParam* dtype) or nullptr
  int weight_dtype;
  int bias_dtype;
};

// Round an fp32 value to scalar_t and back (identity for float): where HF casts to the model dtype.
template <typename scalar_t>
__device__ __forceinline__ float round_to(float v) {
  return static_cast<float>(static_cast<scalar_t>(v));
}

__device__ __forceinline__ float load_param(const void* ptr, int dtype, int64_t k) {
  if (dtype == kParamF32) return static_cast<const float*>(ptr)[k];
  if (dtype == kParamF16) return __half2float(static_cast<const __half*>(ptr)[k]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(ptr)[k]);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum of `v` over the block, returned to every thread; `scratch` holds kWarps floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = warp_sum(v);
  __syncthreads();  // a previous block_sum may still be reading scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_sum(lane < kWarps ? scratch[lane] : 0.f);
}

__device__ __forceinline__ float sigmoid(float v) { return 1.f / (1.f + expf(-v)); }

// relu that keeps NaN (fmaxf(NaN, 0) is 0, which would turn a broken hidden state into a confident score),
// like torch.relu and the CPU kernel: a NaN / inf state must give a NaN score, never an exit.
__device__ __forceinline__ float relu_keep_nan(float v) { return (v > 0.f || isnan(v)) ? v : 0.f; }

// norm(x)[k] for one element, given the row's (mean, rstd). Separate roundings (no FMA contraction), as the
// reference computes each step as its own op.
template <typename scalar_t>
__device__ __forceinline__ float norm_elem(float v, int64_t k, const NormParams& p, float2 st) {
  if (p.kind == kNormNone) return v;
  if (p.kind == kNormLayerNorm) {
    float t = __fmul_rn(__fsub_rn(v, st.x), st.y);
    if (p.weight) t = __fmul_rn(t, load_param(p.weight, p.weight_dtype, k));
    if (p.bias) t = __fadd_rn(t, load_param(p.bias, p.bias_dtype, k));
    return round_to<scalar_t>(t);
  }
  if (p.kind == kNormRmsGemma) {
    return round_to<scalar_t>(__fmul_rn(__fmul_rn(v, st.y), __fadd_rn(1.f, load_param(p.weight, p.weight_dtype, k))));
  }
  if (p.kind == kNormRmsFp32) {
    return round_to<scalar_t>(__fmul_rn(__fmul_rn(v, st.y), load_param(p.weight, p.weight_dtype, k)));
  }
  float t = round_to<scalar_t>(__fmul_rn(v, st.y));  // kNormRms
  if (p.weight) {
    t = __fmul_rn(t, load_param(p.weight, p.weight_dtype, k));
    if (p.round_product) t = round_to<scalar_t>(t);
  }
  return t;
}

// Calls f(value) for every element of a row, lane-strided across one warp; kVec: 128-bit loads (the row
// pitch and base are 16-byte aligned).
template <typename scalar_t, bool kVec, typename F>
__device__ __forceinline__ void for_row(const scalar_t* __restrict__ x, int64_t H, int lane, F&& f) {
  if constexpr (kVec) {
    constexpr int kPer = kVecBytes / sizeof(scalar_t);
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
#pragma unroll 4
    for (int64_t c = lane; c < H / kPer; c += kWarp) {
      const uint4 u = __ldg(x4 + c);
      scalar_t e[kPer];
      memcpy(e, &u, sizeof(u));
#pragma unroll
      for (int t = 0; t < kPer; ++t) f(static_cast<float>(e[t]));
    }
  } else {
#pragma unroll 4
    for (int64_t k = lane; k < H; k += kWarp) f(static_cast<float>(x[k]));
  }
}

// (mean, rstd) of one row, computed by one warp (mean 0 for the RMS kinds, (0, 1) for no norm). LayerNorm
// takes a second pass over the centred values (no cancellation for large means; the row is in L1 by then).
template <typename scalar_t, bool kVec>
__device__ float2 row_stats_warp(const scalar_t* __restrict__ x, int64_t H, int kind, float eps, int lane) {
  if (kind == kNormNone) return make_float2(0.f, 1.f);
  const float inv_h = 1.f / static_cast<float>(H);
  float acc = 0.f;
  if (kind == kNormLayerNorm) {
    for_row<scalar_t, kVec>(x, H, lane, [&](float v) { acc += v; });
    const float mean = warp_sum(acc) * inv_h;
    float sq = 0.f;
    for_row<scalar_t, kVec>(x, H, lane, [&](float v) { sq += (v - mean) * (v - mean); });
    return make_float2(mean, 1.f / sqrtf(warp_sum(sq) * inv_h + eps));
  }
  for_row<scalar_t, kVec>(x, H, lane, [&](float v) { acc += v * v; });
  return make_float2(0.f, 1.f / sqrtf(warp_sum(acc) * inv_h + eps));
}

// stats[i] = (mean, rstd) of row i; one warp per row.
template <typename scalar_t, bool kVec>
__global__ void __launch_bounds__(kThreads)
    row_stats_kernel(const scalar_t* __restrict__ x, int64_t N, int64_t H, int kind, float eps,
                     float2* __restrict__ stats) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (row >= N) return;
  const float2 st = row_stats_warp<scalar_t, kVec>(x + row * H, H, kind, eps, lane);
  if (lane == 0) stats[row] = st;
}

// Grid (ceil(B / kWarps), splits). Block (g, s) normalises all N rows over its hidden slice
// [s * ks, (s + 1) * ks) into shared memory, then warp w dots bottleneck unit j = g * kWarps + w with each
// row: partial[s, i, j]. With stats == nullptr the block computes the rows' statistics itself.
template <typename scalar_t, bool kVec>
__global__ void __launch_bounds__(kThreads)
    router_small_kernel(const scalar_t* __restrict__ x, int64_t N, int64_t H, NormParams p,
                        const float2* __restrict__ stats, const float* __restrict__ w1, int64_t B, int64_t ks,
                        float* __restrict__ partial) {
  extern __shared__ __align__(16) float zs[];  // [N][len]
  __shared__ float2 row_stats[kSmallMaxRows];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t k_begin = blockIdx.y * ks, len = std::min<int64_t>(H, k_begin + ks) - k_begin;
  if (stats == nullptr) {
    for (int64_t i = warp; i < N; i += kWarps) {
      const float2 st = row_stats_warp<scalar_t, kVec>(x + i * H, H, p.kind, p.eps, lane);
      if (lane == 0) row_stats[i] = st;
    }
  } else {
    for (int64_t i = threadIdx.x; i < N; i += kThreads) row_stats[i] = stats[i];
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < N * len; e += kThreads) {
    const int64_t i = e / len, c = e - i * len;
    zs[e] = norm_elem<scalar_t>(static_cast<float>(x[i * H + k_begin + c]), k_begin + c, p, row_stats[i]);
  }
  __syncthreads();
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (j >= B) return;  // no block-wide sync below
  const float* __restrict__ wj = w1 + j * H + k_begin;
  for (int64_t i0 = 0; i0 < N; i0 += kRowGroup) {
    float acc[kRowGroup];
#pragma unroll
    for (int r = 0; r < kRowGroup; ++r) acc[r] = 0.f;
    const int rows = static_cast<int>(std::min<int64_t>(kRowGroup, N - i0));
    const float* z0 = zs + i0 * len;
    for (int64_t c = lane; c < len; c += kWarp) {
      const float w = __ldg(wj + c);
#pragma unroll
      for (int r = 0; r < kRowGroup; ++r) {
        if (r < rows) acc[r] += w * z0[r * len + c];
      }
    }
#pragma unroll
    for (int r = 0; r < kRowGroup; ++r) {
      if (r < rows) {  // warp-uniform
        const float s = warp_sum(acc[r]);
        if (lane == 0) partial[(blockIdx.y * N + i0 + r) * B + j] = s;
      }
    }
  }
}

// The tensor-core element type of a half-precision input dtype, and conversions.
template <typename scalar_t>
struct MmaOf;
template <>
struct MmaOf<c10::BFloat16> {
  using type = __nv_bfloat16;
  static constexpr bool kHalf = false;
  __device__ static type from(float v) { return __float2bfloat16_rn(v); }
  __device__ static float to(type v) { return __bfloat162float(v); }
};
template <>
struct MmaOf<c10::Half> {
  using type = __half;
  static constexpr bool kHalf = true;
  __device__ static type from(float v) { return __float2half_rn(v); }
  __device__ static float to(type v) { return __half2float(v); }
};

// Grid (ceil(N / kTcM), splits). Block (m, s): rows [m * kTcM, +kTcM) x all bottleneck units (<= kTcN) over
// the hidden slice [s * ks, (s + 1) * ks), staged kTcK columns at a time: the rows are normalised from their
// statistics into shared memory in the input dtype (exact: HF rounds z to that dtype), w1 is split into
// hi + lo in the same dtype, and each warp accumulates a 32 x 64 tile with two MMAs (hi, lo) per fragment.
// Two resident blocks per SM overlap one's loads with the other's MMAs. Writes partial[s, row, unit]
// (rows padded to n_pad; padding rows and units hold zeros or garbage that finalize_kernel never reads).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads, kTcMinBlocks)
    router_tc_kernel(const scalar_t* __restrict__ x, int64_t N, int64_t H, NormParams p,
                     const float2* __restrict__ stats, const float* __restrict__ w1, int64_t B, int64_t ks,
                     int64_t n_pad, float* __restrict__ partial) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  using namespace nvcuda;
  using Mma = MmaOf<scalar_t>;
  using T = typename Mma::type;
  constexpr int kPerA = kTcM * kTcK / kThreads;  // hidden elements per thread per stage
  constexpr int kPerB = kTcN * kTcK / kThreads;  // w1 elements per thread per stage
  constexpr int kWarpRows = kTcM / 4, kWarpCols = kTcN / 2;  // 8 warps as 4 x 2
  constexpr int kFragM = kWarpRows / kWmma, kFragN = kWarpCols / kWmma;
  __shared__ __align__(128) T sa[kTcM * kTcLd];
  __shared__ __align__(128) T sbh[kTcN * kTcLd];
  __shared__ __align__(128) T sbl[kTcN * kTcLd];
  __shared__ float2 row_stats[kTcM];
  const int warp = threadIdx.x / kWarp, wm = warp % 4, wn = warp / 4;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTcM;
  const int64_t k_begin = static_cast<int64_t>(blockIdx.y) * ks, k_end = std::min<int64_t>(H, k_begin + ks);
  for (int r = threadIdx.x; r < kTcM; r += kThreads) {  // read after the loop's first __syncthreads
    row_stats[r] = (stats != nullptr && row0 + r < N) ? stats[row0 + r] : make_float2(0.f, 1.f);
  }
  // Stage element t of this thread: row (or unit) warp + t * kWarps, column lane; a warp reads kTcK = 32
  // consecutive elements of one row, coalesced. The rows' loads are all issued before their stores, then w1's.
  static_assert(kTcK == kWarp, "a warp stages one row's kTcK columns");
  const int lane = threadIdx.x % kWarp;
  auto stage = [&](int64_t k0) {
    const int64_t k = k0 + lane;
    float v[kPerA > kPerB ? kPerA : kPerB];
#pragma unroll
    for (int t = 0; t < kPerA; ++t) {
      const int64_t row = row0 + warp + t * kWarps;
      v[t] = (row < N && k < k_end) ? static_cast<float>(x[row * H + k]) : 0.f;
    }
#pragma unroll
    for (int t = 0; t < kPerA; ++t) {
      const int r = warp + t * kWarps;
      const bool in = row0 + r < N && k < k_end;
      sa[r * kTcLd + lane] = Mma::from(in ? norm_elem<scalar_t>(v[t], k, p, row_stats[r]) : 0.f);
    }
#pragma unroll
    for (int t = 0; t < kPerB; ++t) {
      const int64_t n = warp + t * kWarps;
      v[t] = (n < B && k < k_end) ? __ldg(w1 + n * H + k) : 0.f;
    }
#pragma unroll
    for (int t = 0; t < kPerB; ++t) {
      const int n = warp + t * kWarps;
      T hi = Mma::from(v[t]);
      if (Mma::kHalf && !(fabsf(v[t]) <= kHalfMax)) hi = Mma::from(NAN);  // unsplittable: NaN, never a wrong score
      sbh[n * kTcLd + lane] = hi;
      sbl[n * kTcLd + lane] = Mma::from(v[t] - Mma::to(hi));
    }
  };

  wmma::fragment<wmma::accumulator, kWmma, kWmma, kWmma, float> acc[kFragM][kFragN];
#pragma unroll
  for (int mi = 0; mi < kFragM; ++mi) {
#pragma unroll
    for (int ni = 0; ni < kFragN; ++ni) wmma::fill_fragment(acc[mi][ni], 0.f);
  }
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kTcK) {
    __syncthreads();  // the previous stage's MMAs are done with shared memory
    stage(k0);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTcK; kk += kWmma) {
      wmma::fragment<wmma::matrix_a, kWmma, kWmma, kWmma, T, wmma::row_major> a[kFragM];
#pragma unroll
      for (int mi = 0; mi < kFragM; ++mi) {
        wmma::load_matrix_sync(a[mi], sa + (wm * kWarpRows + mi * kWmma) * kTcLd + kk, kTcLd);
      }
#pragma unroll
      for (int ni = 0; ni < kFragN; ++ni) {
        const int n0 = wn * kWarpCols + ni * kWmma;
        if (n0 >= B) continue;  // warp-uniform: units beyond the bottleneck
        wmma::fragment<wmma::matrix_b, kWmma, kWmma, kWmma, T, wmma::col_major> bh, bl;
        wmma::load_matrix_sync(bh, sbh + n0 * kTcLd + kk, kTcLd);
        wmma::load_matrix_sync(bl, sbl + n0 * kTcLd + kk, kTcLd);
#pragma unroll
        for (int mi = 0; mi < kFragM; ++mi) {
          wmma::mma_sync(acc[mi][ni], a[mi], bh, acc[mi][ni]);
          wmma::mma_sync(acc[mi][ni], a[mi], bl, acc[mi][ni]);
        }
      }
    }
  }
  float* out = partial + (static_cast<int64_t>(blockIdx.y) * n_pad + row0) * kTcN;
#pragma unroll
  for (int mi = 0; mi < kFragM; ++mi) {
#pragma unroll
    for (int ni = 0; ni < kFragN; ++ni) {
      wmma::store_matrix_sync(out + (wm * kWarpRows + mi * kWmma) * kTcN + wn * kWarpCols + ni * kWmma, acc[mi][ni],
                              kTcN, wmma::mem_row_major);
    }
  }
#else
  __trap();  // the host only picks this route on compute capability >= 8.0
#endif
}

// scores[i] = sigmoid(b2 + sum_j relu(b1[j] + sum_s partial[s, i, j]) * w2[j]); one warp per row, the splits
// summed in a fixed order (deterministic, no atomics).
__global__ void __launch_bounds__(kThreads)
    finalize_kernel(const float* __restrict__ partial, int64_t N, int64_t n_pad, int64_t ld, int64_t splits,
                    const float* __restrict__ b1, const float* __restrict__ w2, const float* __restrict__ b2,
                    int64_t B, float* __restrict__ scores) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (row >= N) return;
  float part = 0.f;
  for (int64_t j = lane; j < B; j += kWarp) {
    float h = 0.f;
#pragma unroll 8
    for (int64_t s = 0; s < splits; ++s) h += partial[(s * n_pad + row) * ld + j];
    part += relu_keep_nan(h + b1[j]) * w2[j];
  }
  const float logit = warp_sum(part);
  if (lane == 0) scores[row] = sigmoid(logit + b2[0]);
}

// One block per row: z[i] = norm(x[i]) in global fp32, for the cuBLAS route (fp32 rows beyond the small
// route, bottlenecks beyond kTcN, or an fp32 norm weight on half rows).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    norm_rows_kernel(const scalar_t* __restrict__ x, int64_t H, NormParams p, float* __restrict__ z) {
  __shared__ float scratch[kWarps];
  const scalar_t* xr = x + static_cast<int64_t>(blockIdx.x) * H;
  float* zr = z + static_cast<int64_t>(blockIdx.x) * H;
  float2 st = make_float2(0.f, 1.f);
  if (p.kind != kNormNone) {
    const float inv_h = 1.f / static_cast<float>(H);
    float acc = 0.f;
    for (int64_t k = threadIdx.x; k < H; k += kThreads) {
      const float v = static_cast<float>(xr[k]);
      acc += p.kind == kNormLayerNorm ? v : v * v;
    }
    const float s = block_sum(acc, scratch) * inv_h;
    if (p.kind == kNormLayerNorm) {
      float sq = 0.f;
      for (int64_t k = threadIdx.x; k < H; k += kThreads) {
        const float d = static_cast<float>(xr[k]) - s;
        sq += d * d;
      }
      st = make_float2(s, 1.f / sqrtf(block_sum(sq, scratch) * inv_h + p.eps));
    } else {
      st.y = 1.f / sqrtf(s + p.eps);
    }
  }
  for (int64_t k = threadIdx.x; k < H; k += kThreads) zr[k] = norm_elem<scalar_t>(static_cast<float>(xr[k]), k, p, st);
}

// dst row m <- src row index[m] (gather) or dst row index[m] <- src row m (scatter), in vec_t units.
template <typename vec_t>
__global__ void copy_rows_kernel(const vec_t* __restrict__ src, vec_t* __restrict__ dst,
                                 const int64_t* __restrict__ index, int64_t M, int64_t row_vecs, int64_t rows,
                                 bool gather) {
  const int64_t total = M * row_vecs, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total; t += stride) {
    const int64_t m = t / row_vecs, c = t - m * row_vecs, r = index[m];
    CUDA_KERNEL_ASSERT(r >= 0 && r < rows && "tide_hf: row index out of range");
    if (gather) {
      dst[m * row_vecs + c] = src[r * row_vecs + c];
    } else {
      dst[r * row_vecs + c] = src[m * row_vecs + c];
    }
  }
}

int sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_cuda(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), name, " must be on ", like.device());
}

bool aligned16(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % kVecBytes == 0; }

// A norm weight / bias the kernels read in its own dtype (fp32, fp16, bf16: no conversion kernel per call);
// any other dtype is converted to fp32 once here. `keep` owns the memory while the kernels run.
const void* param_ptr(const at::Tensor& t, at::Tensor& keep, int& dtype) {
  const at::ScalarType s = t.scalar_type();
  keep = (s == at::kFloat || s == at::kHalf || s == at::kBFloat16) ? t.contiguous() : t.to(at::kFloat).contiguous();
  dtype = keep.scalar_type() == at::kHalf ? kParamF16 : keep.scalar_type() == at::kBFloat16 ? kParamBF16 : kParamF32;
  return keep.data_ptr();
}

void copy_rows(const at::Tensor& src, at::Tensor& dst, const at::Tensor& index, int64_t row_bytes, int64_t rows,
               bool gather) {
  const int64_t M = index.numel();
  if (M == 0 || row_bytes == 0) return;
  // Alignment every access shares: both base pointers and the row pitch.
  const std::uintptr_t addr = reinterpret_cast<std::uintptr_t>(src.data_ptr()) |
                              reinterpret_cast<std::uintptr_t>(dst.data_ptr()) | static_cast<std::uintptr_t>(row_bytes);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  auto launch = [&](auto vec) {
    using vec_t = decltype(vec);
    const int64_t row_vecs = row_bytes / static_cast<int64_t>(sizeof(vec_t));
    const int64_t blocks = std::min<int64_t>(ceil_div(M * row_vecs, kCopyThreads),
                                             static_cast<int64_t>(sm_count()) * kCopyBlocksPerSm);
    copy_rows_kernel<vec_t><<<blocks, kCopyThreads, 0, stream>>>(static_cast<const vec_t*>(src.data_ptr()),
                                                                 static_cast<vec_t*>(dst.data_ptr()),
                                                                 index.data_ptr<int64_t>(), M, row_vecs, rows, gather);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (addr % 16 == 0) {  // widest access every row and both base pointers allow
    launch(uint4{});
  } else if (addr % 8 == 0) {
    launch(uint2{});
  } else if (addr % 4 == 0) {
    launch(uint32_t{});
  } else if (addr % 2 == 0) {
    launch(uint16_t{});
  } else {
    launch(uint8_t{});
  }
}

void check_index(const at::Tensor& index, const at::Tensor& like) {
  check_cuda(index, like, "index");
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong, "index must be a 1-D int64 tensor");
}

}  // namespace

// Router scores by a chosen route (kPath*): kPathAuto is what norm_router_scores runs; the others exist so
// the GPU check and benchmark can test and time every route (a route that cannot take the input raises).
at::Tensor norm_router_scores_path_cuda(const at::Tensor& hidden, int64_t kind, const std::optional<at::Tensor>& weight,
                                        const std::optional<at::Tensor>& bias, double eps, const at::Tensor& w1,
                                        const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2,
                                        int64_t path) {
  TORCH_CHECK(hidden.is_cuda() && hidden.dim() == 2, "hidden must be a 2-D CUDA tensor");
  TORCH_CHECK(kind >= kNormNone && kind <= kNormRmsFp32, "unknown norm kind ", kind);
  TORCH_CHECK(path >= kPathAuto && path <= kPathGemm, "unknown route ", path);
  const int64_t N = hidden.size(0), H = hidden.size(1), B = w1.size(0);
  TORCH_CHECK(H > 0 && w1.dim() == 2 && w1.size(1) == H, "w1 must be (bottleneck, hidden)");
  TORCH_CHECK(N <= std::numeric_limits<int32_t>::max(), "too many rows for one launch");
  TORCH_CHECK(b1.numel() == B && w2.numel() == B && b2.numel() == 1, "router bias / fc2 shapes do not match w1");
  TORCH_CHECK((kind != kNormRmsGemma && kind != kNormRmsFp32) || weight.has_value(), "this norm kind needs a weight");
  for (const at::Tensor* t : {&w1, &b1, &w2, &b2}) {
    check_cuda(*t, hidden, "router weights");
    TORCH_CHECK(t->scalar_type() == at::kFloat, "router weights must be fp32");
  }
  const c10::cuda::CUDAGuard guard(hidden.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  at::Tensor nw, nb;
  NormParams p{static_cast<int>(kind), static_cast<float>(eps), false, nullptr, nullptr, kParamF32, kParamF32};
  if (weight.has_value() && kind != kNormNone) {
    check_cuda(*weight, hidden, "norm weight");
    TORCH_CHECK(weight->numel() == H, "norm weight must have hidden_size elements");
    p.round_product = at::promote_types(weight->scalar_type(), hidden.scalar_type()) == hidden.scalar_type();
    p.weight = param_ptr(*weight, nw, p.weight_dtype);
  }
  if (bias.has_value() && kind == kNormLayerNorm) {
    check_cuda(*bias, hidden, "norm bias");
    TORCH_CHECK(bias->numel() == H, "norm bias must have hidden_size elements");
    p.bias = param_ptr(*bias, nb, p.bias_dtype);
  }
  const at::Tensor x = hidden.contiguous(), w1c = w1.contiguous(), b1c = b1.contiguous();
  const at::Tensor w2c = w2.reshape({B}).contiguous(), b2c = b2.reshape({1}).contiguous();
  const auto f32 = hidden.options().dtype(at::kFloat);
  at::Tensor scores = at::empty({N}, f32);
  if (N == 0) return scores;

  const bool half_rows = x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
  // Tensor cores take z in the input dtype: exact unless an fp32 weight scales rounded rows (kind rms).
  const bool z_exact = !(kind == kNormRms && p.weight != nullptr && !p.round_product);
  const bool tc_ok = half_rows && z_exact && B <= kTcN && at::cuda::getCurrentDeviceProperties()->major >= 8;
  const bool small_ok = N <= kSmallMaxRows;
  int64_t route = path;
  if (route == kPathAuto) {
    route = small_ok && (N <= kSmallAutoRows || !tc_ok) ? kPathSmall : tc_ok ? kPathTensor : kPathGemm;
  }
  // A forced route that cannot take the input answers with no scores (the caller raises in Python): an exception
  // thrown across the extension boundary has crashed the interpreter with torch 2.11.
  if ((route == kPathSmall && !small_ok) || (route == kPathTensor && !tc_ok)) return at::empty({0}, f32);
  const bool vec = (H * static_cast<int64_t>(x.element_size())) % kVecBytes == 0 && aligned16(x.data_ptr());
  const float* w1p = w1c.data_ptr<float>();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "tide_norm_router_cuda", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    if (route == kPathGemm) {
      at::Tensor z = at::empty({N, H}, f32);
      norm_rows_kernel<scalar_t><<<N, kThreads, 0, stream>>>(xp, H, p, z.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      scores = at::addmm(b1c, z, w1c.t()).relu_().mv(w2c).add_(b2c).sigmoid_();  // cuBLAS, same stream
      return;
    }
    int64_t splits = 0, ks = 0, n_pad = N, ld = B, blocks_x = 0;
    bool want_stats = kind != kNormNone;
    if (route == kPathSmall) {
      blocks_x = ceil_div(B, kWarps);
      const int64_t want = std::clamp<int64_t>(ceil_div(sm_count() * kSmallBlocksPerSm, blocks_x), 1, H);
      ks = std::min<int64_t>(ceil_div(H, want), kSmallSmemBytes / (N * static_cast<int64_t>(sizeof(float))));
      want_stats = want_stats && N > kFuseStatsRows;
    } else {
      blocks_x = ceil_div(N, kTcM);
      n_pad = blocks_x * kTcM;
      ld = kTcN;
      const int64_t want = std::clamp<int64_t>(ceil_div(sm_count() * kTcBlocksPerSm, blocks_x), 1, ceil_div(H, kTcK));
      ks = ceil_div(ceil_div(H, want), kTcK) * kTcK;
    }
    splits = ceil_div(H, ks);
    TORCH_CHECK(splits <= std::numeric_limits<uint16_t>::max(), "hidden size too large for one launch");
    // One workspace: partial fc1 sums [splits, n_pad, ld], then the row statistics (float2, 8-byte aligned).
    constexpr int64_t kAlignFloats = 64;
    const int64_t partial_floats = ceil_div(splits * n_pad * ld, kAlignFloats) * kAlignFloats;
    at::Tensor work = at::empty({partial_floats + (want_stats ? 2 * N : 0)}, f32);
    float* partial = work.data_ptr<float>();
    float2* stats = want_stats ? reinterpret_cast<float2*>(partial + partial_floats) : nullptr;
    if (want_stats) {
      auto kernel = vec ? row_stats_kernel<scalar_t, true> : row_stats_kernel<scalar_t, false>;
      kernel<<<ceil_div(N, kWarps), kThreads, 0, stream>>>(xp, N, H, p.kind, p.eps, stats);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(splits));
    if (route == kPathSmall) {
      const size_t smem = static_cast<size_t>(N * ks) * sizeof(float);  // <= kSmallSmemBytes: no opt-in needed
      auto kernel = vec ? router_small_kernel<scalar_t, true> : router_small_kernel<scalar_t, false>;
      kernel<<<grid, kThreads, smem, stream>>>(xp, N, H, p, stats, w1p, B, ks, partial);
    } else {
      if constexpr (std::is_same_v<scalar_t, at::Half> || std::is_same_v<scalar_t, at::BFloat16>) {
        router_tc_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(xp, N, H, p, stats, w1p, B, ks, n_pad, partial);
      } else {
        TORCH_CHECK(false, "unreachable: ", x.scalar_type(), " rows on the tensor-core route");
      }
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    finalize_kernel<<<ceil_div(N, kWarps), kThreads, 0, stream>>>(partial, N, n_pad, ld, splits, b1c.data_ptr<float>(),
                                                                 w2c.data_ptr<float>(), b2c.data_ptr<float>(), B,
                                                                 scores.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return scores;
}

at::Tensor norm_router_scores_cuda(const at::Tensor& hidden, int64_t kind, const std::optional<at::Tensor>& weight,
                                   const std::optional<at::Tensor>& bias, double eps, const at::Tensor& w1,
                                   const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2) {
  return norm_router_scores_path_cuda(hidden, kind, weight, bias, eps, w1, b1, w2, b2, kPathAuto);
}

at::Tensor gather_rows_cuda(const at::Tensor& x, const at::Tensor& index) {
  TORCH_CHECK(x.is_cuda() && x.dim() >= 1, "x must be a CUDA tensor with a row dimension");
  check_index(index, x);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), idx = index.contiguous();
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes[0] = idx.numel();
  at::Tensor out = at::empty(sizes, x.options());
  const int64_t row_bytes = x.size(0) ? xc.numel() / x.size(0) * xc.element_size() : 0;
  copy_rows(xc, out, idx, row_bytes, x.size(0), /*gather=*/true);
  return out;
}

at::Tensor scatter_rows_cuda_(at::Tensor dst, const at::Tensor& index, const at::Tensor& src) {
  TORCH_CHECK(dst.is_cuda() && dst.is_contiguous() && dst.dim() >= 1, "dst must be a contiguous CUDA tensor");
  check_cuda(src, dst, "src");
  check_index(index, dst);
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "src dtype ", src.scalar_type(), " != dst dtype ",
              dst.scalar_type());
  TORCH_CHECK(src.dim() == dst.dim() && src.size(0) == index.numel() && src.sizes().slice(1) == dst.sizes().slice(1),
              "src must be (len(index), *dst.shape[1:])");
  const c10::cuda::CUDAGuard guard(dst.device());
  const at::Tensor sc = src.contiguous(), idx = index.contiguous();
  const int64_t row_bytes = dst.size(0) ? dst.numel() / dst.size(0) * dst.element_size() : 0;
  copy_rows(sc, dst, idx, row_bytes, dst.size(0), /*gather=*/false);
  return dst;
}

}  // namespace tide
