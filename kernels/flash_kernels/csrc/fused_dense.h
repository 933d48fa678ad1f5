#pragma once

#include <ATen/ATen.h>

namespace flash_kernels {

// The cuBLASLt epilogues we use, named here so that the bindings need no CUDA headers.
enum class Epilogue { kDefault, kBias, kGeluAuxBias, kBgradB, kDgelu, kDgeluBgrad };

// One column-major cuBLASLt GEMM D (m x n) = op(A) op(B) (+ D if accumulate), with an epilogue.
struct LtGemm {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* d = nullptr;
  int64_t ldd = 0;
  at::ScalarType dtype = at::kHalf;
  Epilogue epilogue = Epilogue::kDefault;
  const void* bias = nullptr;  // bias (BIAS epilogues) or bias-gradient output (BGRAD epilogues)
  void* aux = nullptr;         // pre-activation: written by GELU_AUX, read by DGELU(_BGRAD)
  int64_t ld_aux = 0;
  bool accumulate = false;     // beta = 1 (with host scalars)
  // D = alpha * op(A) op(B) + beta * C. alpha and beta are 1 and 0 (1 with accumulate) unless both are given
  // here, as pointers to device memory: how a scalar known only on the device (a loss's upstream gradient)
  // reaches the epilogue without a host sync.
  const float* alpha_device = nullptr;
  const float* beta_device = nullptr;
  const void* c = nullptr;     // C, in D's layout; null: C is D
};

void lt_gemm(const LtGemm& g);

}  // namespace flash_kernels
