// The Python module of posattn's fused CPU kernels (posattn/attention/native.py builds it).
#include <torch/extension.h>

#include <optional>
#include <vector>

using at::Tensor;

// biased_attention.cpp
std::vector<Tensor> biased_forward(Tensor q, Tensor k, Tensor v, std::optional<Tensor> table,
                                   std::optional<Tensor> qband, std::optional<Tensor> kband,
                                   std::optional<Tensor> keep, bool causal, int64_t block);
std::vector<Tensor> biased_backward(Tensor q, Tensor k, Tensor v, std::optional<Tensor> table,
                                    std::optional<Tensor> qband, std::optional<Tensor> kband,
                                    std::optional<Tensor> keep, Tensor out, Tensor lse, Tensor dout, bool causal,
                                    int64_t block);
// depthwise_conv.cpp
Tensor depthwise_forward(Tensor x, Tensor w, int64_t left);
std::vector<Tensor> depthwise_backward(Tensor g, Tensor x, Tensor w, int64_t left);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("biased_forward", &biased_forward, "out, lse of softmax(q kᵀ + bias) v (scale 1), padding keys hidden");
  m.def("biased_backward", &biased_backward, "dq, dk, dv and the bias inputs' gradients");
  m.def("depthwise_forward", &depthwise_forward, "depthwise 1-d convolution of x [B, n, C] by w [C, K]");
  m.def("depthwise_backward", &depthwise_backward, "its gradients (dx, dw)");
}
