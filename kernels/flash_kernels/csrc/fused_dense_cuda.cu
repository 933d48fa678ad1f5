// cuBLASLt GEMMs with fused epilogues (bias, bias+GELU saving the pre-activation, GELU gradient + bias
// gradient, bias gradient of a weight-gradient GEMM). Host code only: the epilogues run inside cuBLASLt's
// own kernels, which is the point: no separate bias/activation pass over the output.
//
// Convention: PyTorch tensors are row-major; cuBLASLt is column-major. A row-major (r x c) matrix is a
// column-major (c x r) matrix with leading dimension c, so every GEMM below is written on the transposes.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <cublasLt.h>

#include <mutex>
#include <tuple>
#include <map>

#include "fused_dense.h"

namespace flash_kernels {
namespace {

#define FK_CUBLAS_CHECK(expr)                                                                          \
  do {                                                                                                 \
    cublasStatus_t status_ = (expr);                                                                   \
    TORCH_CHECK(status_ == CUBLAS_STATUS_SUCCESS, "cuBLASLt call failed with status ", int(status_), \
                ": " #expr);                                                                           \
  } while (0)

constexpr size_t kWorkspaceBytes = 32u << 20;  // what cuBLAS recommends on Hopper

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return CUDA_R_16F;
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kFloat: return CUDA_R_32F;
    default: TORCH_CHECK(false, "fused_dense: unsupported dtype ", t);
  }
}

// Owns the cuBLASLt descriptors of one call.
struct LtDescriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtDescriptors() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

cublasLtEpilogue_t lt_epilogue(Epilogue e) {
  switch (e) {
    case Epilogue::kBias: return CUBLASLT_EPILOGUE_BIAS;
    case Epilogue::kGeluAuxBias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case Epilogue::kBgradB: return CUBLASLT_EPILOGUE_BGRADB;
    case Epilogue::kDgeluBgrad: return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    default: return CUBLASLT_EPILOGUE_DEFAULT;
  }
}

// The heuristic query costs tens of microseconds of host time per call, as much as a small GEMM: its answer
// is cached per problem (shapes, layouts, epilogue, dtype, device), for which it is always the same.
using AlgoKey = std::tuple<int, bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int>;
std::map<AlgoKey, cublasLtMatmulHeuristicResult_t> algo_cache;
std::mutex algo_cache_mutex;

template <typename T>
void set_attr(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  FK_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}

}  // namespace

void lt_gemm(const LtGemm& g) {
  LtDescriptors desc;
  const cudaDataType_t type = cuda_type(g.dtype);
  const cublasComputeType_t compute = g.dtype == at::kFloat ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  FK_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc.op, compute, CUDA_R_32F));
  const cublasOperation_t op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  set_attr(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, op_a);
  set_attr(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, op_b);
  set_attr(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE, lt_epilogue(g.epilogue));
  if (g.bias != nullptr) set_attr(desc.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  if (g.aux != nullptr) {
    set_attr(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
    set_attr(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.ld_aux);
  }
  // Stored shapes (column-major): op(A) is m x k, op(B) is k x n, D is m x n.
  FK_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc.a, type, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda));
  FK_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc.b, type, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb));
  FK_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc.d, type, g.m, g.n, g.ldd));

  auto workspace = at::empty({static_cast<int64_t>(kWorkspaceBytes)},
                             at::TensorOptions().dtype(at::kByte).device(at::kCUDA));
  FK_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&desc.pref));
  const size_t ws = kWorkspaceBytes;
  FK_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(desc.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                       sizeof(ws)));
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const AlgoKey key{static_cast<int>(g.dtype), g.trans_a, g.trans_b, g.m, g.n, g.k, g.lda, g.ldb, g.ldd, g.ld_aux,
                    static_cast<int>(g.epilogue), at::cuda::current_device()};
  cublasLtMatmulHeuristicResult_t heuristic = {};
  {
    std::lock_guard<std::mutex> lock(algo_cache_mutex);
    auto it = algo_cache.find(key);
    if (it != algo_cache.end()) {
      heuristic = it->second;
    } else {
      int found = 0;
      FK_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.d, desc.d, desc.pref, 1,
                                                     &heuristic, &found));
      TORCH_CHECK(found > 0, "fused_dense: cuBLASLt has no algorithm for this epilogue and shape (m=", g.m,
                  ", n=", g.n, ", k=", g.k, ")");
      algo_cache.emplace(key, heuristic);
    }
  }
  const float alpha = 1.0f, beta = g.accumulate ? 1.0f : 0.0f;
  FK_CUBLAS_CHECK(cublasLtMatmul(handle, desc.op, &alpha, g.a, desc.a, g.b, desc.b, &beta, g.d, desc.d, g.d, desc.d,
                                 &heuristic.algo, workspace.data_ptr(), ws, at::cuda::getCurrentCUDAStream()));
}

}  // namespace flash_kernels
