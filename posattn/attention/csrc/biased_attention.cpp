// Fused CPU attention with a relative-position bias: softmax(q kᵀ + B) v (scale 1), forward and
// backward, where B sums any of
//   a Toeplitz table      B_ij = T[j − i]                           (table [H|1, 2n − 1])
//   a query-side band     B_ij = Q_i[clip(j − i, −w, w) + w]        (qband [B, H, n, 2w + 1])
//   a key-side band       B_ij = K_j[clip(i − j, −v, v) + v]        (kband [B, H, n, 2v + 1])
//   a low-rank product    B_ij = Σ_r U_ir V_jr                      (lowrank [2, B, H, n, r]: U, V)
//   a two-sided sum       B_ij = a_i + x_j (j ≤ i), b_i + y_j (j > i) (sided [4, B, H, n]: a, x, b, y)
// and hides padding keys (keep [B, n]: key j of row b is seen where keep[b, j], and each query
// always sees itself, as posattn.attention.masking.allowed_mask defines it).
// (learned tables: T5, TISA, DIET-REL, fixed convolutions; clipped relative terms q·W[·] and
// k·W[·]: dynamic / composite / key-dynamic convolutions, Shaw et al.; low-rank: segment
// embeddings, causal ALiBi, DIET-ABS / TUPE's P_Q P_Kᵀ; two-sided: an encoder's forget gates).
//
// PyTorch's fused CPU kernels take a bias only as a materialised [b, h, n, n] tensor and never
// return its gradient. Here, per (batch, head) and block of query rows, S = q kᵀ (one GEMM) gets
// the bias added row by row from the small inputs while the block is in cache (a low-rank
// product as one more GEMM into the block, S += U Vᵀ, instead of widening q and k); the backward
// recomputes it, forms dS = P ∘ (dP − D) (dP = dO vᵀ, one GEMM; D_i = Σ dO_i·O_i) and reduces dS
// into the inputs' gradients in the same pass (table: anti-diagonal sums over the batch; bands:
// the window, plus the row / column sums of the clipped tails; dU = dS V, dV += dSᵀ U; two-sided:
// the row and column sums of dS on each side of the diagonal), then
// dq = dS k, dk += dSᵀ q, dv += Pᵀ dO (three GEMMs). No n×n tensor is ever in memory.
#include "kernels.h"

#include <algorithm>
#include <limits>

namespace {

// x[j] += a[j] over [0, m)
inline void add(float* x, const float* a, int64_t m) {
  int64_t j = 0;
  for (; j + Vec::size() <= m; j += Vec::size()) (Vec::loadu(x + j) + Vec::loadu(a + j)).store(x + j);
  for (; j < m; ++j) x[j] += a[j];
}

inline void add_scalar(float* x, float a, int64_t m) {
  const Vec va(a);
  int64_t j = 0;
  for (; j + Vec::size() <= m; j += Vec::size()) (Vec::loadu(x + j) + va).store(x + j);
  for (; j < m; ++j) x[j] += a;
}

inline float sum(const float* x, int64_t m) {
  Vec acc(0.f);
  int64_t j = 0;
  for (; j + Vec::size() <= m; j += Vec::size()) acc = acc + Vec::loadu(x + j);
  float out = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; j < m; ++j) out += x[j];
  return out;
}

inline float max_of(const float* x, int64_t m) {
  Vec acc(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + Vec::size() <= m; j += Vec::size()) acc = at::vec::maximum(acc, Vec::loadu(x + j));
  float out = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, acc);
  for (; j < m; ++j) out = std::max(out, x[j]);
  return out;
}

// The bias inputs of one (batch, head); a null pointer is an absent term.
struct Bias {
  int64_t n = 0;
  const float* table = nullptr;  // [2n − 1], T[r] at r + n − 1
  const float* qband = nullptr;  // [n, 2wq + 1]
  int64_t wq = 0;
  const float* kband = nullptr;  // transposed: [2wk + 1, n], K_j[r] at (r + wk)·n + j
  int64_t wk = 0;
  const float* sided = nullptr;  // [4, n]: a, x, b, y of the two-sided term, each [n]
  const float* hide = nullptr;   // [n]: 0 for a real key, −inf for padding
};

// Their gradients, laid out like the inputs.
struct Grad {
  float* table = nullptr;
  float* qband = nullptr;
  float* kband = nullptr;
  float* sided = nullptr;
};

// s[j] += B_ij over keys [0, m).
inline void add_bias(float* s, int64_t i, int64_t m, const Bias& b) {
  const int64_t n = b.n;
  if (b.table) add(s, b.table + (n - 1 - i), m);
  if (b.qband) {
    const float* row = b.qband + i * (2 * b.wq + 1);
    const int64_t lo = std::clamp(i - b.wq, int64_t(0), m), hi = std::clamp(i + b.wq + 1, lo, m);
    add_scalar(s, row[0], lo);
    add(s + lo, row + (lo - i + b.wq), hi - lo);                          // Q_i[j − i] in the window
    add_scalar(s + hi, row[2 * b.wq], m - hi);
  }
  if (b.kband) {
    const int64_t lo = std::clamp(i - b.wk, int64_t(0), m), hi = std::clamp(i + b.wk + 1, lo, m);
    add(s, b.kband + 2 * b.wk * n, lo);                                   // i − j > wk: K_j[wk]
    for (int64_t j = lo; j < hi; ++j) s[j] += b.kband[(i - j + b.wk) * n + j];
    add(s + hi, b.kband + hi, m - hi);                                    // i − j < −wk: K_j[−wk]
  }
  if (b.sided) {  // keys j ≤ i: a_i + x_j; keys j > i: b_i + y_j
    const float *a = b.sided, *x = b.sided + n, *bb = b.sided + 2 * n, *y = b.sided + 3 * n;
    const int64_t lo = std::min(i + 1, m);
    add(s, x, lo);
    add_scalar(s, a[i], lo);
    add(s + lo, y + lo, m - lo);
    add_scalar(s + lo, bb[i], m - lo);
  }
  if (b.hide) {  // padding keys out, the query's own key kept
    const float own = s[i];
    add(s, b.hide, m);
    s[i] = own;
  }
}

// The transpose of add_bias: gradients += dS_ij over keys [0, m).
inline void grad_bias(const float* ds, int64_t i, int64_t m, const Bias& b, const Grad& g) {
  const int64_t n = b.n;
  if (g.table) add(g.table + (n - 1 - i), ds, m);
  if (g.qband) {
    float* row = g.qband + i * (2 * b.wq + 1);
    const int64_t lo = std::clamp(i - b.wq, int64_t(0), m), hi = std::clamp(i + b.wq + 1, lo, m);
    row[0] += sum(ds, lo);
    add(row + (lo - i + b.wq), ds + lo, hi - lo);
    row[2 * b.wq] += sum(ds + hi, m - hi);
  }
  if (g.kband) {
    const int64_t lo = std::clamp(i - b.wk, int64_t(0), m), hi = std::clamp(i + b.wk + 1, lo, m);
    add(g.kband + 2 * b.wk * n, ds, lo);
    for (int64_t j = lo; j < hi; ++j) g.kband[(i - j + b.wk) * n + j] += ds[j];
    add(g.kband + hi, ds + hi, m - hi);
  }
  if (g.sided) {
    const int64_t lo = std::min(i + 1, m);
    g.sided[i] += sum(ds, lo);
    add(g.sided + n, ds, lo);
    g.sided[2 * n + i] += sum(ds + lo, m - lo);
    add(g.sided + 3 * n + lo, ds + lo, m - lo);
  }
}

// Detached (the worker threads run with grad mode on, where out= GEMMs refuse inputs that
// require grad) and contiguous.
Tensor plain(const Tensor& x) { return x.detach().contiguous(); }

// The [n, d] matrix of one (batch, head) of x [B, H, n, d], strided as it is: the GEMMs read
// the heads of a [B, n, H, d] projection in place, with no copy.
Tensor head(const Tensor& x, int64_t bh, int64_t H) { return x.select(0, bh / H).select(0, bh % H); }

// Checked bias inputs of one call, in the layouts the kernels read.
struct Inputs {
  int64_t B, H, n, Ht = 0;
  Tensor table, qband, kband, sided, hide;  // undefined when absent; kband transposed to [B·H, 2wk + 1, n],
                                            // sided to [B·H, 4, n]
  Tensor low_u, low_v;               // the low-rank factors [B·H, n, r], undefined when absent
  int64_t wq = 0, wk = 0;

  Inputs(const Tensor& q, const std::optional<Tensor>& t, const std::optional<Tensor>& qb,
         const std::optional<Tensor>& kb, const std::optional<Tensor>& lr, const std::optional<Tensor>& sd,
         const std::optional<Tensor>& keep)
      : B(q.size(0)), H(q.size(1)), n(q.size(2)) {
    if (keep) {
      TORCH_CHECK(keep->scalar_type() == at::kBool && keep->dim() == 2 && keep->size(0) == B && keep->size(1) == n,
                  "keep must be a bool [B, n] tensor");
      hide = at::zeros({B, n}, q.options()).masked_fill_(keep->logical_not(), -std::numeric_limits<float>::infinity()).contiguous();
    }
    if (t) {
      check(*t, "table", 2);
      Ht = t->size(0);
      TORCH_CHECK((Ht == 1 || Ht == H) && t->size(1) == 2 * n - 1, "table must be [1 or H, 2n − 1]");
      table = plain(*t);
    }
    if (qb) {
      check(*qb, "qband", 4);
      TORCH_CHECK(qb->size(0) == B && qb->size(1) == H && qb->size(2) == n && qb->size(3) % 2 == 1,
                  "qband must be [B, H, n, 2w + 1]");
      wq = qb->size(3) / 2;
      qband = plain(*qb).view({B * H, n, 2 * wq + 1});
    }
    if (kb) {
      check(*kb, "kband", 4);
      TORCH_CHECK(kb->size(0) == B && kb->size(1) == H && kb->size(2) == n && kb->size(3) % 2 == 1,
                  "kband must be [B, H, n, 2w + 1]");
      wk = kb->size(3) / 2;
      kband = kb->detach().reshape({B * H, n, 2 * wk + 1}).transpose(1, 2).contiguous();
    }
    if (lr) {
      check(*lr, "lowrank", 5);
      TORCH_CHECK(lr->size(0) == 2 && lr->size(1) == B && lr->size(2) == H && lr->size(3) == n,
                  "lowrank must be [2, B, H, n, r]");
      const Tensor f = plain(*lr).view({2, B * H, n, lr->size(4)});
      low_u = f[0];
      low_v = f[1];
    }
    if (sd) {
      check(*sd, "sided", 4);
      TORCH_CHECK(sd->size(0) == 4 && sd->size(1) == B && sd->size(2) == H && sd->size(3) == n,
                  "sided must be [4, B, H, n]");
      sided = sd->detach().reshape({4, B * H, n}).transpose(0, 1).contiguous();
    }
  }

  // S[c, m] += U[i0 : i0 + c] V[0 : m]ᵀ for (batch, head) bh: the low-rank part of the bias.
  void add_low_rank(Tensor& s, int64_t bh, int64_t i0, int64_t c, int64_t m) const {
    if (low_u.defined()) s.addmm_(low_u[bh].narrow(0, i0, c), low_v[bh].narrow(0, 0, m).t());
  }

  Bias at(int64_t bh) const {
    Bias b;
    b.n = n;
    if (table.defined()) b.table = table.data_ptr<float>() + (Ht == 1 ? 0 : bh % H) * (2 * n - 1);
    if (qband.defined()) { b.qband = qband.data_ptr<float>() + bh * n * (2 * wq + 1); b.wq = wq; }
    if (kband.defined()) { b.kband = kband.data_ptr<float>() + bh * n * (2 * wk + 1); b.wk = wk; }
    if (sided.defined()) b.sided = sided.data_ptr<float>() + bh * 4 * n;
    if (hide.defined()) b.hide = hide.data_ptr<float>() + (bh / H) * n;
    return b;
  }
};

}  // namespace

// q, k [B, H, n, d], v [B, H, n, e]; causal: query i sees keys j ≤ i.
// Returns out [B, H, n, e] and the log-sum-exp of each row [B, H, n].
std::vector<Tensor> biased_forward(Tensor q, Tensor k, Tensor v, std::optional<Tensor> table,
                                   std::optional<Tensor> qband, std::optional<Tensor> kband,
                                   std::optional<Tensor> lowrank, std::optional<Tensor> sided,
                                   std::optional<Tensor> keep, bool causal, int64_t block) {
  check(q, "q", 4); check(k, "k", 4); check(v, "v", 4);
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == q.size(0) && v.size(1) == q.size(1) && v.size(2) == q.size(2),
              "q, k, v shapes disagree");
  TORCH_CHECK(block > 0, "block must be positive");
  const Inputs in(q, table, qband, kband, lowrank, sided, keep);
  const int64_t B = in.B, H = in.H, n = in.n, e = v.size(3), BH = B * H;
  block = std::min(block, n);
  q = q.detach(); k = k.detach(); v = v.detach();
  Tensor out = at::empty({BH, n, e}, q.options()), lse = at::empty({BH, n}, q.options());
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    at::NoGradGuard no_grad;
    Tensor s_buf = at::empty({block * n}, q.options());
    std::vector<float> inv(block);  // 1 / Σ_j p_ij of the block's rows
    for (int64_t bh = begin; bh < end; ++bh) {
      const Bias bias = in.at(bh);
      Tensor qh = head(q, bh, H), kh = head(k, bh, H), vh = head(v, bh, H), oh = out[bh];
      for (int64_t i0 = 0; i0 < n; i0 += block) {
        const int64_t c = std::min(block, n - i0), m = causal ? i0 + c : n;
        Tensor s = s_buf.narrow(0, 0, c * m).view({c, m});
        at::mm_out(s, qh.narrow(0, i0, c), kh.narrow(0, 0, m).t());
        in.add_low_rank(s, bh, i0, c, m);
        float* sp = s.data_ptr<float>();
        for (int64_t r = 0; r < c; ++r) {
          const int64_t i = i0 + r, seen = causal ? i + 1 : m;
          float* row = sp + r * m;
          add_bias(row, i, seen, bias);
          const float mx = max_of(row, seen);
          const Vec vmx(mx);
          Vec acc(0.f);
          int64_t j = 0;
          for (; j + Vec::size() <= seen; j += Vec::size()) {  // p = exp(s − max), unnormalised, summed
            Vec p = (Vec::loadu(row + j) - vmx).exp_u20();
            p.store(row + j);
            acc = acc + p;
          }
          float total = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
          for (; j < seen; ++j) total += (row[j] = std::exp(row[j] - mx));
          std::fill(row + seen, row + m, 0.f);
          inv[r] = 1.f / total;
          lp[bh * n + i] = mx + std::log(total);
        }
        Tensor oc = oh.narrow(0, i0, c);
        at::mm_out(oc, s, vh.narrow(0, 0, m));
        float* op = oc.data_ptr<float>();
        for (int64_t r = 0; r < c; ++r) {  // normalise the c output rows, not the c × m probabilities
          const Vec vi(inv[r]);
          int64_t j = 0;
          for (; j + Vec::size() <= e; j += Vec::size()) (Vec::loadu(op + r * e + j) * vi).store(op + r * e + j);
          for (; j < e; ++j) op[r * e + j] *= inv[r];
        }
      }
    }
  });
  return {out.view({B, H, n, e}), lse.view({B, H, n})};
}

// Gradients of biased_forward given its out and lse and the output's gradient dout:
// dq, dk, dv, then the table's (summed over the batch), qband's, kband's, lowrank's and sided's,
// each undefined (None) when that input is absent.
std::vector<Tensor> biased_backward(Tensor q, Tensor k, Tensor v, std::optional<Tensor> table,
                                    std::optional<Tensor> qband, std::optional<Tensor> kband,
                                    std::optional<Tensor> lowrank, std::optional<Tensor> sided,
                                    std::optional<Tensor> keep, Tensor out, Tensor lse, Tensor dout, bool causal,
                                    int64_t block) {
  check(q, "q", 4); check(k, "k", 4); check(v, "v", 4);
  check(out, "out", 4); check(lse, "lse", 3); check(dout, "dout", 4);
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(2) == q.size(2) && out.sizes() == v.sizes() &&
              dout.sizes() == v.sizes(), "q, k, v, out, dout shapes disagree");
  TORCH_CHECK(block > 0, "block must be positive");
  const Inputs in(q, table, qband, kband, lowrank, sided, keep);
  const int64_t B = in.B, H = in.H, n = in.n, d = q.size(3), e = v.size(3), BH = B * H, L = 2 * n - 1;
  block = std::min(block, n);
  q = q.detach(); k = k.detach(); v = v.detach();
  Tensor do2 = plain(dout).view({BH, n, e});
  Tensor dq = at::empty({BH, n, d}, q.options()), dk = at::zeros({BH, n, d}, q.options());
  Tensor dv = at::zeros({BH, n, e}, q.options());
  Tensor D = (plain(dout) * plain(out)).sum(-1).view({BH, n});
  Tensor lse2 = plain(lse).view({BH, n});
  const int64_t threads = at::get_num_threads();
  Tensor gtable = in.table.defined() ? at::zeros({threads, in.Ht, L}, q.options()) : Tensor();
  Tensor gq = in.qband.defined() ? at::zeros_like(in.qband) : Tensor();
  Tensor gk = in.kband.defined() ? at::zeros_like(in.kband) : Tensor();
  Tensor gs = in.sided.defined() ? at::zeros_like(in.sided) : Tensor();  // [B·H, 4, n]
  Tensor glow = in.low_u.defined() ? at::zeros({2, BH, n, in.low_u.size(2)}, q.options()) : Tensor();  // dU, dV
  const float* Dp = D.data_ptr<float>();
  const float* lp = lse2.data_ptr<float>();

  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    at::NoGradGuard no_grad;
    Tensor s_buf = at::empty({block * n}, q.options()), dp_buf = at::empty({block * n}, q.options());
    float* gt = gtable.defined() ? gtable[at::get_thread_num()].data_ptr<float>() : nullptr;
    for (int64_t bh = begin; bh < end; ++bh) {
      const Bias bias = in.at(bh);
      Grad grad;
      if (gt) grad.table = gt + (in.Ht == 1 ? 0 : bh % H) * L;
      if (gq.defined()) grad.qband = gq.data_ptr<float>() + bh * n * (2 * in.wq + 1);
      if (gk.defined()) grad.kband = gk.data_ptr<float>() + bh * n * (2 * in.wk + 1);
      if (gs.defined()) grad.sided = gs.data_ptr<float>() + bh * 4 * n;
      Tensor qh = head(q, bh, H), kh = head(k, bh, H), vh = head(v, bh, H);
      Tensor doh = do2[bh], dqh = dq[bh], dkh = dk[bh], dvh = dv[bh];
      for (int64_t i0 = 0; i0 < n; i0 += block) {
        const int64_t c = std::min(block, n - i0), m = causal ? i0 + c : n;  // keys [0, m) reach the block
        Tensor s = s_buf.narrow(0, 0, c * m).view({c, m}), dp = dp_buf.narrow(0, 0, c * m).view({c, m});
        Tensor qc = qh.narrow(0, i0, c), doc = doh.narrow(0, i0, c);
        at::mm_out(s, qc, kh.narrow(0, 0, m).t());
        in.add_low_rank(s, bh, i0, c, m);
        at::mm_out(dp, doc, vh.narrow(0, 0, m).t());
        float* sp = s.data_ptr<float>();
        float* dpp = dp.data_ptr<float>();
        for (int64_t r = 0; r < c; ++r) {
          const int64_t i = i0 + r, seen = causal ? i + 1 : m;
          float* srow = sp + r * m;
          float* drow = dpp + r * m;
          add_bias(srow, i, seen, bias);
          const Vec vl(lp[bh * n + i]), vD(Dp[bh * n + i]);
          int64_t j = 0;
          for (; j + Vec::size() <= seen; j += Vec::size()) {   // p = exp(s − lse), dS = p (dP − D)
            Vec p = (Vec::loadu(srow + j) - vl).exp_u20();
            p.store(srow + j);
            (p * (Vec::loadu(drow + j) - vD)).store(drow + j);
          }
          for (; j < seen; ++j) {
            srow[j] = std::exp(srow[j] - lp[bh * n + i]);
            drow[j] = srow[j] * (drow[j] - Dp[bh * n + i]);
          }
          grad_bias(drow, i, seen, bias, grad);
          std::fill(srow + seen, srow + m, 0.f);
          std::fill(drow + seen, drow + m, 0.f);
        }
        if (glow.defined()) {  // dU = dS V, dV += dSᵀ U
          Tensor du = glow[0][bh].narrow(0, i0, c);
          at::mm_out(du, dp, in.low_v[bh].narrow(0, 0, m));
          glow[1][bh].narrow(0, 0, m).addmm_(dp.t(), in.low_u[bh].narrow(0, i0, c));
        }
        Tensor dqc = dqh.narrow(0, i0, c);
        at::mm_out(dqc, dp, kh.narrow(0, 0, m));
        dkh.narrow(0, 0, m).addmm_(dp.t(), qc);
        dvh.narrow(0, 0, m).addmm_(s.t(), doc);
      }
    }
  });
  Tensor dtable = gtable.defined() ? gtable.sum(0) : Tensor();
  Tensor dqband = gq.defined() ? gq.view({B, H, n, 2 * in.wq + 1}) : Tensor();
  Tensor dkband = gk.defined() ? gk.transpose(1, 2).reshape({B, H, n, 2 * in.wk + 1}) : Tensor();
  Tensor dlow = glow.defined() ? glow.view({2, B, H, n, in.low_u.size(2)}) : Tensor();
  Tensor dsided = gs.defined() ? gs.transpose(0, 1).reshape({4, B, H, n}) : Tensor();
  return {dq.view(q.sizes()), dk.view(k.sizes()), dv.view(v.sizes()), dtable, dqband, dkband, dlow, dsided};
}
