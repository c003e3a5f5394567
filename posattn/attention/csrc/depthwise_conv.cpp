// Depthwise 1-d convolution along the sequence in the channels-last layout the layer already has:
//     y[b, t, c] = Σ_m w[c, m] · x[b, t + m − left, c]        (zero outside 0 ≤ t + m − left < n)
// (Chang et al.'s depthwise and depthwise-separable convolutions, CAT's filters). PyTorch's CPU
// path for this is a grouped Conv1d, which needs the channels-first layout: a transpose, a pad
// and a copy on each side of it, forward and backward. Here each output row is K vectorised
// multiply-adds of nearby input rows, in cache; the backward is the same convolution of the
// gradient with the flipped filter (∂x) and K dot products per channel (∂w).
#include "kernels.h"

#include <algorithm>

namespace {

// acc[c] += a[c] · b[c] over C channels
inline void fma_row(float* acc, const float* a, const float* b, int64_t C) {
  int64_t c = 0;
  for (; c + Vec::size() <= C; c += Vec::size())
    at::vec::fmadd(Vec::loadu(a + c), Vec::loadu(b + c), Vec::loadu(acc + c)).store(acc + c);
  for (; c < C; ++c) acc[c] += a[c] * b[c];
}

// y = conv(x, wt) with wt [K, C] (filter taps as rows), rows t of y from rows t + m − left of x.
Tensor convolve(const Tensor& x, const Tensor& wt, int64_t left) {
  const int64_t B = x.size(0), n = x.size(1), C = x.size(2), K = wt.size(0);
  Tensor y = at::zeros_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = wt.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, B * n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / n, t = bt % n;
      for (int64_t m = 0; m < K; ++m) {
        const int64_t s = t + m - left;
        if (s >= 0 && s < n) fma_row(yp + bt * C, wp + m * C, xp + (b * n + s) * C, C);
      }
    }
  });
  return y;
}

}  // namespace

// x [B, n, C], w [C, K]: y [B, n, C].
Tensor depthwise_forward(Tensor x, Tensor w, int64_t left) {
  check(x, "x", 3); check(w, "w", 2);
  TORCH_CHECK(w.size(0) == x.size(2) && left >= 0 && left < w.size(1), "w must be [C, K] with 0 <= left < K");
  at::NoGradGuard no_grad;
  return convolve(x.detach().contiguous(), w.detach().t().contiguous(), left);
}

// Gradients (∂x, ∂w) of depthwise_forward given the output's gradient g [B, n, C].
std::vector<Tensor> depthwise_backward(Tensor g, Tensor x, Tensor w, int64_t left) {
  check(g, "g", 3); check(x, "x", 3); check(w, "w", 2);
  at::NoGradGuard no_grad;
  g = g.detach().contiguous(); x = x.detach().contiguous();
  const int64_t B = x.size(0), n = x.size(1), C = x.size(2), K = w.size(1);
  Tensor gx = convolve(g, w.detach().flip({1}).t().contiguous(), K - 1 - left);
  const int64_t threads = at::get_num_threads();
  Tensor acc = at::zeros({threads, K, C}, x.options());
  const float* gp = g.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, B * n, 64, [&](int64_t begin, int64_t end) {
    at::NoGradGuard guard;
    float* a = acc[at::get_thread_num()].data_ptr<float>();
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / n, t = bt % n;
      for (int64_t m = 0; m < K; ++m) {
        const int64_t s = t + m - left;
        if (s >= 0 && s < n) fma_row(a + m * C, gp + bt * C, xp + (b * n + s) * C, C);
      }
    }
  });
  return {gx, acc.sum(0).t().contiguous()};
}
