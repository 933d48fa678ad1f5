// cuBLASLt GEMMs with fused epilogues (bias, bias+GELU saving the pre-activation, GELU gradient + bias
// gradient, bias gradient of a weight-gradient GEMM). Host code only: the epilogues run inside cuBLASLt's
// own kernels, which is the point: no separate bias/activation pass over the output.
//
// Convention: PyTorch tensors are row-major; cuBLASLt is column-major. A row-major (r x c) matrix is a
// column-major (c x r) matrix with leading dimension c, so every GEMM below is written on the transposes.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <cublasLt.h>

#include <algorithm>
#include <limits>
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
    case Epilogue::kDgelu: return CUBLASLT_EPILOGUE_DGELU;
    case Epilogue::kDgeluBgrad: return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    default: return CUBLASLT_EPILOGUE_DEFAULT;
  }
}

// The algorithm for a problem (shapes, layouts, epilogue, dtype, device) is chosen once and cached: the
// heuristic query alone costs tens of microseconds of host time per call, as much as a small GEMM, and its
// first answer is often not the fastest (on the H100, GEMM+bias at 16k x 768 -> 3072 ran 0.227 ms against
// torch's 0.161 ms on the same cuBLASLt), so the first call times up to kAlgoCandidates of its answers
// (which took that GEMM to 0.160 ms, torch 0.132 ms in that run: `flash-models bench ops --only fused_dense`).
using AlgoKey = std::tuple<int, bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, bool>;
std::map<AlgoKey, cublasLtMatmulAlgo_t> algo_cache;
std::mutex algo_cache_mutex;
constexpr int kAlgoCandidates = 8;
constexpr int kTimedRuns = 3;

template <typename T>
void set_attr(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  FK_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}

// The fastest of the heuristic's candidates, timed on scratch outputs (the real D may hold a gradient to
// accumulate into; GELU_AUX and the BGRAD epilogues write their own outputs too): a warm-up run, then
// kTimedRuns. A candidate that fails to run is skipped; the first one is kept if none is faster.
template <typename Run>
cublasLtMatmulAlgo_t fastest_algo(cublasLtMatmulDesc_t op, const LtGemm& g,
                                  const cublasLtMatmulHeuristicResult_t* candidates, int found, Run run) {
  if (found == 1) return candidates[0].algo;
  const auto options = at::TensorOptions().dtype(g.dtype).device(at::kCUDA);
  at::Tensor d = at::empty({g.ldd * g.n}, options);
  at::Tensor aux, bias_grad;
  if (g.epilogue == Epilogue::kGeluAuxBias) {
    aux = at::empty({g.ld_aux * g.n}, options);
    set_attr(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux.data_ptr());
  }
  if (g.epilogue == Epilogue::kBgradB || g.epilogue == Epilogue::kDgeluBgrad) {
    bias_grad = at::empty({std::max(g.m, g.n)}, options);
    set_attr(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias_grad.data_ptr());
  }
  at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
  const at::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream();
  cublasLtMatmulAlgo_t best = candidates[0].algo;
  float best_ms = std::numeric_limits<float>::infinity();
  for (int i = 0; i < found; ++i) {
    if (candidates[i].state != CUBLAS_STATUS_SUCCESS || run(candidates[i].algo, d.data_ptr()) != CUBLAS_STATUS_SUCCESS) {
      continue;
    }
    start.record(stream);
    for (int r = 0; r < kTimedRuns; ++r) run(candidates[i].algo, d.data_ptr());
    stop.record(stream);
    stop.synchronize();
    const float ms = start.elapsed_time(stop);
    if (ms < best_ms) {
      best_ms = ms;
      best = candidates[i].algo;
    }
  }
  // The descriptor goes on to the real call: point its epilogue outputs back at the real ones.
  if (aux.defined()) set_attr(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
  if (bias_grad.defined()) set_attr(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  return best;
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
  const bool device_scalars = g.alpha_device != nullptr;
  TORCH_CHECK(device_scalars == (g.beta_device != nullptr), "fused_dense: alpha and beta come from the device together");
  if (device_scalars) set_attr(desc.op, CUBLASLT_MATMUL_DESC_POINTER_MODE, CUBLASLT_POINTER_MODE_DEVICE);
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
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const AlgoKey key{static_cast<int>(g.dtype), g.trans_a, g.trans_b, g.m, g.n, g.k, g.lda, g.ldb, g.ldd, g.ld_aux,
                    static_cast<int>(g.epilogue), at::cuda::current_device(), device_scalars};
  const float alpha = 1.0f, beta = g.accumulate ? 1.0f : 0.0f;
  const void* alpha_ptr = device_scalars ? static_cast<const void*>(g.alpha_device) : &alpha;
  const void* beta_ptr = device_scalars ? static_cast<const void*>(g.beta_device) : &beta;
  auto run = [&](const cublasLtMatmulAlgo_t& algo, void* d) {
    const void* c = g.c != nullptr ? g.c : d;
    return cublasLtMatmul(handle, desc.op, alpha_ptr, g.a, desc.a, g.b, desc.b, beta_ptr, c, desc.d, d, desc.d, &algo,
                          workspace.data_ptr(), ws, stream);
  };
  cublasLtMatmulAlgo_t algo;
  bool known;
  {
    std::lock_guard<std::mutex> lock(algo_cache_mutex);
    auto it = algo_cache.find(key);
    known = it != algo_cache.end();
    if (known) algo = it->second;
  }
  if (!known) {
    cublasLtMatmulHeuristicResult_t candidates[kAlgoCandidates] = {};
    int found = 0;
    FK_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.d, desc.d, desc.pref,
                                                   kAlgoCandidates, candidates, &found));
    TORCH_CHECK(found > 0, "fused_dense: cuBLASLt has no algorithm for this epilogue and shape (m=", g.m,
                ", n=", g.n, ", k=", g.k, ")");
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) {
      // Nothing can be timed inside a CUDA-graph capture: take the heuristic's first answer for this call
      // and leave the choice to the first call outside one.
      algo = candidates[0].algo;
    } else {
      algo = fastest_algo(desc.op, g, candidates, found, run);
      std::lock_guard<std::mutex> lock(algo_cache_mutex);
      algo_cache.emplace(key, algo);
    }
  }
  FK_CUBLAS_CHECK(run(algo, g.d));
}

}  // namespace flash_kernels
