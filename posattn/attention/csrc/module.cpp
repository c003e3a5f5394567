// The Python module of posattn's fused CPU kernels (posattn/attention/native.py builds it).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("biased_forward", &biased_forward, "out, lse of softmax(q kᵀ + bias) v (scale 1), padding keys hidden");
  m.def("biased_backward", &biased_backward, "dq, dk, dv and the bias inputs' gradients");
  m.def("depthwise_forward", &depthwise_forward, "depthwise 1-d convolution of x [B, n, C] by w [C, K]");
  m.def("depthwise_backward", &depthwise_backward, "its gradients (dx, dw)");
  m.def("hash_dropout", &hash_dropout, "x · keep / (1 − p), keep = hash(seed, i) ≥ p · 2³² (dropout.cpp)");
}
