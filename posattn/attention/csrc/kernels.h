// posattn's fused CPU kernels: the declarations module.cpp binds, and what both sources share.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <optional>
#include <vector>

using at::Tensor;
using Vec = at::vec::Vectorized<float>;

// biased_attention.cpp
std::vector<Tensor> biased_forward(Tensor q, Tensor k, Tensor v, std::optional<Tensor> table,
                                   std::optional<Tensor> qband, std::optional<Tensor> kband,
                                   std::optional<Tensor> lowrank, std::optional<Tensor> sided,
                                   std::optional<Tensor> keep, bool causal, int64_t block);
std::vector<Tensor> biased_backward(Tensor q, Tensor k, Tensor v, std::optional<Tensor> table,
                                    std::optional<Tensor> qband, std::optional<Tensor> kband,
                                    std::optional<Tensor> lowrank, std::optional<Tensor> sided,
                                    std::optional<Tensor> keep, Tensor out, Tensor lse, Tensor dout, bool causal,
                                    int64_t block);
// depthwise_conv.cpp
Tensor depthwise_forward(Tensor x, Tensor w, int64_t left);
std::vector<Tensor> depthwise_backward(Tensor g, Tensor x, Tensor w, int64_t left);
// dropout.cpp
Tensor hash_dropout(Tensor x, double p, int64_t seed);

// x must be a float32 CPU tensor with dim dimensions (the kernels' one input check).
inline void check(const Tensor& x, const char* name, int64_t dim) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(x.dim() == dim, name, " must be a ", dim, "-d tensor");
}
