// TIDE CPU kernels: fused final-norm + router MLP scoring, and row gather / scatter for skip mode.
//
// Built on first use by tide_hf/kernels.py through torch.utils.cpp_extension.load (name "tide_hf_cpu").
// Numerics mirror the PyTorch reference in tide_hf/kernels.py: statistics and dot products accumulate in
// fp32; half / bfloat16 rounding happens exactly where HF's norm modules round.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

namespace {

// Norm kinds; values shared with NORM_KINDS in tide_hf/kernels.py.
constexpr int64_t kNormNone = 0;
constexpr int64_t kNormRms = 1;        // Llama: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)
constexpr int64_t kNormRmsGemma = 2;   // Gemma: (x * rsqrt(mean(x^2) + eps) * (1 + weight)).to(dtype)
constexpr int64_t kNormLayerNorm = 3;  // torch.nn.LayerNorm (biased variance)
constexpr int64_t kNormRmsFp32 = 4;    // OLMo-2 / GPT-OSS: (weight * x * rsqrt(mean(x^2) + eps)).to(dtype)

// From this many rows on, fc1 runs as one BLAS GEMM over the normalised rows (cache-blocked, so it wins once
// w1 is reused enough); below it, blocked dot products avoid the GEMM's setup cost. Measured crossover: 8-32.
constexpr int64_t kGemmMinRows = 8;
// Work per at::parallel_for chunk (multiply-adds or bytes): below this, threading costs more than it saves.
constexpr int64_t kGrainWork = 1 << 15;
// Independent partial sums per row, so the fp32 dot loops vectorise without -ffast-math.
constexpr int kLanes = 16;
// fc1 rows are dotted with this many normalised rows at once: each weight load feeds several FMAs.
constexpr int kRowBlock = 4;

#if defined(_MSC_VER)
#define TIDE_INLINE __forceinline
#else
#define TIDE_INLINE __attribute__((always_inline)) inline
#endif

inline float tree_sum(float* acc) {
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  }
  return acc[0];
}

// The hot loops are written once (always_inline) and instantiated below per instruction set.
// out[r] = dot(w, z[r]) for kRowBlock rows z[r] (pointers may repeat to pad a short block).
TIDE_INLINE void dot_rows_impl(const float* w, const float* const* z, int64_t n, float* out) {
  static_assert(kRowBlock == 4, "dot_rows unrolls four rows");
  float acc[kRowBlock][kLanes] = {};
  const float *z0 = z[0], *z1 = z[1], *z2 = z[2], *z3 = z[3];
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float wv = w[k + l];
      acc[0][l] += wv * z0[k + l];
      acc[1][l] += wv * z1[k + l];
      acc[2][l] += wv * z2[k + l];
      acc[3][l] += wv * z3[k + l];
    }
  }
  for (; k < n; ++k) {  // tail: lane 0 of each row
    for (int r = 0; r < kRowBlock; ++r) acc[r][0] += w[k] * z[r][k];
  }
  for (int r = 0; r < kRowBlock; ++r) out[r] = tree_sum(acc[r]);
}

TIDE_INLINE float dot_impl(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a[k + l] * b[k + l];
  }
  for (; k < n; ++k) acc[0] += a[k] * b[k];
  return tree_sum(acc);
}

TIDE_INLINE float sum_impl(const float* a, int64_t n) {
  float acc[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a[k + l];
  }
  for (; k < n; ++k) acc[0] += a[k];
  return tree_sum(acc);
}

// Round an fp32 value to scalar_t and back (identity for float): where HF casts to the model dtype.
template <typename scalar_t>
inline float round_to(float v) {
  return static_cast<float>(static_cast<scalar_t>(v));
}

struct NormArgs {
  int64_t kind;
  float eps;
  const float* weight;  // fp32 copy of the norm weight, or nullptr
  const float* bias;    // fp32 copy of the LayerNorm bias, or nullptr
  bool round_product;   // kind rms: weight * y is computed in the input dtype (HF type promotion)
};

// z = norm(x) in fp32 with the model's dtype rounding applied; z doubles as scratch for the fp32 row.
template <typename scalar_t>
TIDE_INLINE void normalize_row_impl(const scalar_t* x, int64_t H, const NormArgs& a, float* z) {
  for (int64_t k = 0; k < H; ++k) z[k] = static_cast<float>(x[k]);
  if (a.kind == kNormNone) return;
  const float inv_h = 1.f / static_cast<float>(H);
  if (a.kind == kNormLayerNorm) {
    const float mean = sum_impl(z, H) * inv_h;
    for (int64_t k = 0; k < H; ++k) z[k] -= mean;  // centred second pass: no cancellation for large means
    const float rstd = 1.f / std::sqrt(dot_impl(z, z, H) * inv_h + a.eps);
    for (int64_t k = 0; k < H; ++k) {
      float v = z[k] * rstd;
      if (a.weight) v *= a.weight[k];
      if (a.bias) v += a.bias[k];
      z[k] = round_to<scalar_t>(v);
    }
    return;
  }
  const float rstd = 1.f / std::sqrt(dot_impl(z, z, H) * inv_h + a.eps);
  if (a.kind == kNormRmsGemma) {
    for (int64_t k = 0; k < H; ++k) z[k] = round_to<scalar_t>(z[k] * rstd * (1.f + a.weight[k]));
  } else if (a.kind == kNormRmsFp32) {
    for (int64_t k = 0; k < H; ++k) z[k] = round_to<scalar_t>(z[k] * rstd * a.weight[k]);
  } else if (!a.weight) {  // kNormRms without a weight
    for (int64_t k = 0; k < H; ++k) z[k] = round_to<scalar_t>(z[k] * rstd);
  } else if (a.round_product) {  // kNormRms, weight in the input dtype: the product is rounded too
    for (int64_t k = 0; k < H; ++k) z[k] = round_to<scalar_t>(round_to<scalar_t>(z[k] * rstd) * a.weight[k]);
  } else {  // kNormRms, wider weight (e.g. fp32 weight on bf16 rows): fp32 product
    for (int64_t k = 0; k < H; ++k) z[k] = round_to<scalar_t>(z[k] * rstd) * a.weight[k];
  }
}

// Entry points per instruction set. x86-64 GCC / Clang also get AVX2+FMA and AVX-512 copies, picked by CPUID
// once, so the cached build stays portable (no -march=native) yet uses the wide units where they exist.
#define TIDE_ISA_FUNCTIONS(NAME, ATTR)                                                                       \
  ATTR void dot_rows_##NAME(const float* w, const float* const* z, int64_t n, float* out) {                  \
    dot_rows_impl(w, z, n, out);                                                                             \
  }                                                                                                          \
  ATTR float dot_##NAME(const float* a, const float* b, int64_t n) { return dot_impl(a, b, n); }             \
  template <typename scalar_t>                                                                               \
  ATTR void normalize_rows_##NAME(const scalar_t* x, int64_t rows, int64_t H, const NormArgs& a, float* z) { \
    for (int64_t i = 0; i < rows; ++i) normalize_row_impl<scalar_t>(x + i * H, H, a, z + i * H);             \
  }

TIDE_ISA_FUNCTIONS(base, )
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TIDE_X86_DISPATCH 1
TIDE_ISA_FUNCTIONS(avx2, __attribute__((target("avx2,fma"))))
TIDE_ISA_FUNCTIONS(avx512, __attribute__((target("avx512f,avx512vl,avx512bw,avx2,fma"))))
#endif

enum class Isa { kBase, kAvx2, kAvx512 };

Isa isa() {
  static const Isa chosen = [] {
#ifdef TIDE_X86_DISPATCH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return Isa::kAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
    return Isa::kBase;
  }();
  return chosen;
}

#ifdef TIDE_X86_DISPATCH
#define TIDE_ISA_CALL(FN, ...)                      \
  (isa() == Isa::kAvx512 ? FN##_avx512(__VA_ARGS__) \
   : isa() == Isa::kAvx2 ? FN##_avx2(__VA_ARGS__)   \
                         : FN##_base(__VA_ARGS__))
#else
#define TIDE_ISA_CALL(FN, ...) FN##_base(__VA_ARGS__)
#endif

at::Tensor as_f32(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

at::Tensor norm_router_scores(const at::Tensor& hidden, int64_t kind, const std::optional<at::Tensor>& weight,
                              const std::optional<at::Tensor>& bias, double eps, const at::Tensor& w1,
                              const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2) {
  TORCH_CHECK(hidden.device().is_cpu() && hidden.dim() == 2, "hidden must be a 2-D CPU tensor");
  TORCH_CHECK(kind >= kNormNone && kind <= kNormRmsFp32, "unknown norm kind ", kind);
  const int64_t N = hidden.size(0), H = hidden.size(1), B = w1.size(0);
  TORCH_CHECK(H > 0 && w1.dim() == 2 && w1.size(1) == H, "w1 must be (bottleneck, hidden)");
  TORCH_CHECK(b1.numel() == B && w2.numel() == B && b2.numel() == 1, "router bias / fc2 shapes do not match w1");
  TORCH_CHECK((kind != kNormRmsGemma && kind != kNormRmsFp32) || weight.has_value(), "this norm kind needs a weight");
  for (const at::Tensor* t : {&w1, &b1, &w2, &b2}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(), "router weights must be fp32 CPU tensors");
  }
  at::Tensor nw, nb;
  NormArgs args{kind, static_cast<float>(eps), nullptr, nullptr, false};
  if (weight.has_value() && kind != kNormNone) {
    TORCH_CHECK(weight->numel() == H && weight->device().is_cpu(), "norm weight must be (hidden,) on the CPU");
    args.round_product = at::promote_types(weight->scalar_type(), hidden.scalar_type()) == hidden.scalar_type();
    nw = as_f32(*weight);
    args.weight = nw.data_ptr<float>();
  }
  if (bias.has_value() && kind == kNormLayerNorm) {
    TORCH_CHECK(bias->numel() == H && bias->device().is_cpu(), "norm bias must be (hidden,) on the CPU");
    nb = as_f32(*bias);
    args.bias = nb.data_ptr<float>();
  }
  const at::Tensor x = hidden.contiguous(), w1c = w1.contiguous(), b1c = b1.contiguous(), w2c = w2.contiguous();
  at::Tensor z = at::empty({N, H}, hidden.options().dtype(at::kFloat));
  float* zp = z.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "tide_norm_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, N, std::max<int64_t>(1, kGrainWork / H), [&](int64_t lo, int64_t hi) {
      TIDE_ISA_CALL(normalize_rows, xp + lo * H, hi - lo, H, args, zp + lo * H);
    });
  });

  at::Tensor h;  // (N, B) fc1 pre-activations
  if (N >= kGemmMinRows) {
    h = at::addmm(b1c, z, w1c.t());
  } else {
    h = at::empty({N, B}, z.options());
    float* hp = h.data_ptr<float>();
    const float *w1p = w1c.data_ptr<float>(), *b1p = b1c.data_ptr<float>();
    const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
    at::parallel_for(0, blocks * B, std::max<int64_t>(1, kGrainWork / (H * kRowBlock)), [&](int64_t lo, int64_t hi) {
      for (int64_t p = lo; p < hi; ++p) {
        const int64_t i0 = (p / B) * kRowBlock, j = p % B, rows = std::min<int64_t>(kRowBlock, N - i0);
        if (rows == 1) {  // one row (a decode step of one sequence): one dot, the same sums as a block's row
          hp[i0 * B + j] = b1p[j] + TIDE_ISA_CALL(dot, w1p + j * H, zp + i0 * H, H);
          continue;
        }
        const float* z[kRowBlock];
        float d[kRowBlock];
        for (int64_t r = 0; r < kRowBlock; ++r) z[r] = zp + (i0 + std::min(r, rows - 1)) * H;
        TIDE_ISA_CALL(dot_rows, w1p + j * H, z, H, d);
        for (int64_t r = 0; r < rows; ++r) hp[(i0 + r) * B + j] = b1p[j] + d[r];
      }
    });
  }
  at::Tensor out = at::empty({N}, z.options());
  const float *hp = h.data_ptr<float>(), *w2p = w2c.data_ptr<float>();
  const float b2v = *b2.contiguous().data_ptr<float>();  // a plain read: item() would count as a host sync
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, kGrainWork / B), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      float logit = b2v;
      for (int64_t j = 0; j < B; ++j) {  // relu keeping NaN (like torch.relu): a broken state never scores high
        const float v = hp[i * B + j];
        logit += (v > 0.f || std::isnan(v) ? v : 0.f) * w2p[j];
      }
      op[i] = 1.f / (1.f + std::exp(-logit));
    }
  });
  return out;
}

// Row copies are dtype-agnostic byte copies (any dtype, incl. fp16 / bf16); the index is bounds-checked first.
void check_index(const at::Tensor& index, int64_t rows) {
  TORCH_CHECK(index.device().is_cpu() && index.dim() == 1 && index.scalar_type() == at::kLong,
              "index must be a 1-D int64 CPU tensor");
  const int64_t* ip = index.data_ptr<int64_t>();
  for (int64_t m = 0; m < index.numel(); ++m) {
    TORCH_CHECK_INDEX(ip[m] >= 0 && ip[m] < rows, "index ", ip[m], " is out of range for ", rows, " rows");
  }
}

void copy_rows(const char* src, char* dst, const int64_t* ip, int64_t M, int64_t row_bytes, bool gather) {
  at::parallel_for(0, M, std::max<int64_t>(1, kGrainWork / std::max<int64_t>(row_bytes, 1)),
                   [&](int64_t lo, int64_t hi) {
                     for (int64_t m = lo; m < hi; ++m) {
                       const int64_t s = gather ? ip[m] : m, d = gather ? m : ip[m];
                       std::memcpy(dst + d * row_bytes, src + s * row_bytes, row_bytes);
                     }
                   });
}

at::Tensor gather_rows(const at::Tensor& x, const at::Tensor& index) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1, "x must be a CPU tensor with a row dimension");
  const at::Tensor xc = x.contiguous(), idx = index.contiguous();
  check_index(idx, x.size(0));
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes[0] = idx.numel();
  at::Tensor out = at::empty(sizes, x.options());
  const int64_t row_bytes = x.size(0) ? xc.numel() / x.size(0) * xc.element_size() : 0;
  copy_rows(static_cast<const char*>(xc.data_ptr()), static_cast<char*>(out.data_ptr()), idx.data_ptr<int64_t>(),
            idx.numel(), row_bytes, true);
  return out;
}

at::Tensor scatter_rows_(at::Tensor dst, const at::Tensor& index, const at::Tensor& src) {
  TORCH_CHECK(dst.device().is_cpu() && dst.is_contiguous() && dst.dim() >= 1, "dst must be a contiguous CPU tensor");
  TORCH_CHECK(src.device().is_cpu(), "src must be a CPU tensor");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "src dtype ", src.scalar_type(), " != dst dtype ",
              dst.scalar_type());
  TORCH_CHECK(src.dim() == dst.dim() && src.size(0) == index.numel() && src.sizes().slice(1) == dst.sizes().slice(1),
              "src must be (len(index), *dst.shape[1:])");
  const at::Tensor sc = src.contiguous(), idx = index.contiguous();
  check_index(idx, dst.size(0));
  const int64_t row_bytes = dst.size(0) ? dst.numel() / dst.size(0) * dst.element_size() : 0;
  copy_rows(static_cast<const char*>(sc.data_ptr()), static_cast<char*>(dst.data_ptr()), idx.data_ptr<int64_t>(),
            idx.numel(), row_bytes, false);
  return dst;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("norm_router_scores", &norm_router_scores, "sigmoid(fc2(relu(fc1(norm(hidden))))) -> fp32 (N,)");
  m.def("gather_rows", &gather_rows, "x[index] for a row index");
  m.def("scatter_rows_", &scatter_rows_, "dst[index] = src in place");
}
