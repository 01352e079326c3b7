// TIDE CUDA kernels: fused final-norm + router MLP scoring, and row gather / scatter for skip mode.
//
// Built on first use by tide_hf/kernels.py through torch.utils.cpp_extension.load (name "tide_hf_cuda",
// bindings in tide_cuda.cpp). Same numerics as cuda/tide_cpu.cpp and the PyTorch reference: fp32 statistics
// and dot products, half / bfloat16 rounding exactly where HF's norm modules round. Everything runs on the
// current PyTorch stream; outputs and scratch come from the caching allocator (at::empty), never cudaMalloc.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>

namespace tide {
namespace {

// Norm kinds; values shared with NORM_KINDS in tide_hf/kernels.py.
constexpr int kNormNone = 0;
constexpr int kNormRms = 1;        // Llama: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)
constexpr int kNormRmsGemma = 2;   // Gemma: (x * rsqrt(mean(x^2) + eps) * (1 + weight)).to(dtype)
constexpr int kNormLayerNorm = 3;  // torch.nn.LayerNorm (biased variance)
constexpr int kNormRmsFp32 = 4;    // OLMo-2 / GPT-OSS: (weight * x * rsqrt(mean(x^2) + eps)).to(dtype)

constexpr int kWarp = 32;
constexpr int kThreads = 256;  // per block: 8 warps, each warp owns whole bottleneck units (one dot each)
constexpr int kWarps = kThreads / kWarp;
// From this many rows on, normalise into an fp32 (N, H) buffer and run fc1 as one cuBLAS GEMM: a fused
// block per row re-reads all of w1 per row, the GEMM reads it once per tile.
constexpr int64_t kGemmMinRows = 64;
// Few rows: split each row's bottleneck units over blocks so about this many blocks per SM are busy.
constexpr int kBlocksPerSm = 2;
constexpr int kCopyThreads = 256;
constexpr int kCopyBlocksPerSm = 4;
constexpr int kDefaultSmemBytes = 48 * 1024;  // dynamic shared memory allowed without an opt-in

struct NormParams {
  int kind;
  float eps;
  bool round_product;   // kind rms: weight * y is computed in the input dtype (HF type promotion)
  const float* weight;  // fp32 norm weight or nullptr
  const float* bias;    // fp32 LayerNorm bias or nullptr
};

// Round an fp32 value to scalar_t and back (identity for float): where HF casts to the model dtype.
template <typename scalar_t>
__device__ __forceinline__ float round_to(float v) {
  return static_cast<float>(static_cast<scalar_t>(v));
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

// z[k] = norm(x)[k] in fp32 (z in shared or global memory). Each thread only revisits its own k, so callers
// need a __syncthreads() before other threads read z.
template <typename scalar_t>
__device__ void normalize_row(const scalar_t* __restrict__ x, int64_t H, const NormParams& p, float* z,
                              float* scratch) {
  float acc = 0.f;
  for (int64_t k = threadIdx.x; k < H; k += blockDim.x) {
    const float v = static_cast<float>(x[k]);
    z[k] = v;
    acc += p.kind == kNormLayerNorm ? v : v * v;
  }
  if (p.kind == kNormNone) return;
  const float inv_h = 1.f / static_cast<float>(H);
  if (p.kind == kNormLayerNorm) {
    const float mean = block_sum(acc, scratch) * inv_h;
    float sq = 0.f;  // second pass over centred values: no cancellation for large means
    for (int64_t k = threadIdx.x; k < H; k += blockDim.x) sq += (z[k] - mean) * (z[k] - mean);
    const float rstd = 1.f / sqrtf(block_sum(sq, scratch) * inv_h + p.eps);
    for (int64_t k = threadIdx.x; k < H; k += blockDim.x) {
      float v = (z[k] - mean) * rstd;
      if (p.weight) v *= p.weight[k];
      if (p.bias) v += p.bias[k];
      z[k] = round_to<scalar_t>(v);
    }
    return;
  }
  const float rstd = 1.f / sqrtf(block_sum(acc, scratch) * inv_h + p.eps);
  for (int64_t k = threadIdx.x; k < H; k += blockDim.x) {
    if (p.kind == kNormRmsGemma) {
      z[k] = round_to<scalar_t>(z[k] * rstd * (1.f + p.weight[k]));
    } else if (p.kind == kNormRmsFp32) {
      z[k] = round_to<scalar_t>(z[k] * rstd * p.weight[k]);
    } else if (p.kind == kNormRms) {
      float v = round_to<scalar_t>(z[k] * rstd);
      if (p.weight) {
        v *= p.weight[k];
        if (p.round_product) v = round_to<scalar_t>(v);
      }
      z[k] = v;
    }
  }
}

// Grid (N, splits): block (i, s) normalises row i into shared memory, then its warps take bottleneck units
// [s * units, (s + 1) * units) one dot product at a time. With one split it writes sigmoid(logit) to out[i];
// otherwise the partial logit sum_j relu(fc1_j) * w2_j to partial[i, s] for finalize_kernel.
template <typename scalar_t, bool kVec4>
__global__ void __launch_bounds__(kThreads)
    norm_router_fused_kernel(const scalar_t* __restrict__ x, int64_t H, NormParams p, const float* __restrict__ w1,
                             const float* __restrict__ b1, const float* __restrict__ w2, const float* __restrict__ b2,
                             int64_t B, int64_t units, float* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* z = reinterpret_cast<float*>(smem_raw);
  __shared__ float scratch[kWarps];
  const int64_t row = blockIdx.x;
  normalize_row<scalar_t>(x + row * H, H, p, z, scratch);
  __syncthreads();

  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t j_end = std::min<int64_t>(B, (blockIdx.y + 1) * units);
  float partial = 0.f;  // identical in all lanes of a warp (warp_sum broadcasts)
  for (int64_t j = blockIdx.y * units + warp; j < j_end; j += kWarps) {
    const float* wj = w1 + j * H;
    float acc = 0.f;
    if constexpr (kVec4) {  // H % 4 == 0 and w1 16-byte aligned: 128-bit loads
      const float4* w4 = reinterpret_cast<const float4*>(wj);
      const float4* z4 = reinterpret_cast<const float4*>(z);
      for (int64_t k = lane; k < H / 4; k += kWarp) {
        const float4 a = __ldg(w4 + k), b = z4[k];
        acc += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
      }
    } else {
      for (int64_t k = lane; k < H; k += kWarp) acc += __ldg(wj + k) * z[k];
    }
    partial += relu_keep_nan(warp_sum(acc) + b1[j]) * w2[j];
  }
  const float logit = block_sum(lane == 0 ? partial : 0.f, scratch);
  if (threadIdx.x == 0) {
    if (gridDim.y == 1) {
      out[row] = sigmoid(logit + b2[0]);
    } else {
      out[row * gridDim.y + blockIdx.y] = logit;
    }
  }
}

// scores[i] = sigmoid(b2 + sum_s partial[i, s]) (fixed order: deterministic, no atomics).
__global__ void finalize_kernel(const float* __restrict__ partial, int64_t N, int splits, const float* __restrict__ b2,
                                float* __restrict__ scores) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= N) return;
  float logit = b2[0];
  for (int s = 0; s < splits; ++s) logit += partial[i * splits + s];
  scores[i] = sigmoid(logit);
}

// One block per row: z[i] = norm(x[i]) in global fp32, for the GEMM route (many rows or a row too large for
// shared memory).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    norm_rows_kernel(const scalar_t* __restrict__ x, int64_t H, NormParams p, float* __restrict__ z) {
  __shared__ float scratch[kWarps];
  normalize_row<scalar_t>(x + blockIdx.x * H, H, p, z + blockIdx.x * H, scratch);
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

at::Tensor as_f32(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

void check_cuda(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), name, " must be on ", like.device());
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
    const int64_t blocks = std::min<int64_t>((M * row_vecs + kCopyThreads - 1) / kCopyThreads,
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

at::Tensor norm_router_scores_cuda(const at::Tensor& hidden, int64_t kind, const std::optional<at::Tensor>& weight,
                                   const std::optional<at::Tensor>& bias, double eps, const at::Tensor& w1,
                                   const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2) {
  TORCH_CHECK(hidden.is_cuda() && hidden.dim() == 2, "hidden must be a 2-D CUDA tensor");
  TORCH_CHECK(kind >= kNormNone && kind <= kNormRmsFp32, "unknown norm kind ", kind);
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
  NormParams p{static_cast<int>(kind), static_cast<float>(eps), false, nullptr, nullptr};
  if (weight.has_value() && kind != kNormNone) {
    check_cuda(*weight, hidden, "norm weight");
    TORCH_CHECK(weight->numel() == H, "norm weight must have hidden_size elements");
    p.round_product = at::promote_types(weight->scalar_type(), hidden.scalar_type()) == hidden.scalar_type();
    nw = as_f32(*weight);
    p.weight = nw.data_ptr<float>();
  }
  if (bias.has_value() && kind == kNormLayerNorm) {
    check_cuda(*bias, hidden, "norm bias");
    TORCH_CHECK(bias->numel() == H, "norm bias must have hidden_size elements");
    nb = as_f32(*bias);
    p.bias = nb.data_ptr<float>();
  }
  const at::Tensor x = hidden.contiguous(), w1c = w1.contiguous(), b1c = b1.contiguous();
  const at::Tensor w2c = w2.reshape({B}).contiguous(), b2c = b2.reshape({1}).contiguous();
  const auto f32 = hidden.options().dtype(at::kFloat);
  at::Tensor scores = at::empty({N}, f32);
  if (N == 0) return scores;

  const int64_t smem = H * static_cast<int64_t>(sizeof(float));
  const int64_t smem_limit = static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin) -
                             kWarps * static_cast<int64_t>(sizeof(float));
  const bool fused = N < kGemmMinRows && smem <= smem_limit;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "tide_norm_router_cuda", [&] {
    if (!fused) {
      at::Tensor z = at::empty({N, H}, f32);
      norm_rows_kernel<scalar_t><<<N, kThreads, 0, stream>>>(x.data_ptr<scalar_t>(), H, p, z.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      scores = at::addmm(b1c, z, w1c.t()).relu_().mv(w2c).add_(b2c).sigmoid_();  // cuBLAS, same stream
      return;
    }
    const int64_t max_splits = (B + kWarps - 1) / kWarps;  // at least one unit per warp
    const int64_t want = (static_cast<int64_t>(sm_count()) * kBlocksPerSm + N - 1) / N;
    const int64_t target = std::clamp<int64_t>(want, 1, max_splits);
    const int64_t units = (B + target - 1) / target;  // bottleneck units per block
    const int64_t splits = (B + units - 1) / units;
    at::Tensor partial = splits > 1 ? at::empty({N, splits}, f32) : scores;
    const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>(splits));
    const bool vec4 = H % 4 == 0 && reinterpret_cast<std::uintptr_t>(w1c.data_ptr()) % 16 == 0;
    auto kernel = vec4 ? norm_router_fused_kernel<scalar_t, true> : norm_router_fused_kernel<scalar_t, false>;
    if (smem > kDefaultSmemBytes) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    }
    kernel<<<grid, kThreads, smem, stream>>>(x.data_ptr<scalar_t>(), H, p, w1c.data_ptr<float>(), b1c.data_ptr<float>(),
                                             w2c.data_ptr<float>(), b2c.data_ptr<float>(), B, units,
                                             partial.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (splits > 1) {
      const int64_t blocks = (N + kThreads - 1) / kThreads;
      finalize_kernel<<<blocks, kThreads, 0, stream>>>(partial.data_ptr<float>(), N, static_cast<int>(splits),
                                                       b2c.data_ptr<float>(), scores.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return scores;
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
