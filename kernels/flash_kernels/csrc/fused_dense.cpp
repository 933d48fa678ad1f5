// PyTorch bindings of the cuBLASLt fused-dense GEMMs (see fused_dense_cuda.cu). Every function takes
// row-major tensors and returns new ones; shapes are checked here, the GEMM layout is derived in comments.

#include <torch/extension.h>

#include "fused_dense.h"

namespace flash_kernels {
namespace {

void check_matrix(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "fused_dense: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.dim() == 2, "fused_dense: ", name, " must be 2-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.is_contiguous(), "fused_dense: ", name, " must be contiguous");
}

void check_same_dtype(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "fused_dense: dtype mismatch ", a.scalar_type(), " vs ",
              b.scalar_type());
}

// y = x @ w.T + bias, and with gelu also the pre-activation.
// Column-major: y^T (N x M, ld N) = w^T-as-stored... i.e. op(A)=T on w (stored K x N, ld K), B = x (K x M, ld K).
std::vector<at::Tensor> linear_fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, bool gelu) {
  check_matrix(x, "x");
  check_matrix(w, "weight");
  check_same_dtype(x, w);
  check_same_dtype(x, bias);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "fused_dense: weight ", w.sizes(), " does not match x ", x.sizes());
  TORCH_CHECK(bias.numel() == N && bias.is_contiguous(), "fused_dense: bias must be contiguous with ", N, " elements");
  auto y = at::empty({M, N}, x.options());
  LtGemm g;
  g.trans_a = true;
  g.m = N; g.n = M; g.k = K;
  g.a = w.data_ptr(); g.lda = K;
  g.b = x.data_ptr(); g.ldb = K;
  g.d = y.data_ptr(); g.ldd = N;
  g.dtype = x.scalar_type();
  g.bias = bias.data_ptr();
  if (!gelu) {
    g.epilogue = Epilogue::kBias;
    lt_gemm(g);
    return {y};
  }
  auto pre = at::empty({M, N}, x.options());
  g.epilogue = Epilogue::kGeluAuxBias;
  g.aux = pre.data_ptr();
  g.ld_aux = N;
  lt_gemm(g);
  return {y, pre};
}

// The GEMM dw = dy.T @ x for x (M x K), dy (M x N), dw (N x K), all row-major.
// Column-major: dW^T (K x N, ld K) = x^T (K x M, ld K) @ op_T(dy^T stored N x M, ld N); bias along n = N.
LtGemm wgrad_gemm(const at::Tensor& x, const at::Tensor& dy, at::Tensor& dw) {
  check_matrix(x, "x");
  check_matrix(dy, "grad_output");
  check_same_dtype(x, dy);
  const int64_t M = x.size(0), K = x.size(1), N = dy.size(1);
  TORCH_CHECK(dy.size(0) == M, "fused_dense: grad_output ", dy.sizes(), " does not match x ", x.sizes());
  dw = at::empty({N, K}, x.options());
  LtGemm g;
  g.trans_b = true;
  g.m = K; g.n = N; g.k = M;
  g.a = x.data_ptr(); g.lda = K;
  g.b = dy.data_ptr(); g.ldb = N;
  g.d = dw.data_ptr(); g.ldd = K;
  g.dtype = x.scalar_type();
  return g;
}

// dW = dy.T @ x (N x K) and, if with_bias, db = dy.sum(0) from the BGRADB epilogue.
std::vector<at::Tensor> linear_wgrad(const at::Tensor& x, const at::Tensor& dy, bool with_bias) {
  at::Tensor dw;
  LtGemm g = wgrad_gemm(x, dy, dw);
  if (!with_bias) {
    lt_gemm(g);
    return {dw};
  }
  auto db = at::empty({dy.size(1)}, x.options());
  g.epilogue = Epilogue::kBgradB;
  g.bias = db.data_ptr();
  lt_gemm(g);
  return {dw, db};
}

// cuBLASLt needs 16-byte row strides: the ones column comes with 7 more (fp16 / bf16).
constexpr int64_t kOnesColumns = 8;

// dW and db from one plain GEMM: dy.T @ [x | 1] holds dW in its first K columns and db = dy.sum(0) in column K
// (each dy entry times 1, summed in the GEMM's float32). Costs a copy of x into the wider operand and one of dW
// out of the wider result, against BGRADB's slower GEMM and separate reduction over dy; the caller weighs them.
// In C++ because its four extra ops are host work on every backward: as torch calls from Python they made
// fused_dense's step host-bound on an H100 (`scripts/profile/op_kernels.py fused_dense`: kernel against wall time).
std::vector<at::Tensor> linear_wgrad_ones(const at::Tensor& x, const at::Tensor& dy) {
  check_matrix(x, "x");
  const int64_t K = x.size(1);
  auto x_ones = at::cat({x, at::ones({x.size(0), kOnesColumns}, x.options())}, 1);
  at::Tensor dw_ones;
  lt_gemm(wgrad_gemm(x_ones, dy, dw_ones));
  return {dw_ones.narrow(1, 0, K).contiguous(), dw_ones.select(1, K).contiguous()};
}

// dW = scale * (dy.T @ x + acc), scale a float32 scalar read on the device (alpha = beta = scale in the GEMM's
// epilogue) and acc (N x K) a partial sum, or empty for none. For a gradient computed before its upstream
// scalar is known (linear_cross_entropy's, in the forward): the scalar joins the last GEMM instead of a pass of
// its own over dW, a read and a write of the largest tensor of the op.
at::Tensor linear_wgrad_scaled(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& acc,
                               const at::Tensor& scale) {
  TORCH_CHECK(scale.is_cuda() && scale.scalar_type() == at::kFloat && scale.numel() == 1 && scale.is_contiguous(),
              "fused_dense: scale must be one contiguous float32 CUDA element");
  at::Tensor dw, zero;
  LtGemm g = wgrad_gemm(x, dy, dw);
  g.alpha_device = scale.data_ptr<float>();
  if (acc.numel() == 0) {
    zero = at::zeros({1}, scale.options());
    g.beta_device = zero.data_ptr<float>();
  } else {
    check_matrix(acc, "acc");
    check_same_dtype(acc, dw);
    TORCH_CHECK(acc.sizes() == dw.sizes(), "fused_dense: acc ", acc.sizes(), " != dW ", dw.sizes());
    g.beta_device = g.alpha_device;
    g.c = acc.data_ptr();
  }
  lt_gemm(g);
  return dw;
}

// dx = dy @ w (M x K). Column-major: dx^T (K x M, ld K) = w^T stored (K x N, ld K) @ dy^T stored (N x M, ld N).
// With pre (M x K) it is the GELU backward of the layer below: dpre = (dy @ w) * gelu'(pre) from the DGELU
// epilogue, and with bias_grad also its bias gradient dpre.sum(0) (DGELU_BGRAD).
std::vector<at::Tensor> linear_dgrad(const at::Tensor& dy, const at::Tensor& w, const c10::optional<at::Tensor>& pre,
                                     bool bias_grad) {
  check_matrix(dy, "grad_output");
  check_matrix(w, "weight");
  check_same_dtype(dy, w);
  const int64_t M = dy.size(0), N = dy.size(1), K = w.size(1);
  TORCH_CHECK(w.size(0) == N, "fused_dense: weight ", w.sizes(), " does not match grad_output ", dy.sizes());
  TORCH_CHECK(pre.has_value() || !bias_grad, "fused_dense: a bias gradient needs the pre-activation");
  auto dx = at::empty({M, K}, dy.options());
  LtGemm g;
  g.m = K; g.n = M; g.k = N;
  g.a = w.data_ptr(); g.lda = K;
  g.b = dy.data_ptr(); g.ldb = N;
  g.d = dx.data_ptr(); g.ldd = K;
  g.dtype = dy.scalar_type();
  if (!pre.has_value()) {
    lt_gemm(g);
    return {dx};
  }
  check_matrix(*pre, "pre_activation");
  TORCH_CHECK(pre->size(0) == M && pre->size(1) == K, "fused_dense: pre_activation ", pre->sizes(), " != (", M,
              ", ", K, ")");
  g.aux = pre->data_ptr();
  g.ld_aux = K;
  if (!bias_grad) {
    g.epilogue = Epilogue::kDgelu;
    lt_gemm(g);
    return {dx};
  }
  auto db = at::empty({K}, dy.options());
  g.epilogue = Epilogue::kDgeluBgrad;
  g.bias = db.data_ptr();
  lt_gemm(g);
  return {dx, db};
}

}  // namespace
}  // namespace flash_kernels

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_fwd", &flash_kernels::linear_fwd, "x @ w.T + bias (gelu: also returns the pre-activation)");
  m.def("linear_wgrad", &flash_kernels::linear_wgrad, "dy.T @ x and optionally dy.sum(0)");
  m.def("linear_wgrad_ones", &flash_kernels::linear_wgrad_ones, "dy.T @ x and dy.sum(0) from dy.T @ [x | 1]");
  m.def("linear_wgrad_scaled", &flash_kernels::linear_wgrad_scaled,
        "scale * (dy.T @ x + acc), scale read on the device (acc may be empty)");
  m.def("linear_dgrad", &flash_kernels::linear_dgrad, "dy @ w, optionally times gelu'(pre) (and its bias grad)");
}
