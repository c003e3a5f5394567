// Fused CPU backward of softmax(q kᵀ + T[j − i]) v (scale 1) for a learned Toeplitz table T.
//
// PyTorch's fused CPU flash backward returns dq, dk and dv but not the gradient of an additive
// bias, and the table's gradient is the anti-diagonal sum of dS = P ∘ (dP − D) (D_i = Σ dO_i·O_i):
//     ∂L/∂T[r] = Σ_b Σ_{j − i = r} dS_bij.
// This kernel computes, per (batch, head) and block of query rows, S = q kᵀ and dP = dO vᵀ
// (two GEMMs), then P = exp(S + T − lse) and dS in one vectorised pass over the block while it
// is in cache, adding each row of dS into the table gradient at the row's offset, then
// dq = dS k, dk += dSᵀ q, dv += Pᵀ dO (three GEMMs): the five GEMMs of a flash backward plus
// one elementwise pass, instead of about a dozen passes over [b, h, rows, n] tensors in memory.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <vector>

using at::Tensor;
using Vec = at::vec::Vectorized<float>;

namespace {

// One query row: p = exp(s + t − lse), ds = p (dp − D); s ← p, dp ← ds, g += ds over keys [0, m).
inline void row_pass(float* s, float* dp, const float* t, float* g, int64_t m, float lse, float D) {
  const Vec vl(lse), vD(D);
  int64_t j = 0;
  for (; j + Vec::size() <= m; j += Vec::size()) {
    Vec p = (Vec::loadu(s + j) + Vec::loadu(t + j) - vl).exp_u20();
    Vec ds = p * (Vec::loadu(dp + j) - vD);
    p.store(s + j);
    ds.store(dp + j);
    (Vec::loadu(g + j) + ds).store(g + j);
  }
  for (; j < m; ++j) {
    float p = std::exp(s[j] + t[j] - lse);
    float ds = p * (dp[j] - D);
    s[j] = p;
    dp[j] = ds;
    g[j] += ds;
  }
}

void check(const Tensor& x, const char* name, int64_t dim) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(x.dim() == dim, name, " must be a ", dim, "-d tensor");
}

}  // namespace

// q, k [B, H, n, d], v, out, dout [B, H, n, e], lse [B, H, n], table [Ht, 2n − 1] (Ht = 1 or H;
// bias(i, j) = table[j − i + n − 1]). Causal: query i sees keys j ≤ i.
// Returns dq, dk, dv and the table's gradient [Ht, 2n − 1] (summed over the batch).
std::vector<Tensor> toeplitz_backward(Tensor q, Tensor k, Tensor v, Tensor table, Tensor out, Tensor lse,
                                      Tensor dout, bool causal, int64_t block) {
  check(q, "q", 4); check(k, "k", 4); check(v, "v", 4); check(table, "table", 2);
  check(out, "out", 4); check(lse, "lse", 3); check(dout, "dout", 4);
  // detached: the worker threads below have their own (enabled) grad mode, and out= GEMMs refuse
  // inputs that require grad there
  q = q.detach().contiguous(); k = k.detach().contiguous(); v = v.detach().contiguous();
  table = table.detach().contiguous(); out = out.detach().contiguous(); lse = lse.detach().contiguous();
  dout = dout.detach().contiguous();
  const int64_t B = q.size(0), H = q.size(1), n = q.size(2), d = q.size(3), e = v.size(3);
  const int64_t Ht = table.size(0), L = 2 * n - 1;
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(2) == n && out.sizes() == v.sizes() && dout.sizes() == v.sizes(),
              "q, k, v, out, dout shapes disagree");
  TORCH_CHECK((Ht == 1 || Ht == H) && table.size(1) == L, "table must be [1 or H, 2n − 1]");
  TORCH_CHECK(block > 0, "block must be positive");
  block = std::min(block, n);

  const int64_t BH = B * H;
  Tensor q2 = q.view({BH, n, d}), k2 = k.view({BH, n, d}), v2 = v.view({BH, n, e}), do2 = dout.view({BH, n, e});
  Tensor dq = at::empty_like(q2), dk = at::zeros_like(k2), dv = at::zeros_like(v2);
  Tensor D = (dout * out).sum(-1).view({BH, n});
  Tensor lse2 = lse.view({BH, n});
  const int64_t threads = at::get_num_threads();
  Tensor g = at::zeros({threads, Ht, L}, q.options());
  const float* tp = table.data_ptr<float>();
  const float* Dp = D.data_ptr<float>();
  const float* lp = lse2.data_ptr<float>();

  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    at::NoGradGuard no_grad;
    Tensor s_buf = at::empty({block * n}, q.options()), dp_buf = at::empty({block * n}, q.options());
    float* gt = g[at::get_thread_num()].data_ptr<float>();
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t hh = Ht == 1 ? 0 : bh % H;
      const float* t = tp + hh * L;
      float* gh = gt + hh * L;
      Tensor qh = q2[bh], kh = k2[bh], vh = v2[bh], doh = do2[bh], dqh = dq[bh], dkh = dk[bh], dvh = dv[bh];
      for (int64_t i0 = 0; i0 < n; i0 += block) {
        const int64_t c = std::min(block, n - i0), m = causal ? i0 + c : n;  // keys [0, m) reach the block
        Tensor s = s_buf.narrow(0, 0, c * m).view({c, m}), dp = dp_buf.narrow(0, 0, c * m).view({c, m});
        Tensor qc = qh.narrow(0, i0, c), doc = doh.narrow(0, i0, c);
        at::mm_out(s, qc, kh.narrow(0, 0, m).t());
        at::mm_out(dp, doc, vh.narrow(0, 0, m).t());
        float* sp = s.data_ptr<float>();
        float* dpp = dp.data_ptr<float>();
        for (int64_t r = 0; r < c; ++r) {
          const int64_t i = i0 + r, seen = causal ? i + 1 : m;
          float* srow = sp + r * m;
          float* drow = dpp + r * m;
          row_pass(srow, drow, t + (n - 1 - i), gh + (n - 1 - i), seen, lp[bh * n + i], Dp[bh * n + i]);
          std::fill(srow + seen, srow + m, 0.f);
          std::fill(drow + seen, drow + m, 0.f);
        }
        Tensor dqc = dqh.narrow(0, i0, c);
        at::mm_out(dqc, dp, kh.narrow(0, 0, m));
        dkh.narrow(0, 0, m).addmm_(dp.t(), qc);
        dvh.narrow(0, 0, m).addmm_(s.t(), doc);
      }
    }
  });
  return {dq.view_as(q), dk.view_as(k), dv.view_as(v), g.sum(0)};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("toeplitz_backward", &toeplitz_backward,
        "dq, dk, dv and the table gradient of softmax(q kᵀ + T[j − i]) v (scale 1)");
}
