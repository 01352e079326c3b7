// Python bindings of the TIDE CUDA kernels (implemented in tide_cuda_kernels.cu); see tide_hf/kernels/build.py.
#include <torch/extension.h>

#include <optional>

namespace tide {
at::Tensor norm_router_scores_cuda(const at::Tensor& hidden, int64_t kind, const std::optional<at::Tensor>& weight,
                                   const std::optional<at::Tensor>& bias, double eps, const at::Tensor& w1,
                                   const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2);
at::Tensor norm_router_scores_path_cuda(const at::Tensor& hidden, int64_t kind, const std::optional<at::Tensor>& weight,
                                        const std::optional<at::Tensor>& bias, double eps, const at::Tensor& w1,
                                        const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2, int64_t path);
at::Tensor gather_rows_cuda(const at::Tensor& x, const at::Tensor& index);
at::Tensor scatter_rows_cuda_(at::Tensor dst, const at::Tensor& index, const at::Tensor& src);
}  // namespace tide

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("norm_router_scores", &tide::norm_router_scores_cuda, "sigmoid(fc2(relu(fc1(norm(hidden))))) -> fp32 (N,)");
  m.def("norm_router_scores_path", &tide::norm_router_scores_path_cuda,
        "norm_router_scores by a chosen route: 0 auto, 1 small (CUDA cores), 2 tensor cores, 3 cuBLAS");
  m.def("gather_rows", &tide::gather_rows_cuda, "x[index] for a row index");
  m.def("scatter_rows_", &tide::scatter_rows_cuda_, "dst[index] = src in place");
}
