// The block-scaled FP8 GEMM by cuBLASLt (Hopper, cuBLAS >= 12.9), as an XLA FFI handler: fp8rl_jax/kernels/cublaslt.
//
//   out [P, Q] = block_gemm(qa [P, C], sa, qb [Q, C], sb)     (row-major, both operands contracted over C)
//
// cuBLAS is column-major, so the call computes out^T [Q, P] = qb . qa^T: A = qb (OP_T), B = qa (OP_N), D [Q, P] with
// leading dimension Q, which is out [P, Q] row-major. Scales arrive laid out as cuBLASLt reads them (the Python
// wrapper makes them):
//   sa   VEC128 for B: [Cb, round_up(P, 4)], one f32 per row of qa and 128-wide slice of C, rows contiguous
//   sb   weight_blocks=1: BLK128x128 for A: [ceil(Q / 128), round_up(Cb, 4)], slices contiguous
//        weight_blocks=0: VEC128 for A: [Cb, round_up(Q, 4)]
// cuBLASLt multiplies each 128-deep slice's sum by its two scales and adds it to an f32 accumulator (no fast
// accumulation with block scaling), the arithmetic of fp8.block.block_gemm.
#include <cublasLt.h>

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // fp8rl_jax.kernels.cublaslt.WORKSPACE_BYTES
constexpr int kMaxAlgos = 16;  // the heuristic's candidates the ``algo`` attribute may pick among

std::string Describe(const char* what, cublasStatus_t status) {
  return std::string("fp8rl cuBLASLt block GEMM: ") + what + " failed: " + cublasLtGetStatusString(status);
}

#define FP8RL_CHECK_CUBLAS(what, expr)                               \
  do {                                                               \
    cublasStatus_t status_ = (expr);                                 \
    if (status_ != CUBLAS_STATUS_SUCCESS) {                          \
      return ffi::Error(ffi::ErrorCode::kInternal, Describe(what, status_)); \
    }                                                                \
  } while (0)

// One cuBLASLt handle a stream (a stream belongs to one device), made on first use and kept for the process.
std::mutex handles_mutex;
std::map<void*, cublasLtHandle_t> handles;

cublasStatus_t HandleFor(cudaStream_t stream, cublasLtHandle_t* handle) {
  std::lock_guard<std::mutex> lock(handles_mutex);
  auto it = handles.find(stream);
  if (it != handles.end()) {
    *handle = it->second;
    return CUBLAS_STATUS_SUCCESS;
  }
  cublasStatus_t status = cublasLtCreate(handle);
  if (status == CUBLAS_STATUS_SUCCESS) handles.emplace(stream, *handle);
  return status;
}

// The algorithm cuBLASLt's heuristic ranks ``algo``-th (0: its pick), once a problem (shapes, types, scale mode,
// handle, rank).
using ProblemKey = std::array<int64_t, 9>;
std::mutex algos_mutex;
std::map<ProblemKey, cublasLtMatmulAlgo_t> algos;

// Destroys a cuBLASLt descriptor when the call returns, on every path.
template <typename T, cublasStatus_t (*Destroy)(T)>
struct Owned {
  T value = nullptr;
  ~Owned() {
    if (value != nullptr) Destroy(value);
  }
};

bool CudaType(ffi::DataType type, cudaDataType_t* out) {
  switch (type) {
    case ffi::DataType::F8E4M3FN: *out = CUDA_R_8F_E4M3; return true;
    case ffi::DataType::F8E5M2: *out = CUDA_R_8F_E5M2; return true;
    case ffi::DataType::F32: *out = CUDA_R_32F; return true;
    case ffi::DataType::BF16: *out = CUDA_R_16BF; return true;
    default: return false;
  }
}

int64_t RoundUp(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

ffi::Error BlockGemm(cudaStream_t stream, ffi::AnyBuffer qa, ffi::Buffer<ffi::F32> sa, ffi::AnyBuffer qb,
                     ffi::Buffer<ffi::F32> sb, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::Buffer<ffi::U8>> workspace, int32_t weight_blocks, int32_t algo_rank) {
  auto invalid = [](std::string message) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "fp8rl cuBLASLt block GEMM: " + message);
  };
  if (qa.dimensions().size() != 2 || qb.dimensions().size() != 2 || out->dimensions().size() != 2) {
    return invalid("qa, qb and out must be 2-D");
  }
  const int64_t p = qa.dimensions()[0], c = qa.dimensions()[1], q = qb.dimensions()[0];
  const int64_t cb = (c + 127) / 128;
  if (qb.dimensions()[1] != c || out->dimensions()[0] != p || out->dimensions()[1] != q) {
    return invalid("shapes differ: want qa [P, C], qb [Q, C], out [P, Q]");
  }
  const int64_t sa_want = cb * RoundUp(p, 4);
  const int64_t sb_want = weight_blocks ? (q + 127) / 128 * RoundUp(cb, 4) : cb * RoundUp(q, 4);
  if (static_cast<int64_t>(sa.element_count()) != sa_want || static_cast<int64_t>(sb.element_count()) != sb_want) {
    return invalid("scales of the wrong size (the wrapper lays them out)");
  }
  if (workspace->element_count() < kWorkspaceBytes) return invalid("workspace too small");
  if (algo_rank < 0 || algo_rank >= kMaxAlgos) return invalid("algo must be in [0, " + std::to_string(kMaxAlgos) + ")");
  cudaDataType_t a_type, b_type, d_type;
  if (!CudaType(qb.element_type(), &a_type) || !CudaType(qa.element_type(), &b_type) ||
      !CudaType(out->element_type(), &d_type) || a_type == CUDA_R_32F || a_type == CUDA_R_16BF ||
      b_type == CUDA_R_32F || b_type == CUDA_R_16BF || (d_type != CUDA_R_32F && d_type != CUDA_R_16BF)) {
    return invalid("qa and qb must be float8_e4m3fn or float8_e5m2, out float32 or bfloat16");
  }
  if (p == 0 || q == 0) return ffi::Error::Success();

  cublasLtHandle_t handle;
  FP8RL_CHECK_CUBLAS("cublasLtCreate", HandleFor(stream, &handle));

  Owned<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy> desc;
  FP8RL_CHECK_CUBLAS("cublasLtMatmulDescCreate", cublasLtMatmulDescCreate(&desc.value, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  const int32_t a_mode = weight_blocks ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                       : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  const int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  const void* a_scale = sb.typed_data();
  const void* b_scale = sa.typed_data();
  FP8RL_CHECK_CUBLAS("set TRANSA", cublasLtMatmulDescSetAttribute(desc.value, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
  FP8RL_CHECK_CUBLAS("set TRANSB", cublasLtMatmulDescSetAttribute(desc.value, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
  FP8RL_CHECK_CUBLAS("set A_SCALE_MODE",
                     cublasLtMatmulDescSetAttribute(desc.value, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode)));
  FP8RL_CHECK_CUBLAS("set B_SCALE_MODE",
                     cublasLtMatmulDescSetAttribute(desc.value, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode)));
  FP8RL_CHECK_CUBLAS("set A_SCALE_POINTER", cublasLtMatmulDescSetAttribute(
                                                desc.value, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale)));
  FP8RL_CHECK_CUBLAS("set B_SCALE_POINTER", cublasLtMatmulDescSetAttribute(
                                                desc.value, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale)));

  Owned<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy> a_layout, b_layout, d_layout;
  FP8RL_CHECK_CUBLAS("layout A", cublasLtMatrixLayoutCreate(&a_layout.value, a_type, c, q, c));
  FP8RL_CHECK_CUBLAS("layout B", cublasLtMatrixLayoutCreate(&b_layout.value, b_type, c, p, c));
  FP8RL_CHECK_CUBLAS("layout D", cublasLtMatrixLayoutCreate(&d_layout.value, d_type, q, p, q));

  const ProblemKey key = {p, q, c, a_type, b_type, d_type, weight_blocks,
                          static_cast<int64_t>(reinterpret_cast<intptr_t>(handle)), algo_rank};
  cublasLtMatmulAlgo_t algo;
  bool known;
  {
    std::lock_guard<std::mutex> lock(algos_mutex);
    auto it = algos.find(key);
    known = it != algos.end();
    if (known) algo = it->second;
  }
  if (!known) {
    Owned<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy> pref;
    FP8RL_CHECK_CUBLAS("cublasLtMatmulPreferenceCreate", cublasLtMatmulPreferenceCreate(&pref.value));
    const uint64_t bytes = kWorkspaceBytes;
    FP8RL_CHECK_CUBLAS("set MAX_WORKSPACE_BYTES", cublasLtMatmulPreferenceSetAttribute(
                                                      pref.value, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes, sizeof(bytes)));
    std::array<cublasLtMatmulHeuristicResult_t, kMaxAlgos> results = {};
    int found = 0;
    FP8RL_CHECK_CUBLAS("cublasLtMatmulAlgoGetHeuristic",
                       cublasLtMatmulAlgoGetHeuristic(handle, desc.value, a_layout.value, b_layout.value, d_layout.value,
                                                      d_layout.value, pref.value, algo_rank + 1, results.data(), &found));
    if (found == 0) {
      return ffi::Error(ffi::ErrorCode::kUnimplemented,
                        "fp8rl cuBLASLt block GEMM: cuBLASLt has no block-scaled FP8 algorithm for P=" +
                            std::to_string(p) + " Q=" + std::to_string(q) + " C=" + std::to_string(c) +
                            " on this GPU (Hopper and cuBLAS >= 12.9 have them)");
    }
    if (algo_rank >= found) {
      return ffi::Error(ffi::ErrorCode::kNotFound, "fp8rl cuBLASLt block GEMM: algo=" + std::to_string(algo_rank) +
                                                       ", but cuBLASLt offers " + std::to_string(found) +
                                                       " algorithms for this problem");
    }
    algo = results[algo_rank].algo;
    std::lock_guard<std::mutex> lock(algos_mutex);
    algos.emplace(key, algo);
  }
  const float alpha = 1.0f, beta = 0.0f;
  void* d = out->untyped_data();
  FP8RL_CHECK_CUBLAS("cublasLtMatmul",
                     cublasLtMatmul(handle, desc.value, &alpha, qb.untyped_data(), a_layout.value, qa.untyped_data(),
                                    b_layout.value, &beta, d, d_layout.value, d, d_layout.value, &algo,
                                    workspace->untyped_data(), kWorkspaceBytes, stream));
  return ffi::Error::Success();
}

}  // namespace

// The handler's interface (its operands and attributes): fp8rl_jax.kernels.cublaslt.ABI, which register() checks, so
// that a library built from an older source fails at start-up, not in the first step.
extern "C" int Fp8rlBlockGemmCublasLtAbi() { return 2; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8rlBlockGemmCublasLt, BlockGemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()           // qa [P, C]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // sa
                                  .Arg<ffi::AnyBuffer>()           // qb [Q, C]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // sb
                                  .Ret<ffi::AnyBuffer>()           // out [P, Q]
                                  .Ret<ffi::Buffer<ffi::U8>>()     // cuBLASLt's workspace
                                  .Attr<int32_t>("weight_blocks")
                                  .Attr<int32_t>("algo"),                 // the heuristic's rank: 0, its pick
                              {ffi::Traits::kCmdBufferCompatible});
