// ai.kiln MatMulNBits: ONNX Runtime's com.microsoft MatMulNBits inputs and attributes (A, B, scales, optional
// zero_points; K, N, bits, block_size), computed by kiln's own kernel (gemm.h). The weights are repacked once, when
// the session creates the kernel, from the constant initializers; threads come from the session's intra-op pool.
//
// KILN_KERNEL_ISA=scalar|avx2|avx512vnni (read when a kernel is created) forces a path the CPU runs: tests compare
// the paths bit for bit. kiln_kernel_isa() reports the path the library picks.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include <sys/mman.h>
#include <unistd.h>

#include "gemm.h"
#include "ort_api.h"

#ifndef MADV_PAGEOUT
#define MADV_PAGEOUT 21  // Linux 5.4; older kernels refuse it (EINVAL) and the pages stay
#endif

namespace {

ort::Api g_api;
const char* kDomain = "ai.kiln";

struct Kernel {
  kiln::Packed w;
  kiln::Isa isa = kiln::Isa::scalar;
};

struct Work {
  const Kernel* kernel;
  kiln::Activations* act;  // quantized by quantize_task, read by gemm_task
  float* y;
  int64_t tiles_per_task;
  const float* x;
  int64_t rows_per_task;
};

OrtStatus* fail(const std::string& message) { return g_api.status(("ai.kiln MatMulNBits: " + message).c_str()); }

// Element type and dims of a tensor; a status on error.
OrtStatus* shape_of(const OrtValue* v, ONNXTensorElementDataType* type, std::vector<int64_t>* dims) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  if (OrtStatus* s = g_api.type_and_shape(v, &info)) return s;
  size_t n = 0;
  OrtStatus* s = g_api.element_type(info, type);
  if (!s) s = g_api.dims_count(info, &n);
  if (!s) {
    dims->assign(n, 0);
    s = g_api.dims(info, dims->data(), n);
  }
  g_api.release_info(info);
  return s;
}

int64_t product(const std::vector<int64_t>& d) {
  int64_t p = 1;
  for (int64_t v : d) p *= v;
  return p;
}

OrtStatus* constant(const OrtKernelInfo* info, size_t index, ONNXTensorElementDataType want, int64_t count,
                    const char* what, const void** data) {
  int is_constant = 0;
  const OrtValue* v = nullptr;
  if (OrtStatus* s = g_api.constant_input(info, index, &is_constant, &v)) return s;
  if (!is_constant || !v) return fail(std::string(what) + " must be a constant initializer (kiln packs it at load)");
  ONNXTensorElementDataType type;
  std::vector<int64_t> dims;
  if (OrtStatus* s = shape_of(v, &type, &dims)) return s;
  if (type != want) return fail(std::string(what) + " has the wrong element type");
  if (product(dims) != count) {
    return fail(std::string(what) + " holds " + std::to_string(product(dims)) + " values, not " +
                std::to_string(count));
  }
  void* p = nullptr;
  if (OrtStatus* s = g_api.data(const_cast<OrtValue*>(v), &p)) return s;
  *data = p;
  return nullptr;
}

// The source pages of weights the kernel has packed, out of this process's resident set: ONNX Runtime maps an
// artifact's weights file, and packing read every page of it; kept, the weights would be resident twice. The advice
// keeps what a later read sees (a file-backed page is read again from the file; memory ONNX Runtime allocated is
// swapped out or, without swap, left alone), so it is safe whoever else reads the initializer. Whole pages only.
void release_pages(const void* p, int64_t bytes) {
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + uintptr_t(bytes)) / page * page;
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_PAGEOUT);
}

OrtStatus* create(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** out) {
  int64_t k = 0, n = 0, bits = 0, block = 0;
  for (auto [name, dst] : {std::pair<const char*, int64_t*>{"K", &k}, {"N", &n}, {"bits", &bits},
                           {"block_size", &block}}) {
    if (OrtStatus* s = g_api.attribute(info, name, dst)) return s;
  }
  if ((bits != 4 && bits != 8) || block < 16 || block > 4096 || (block & (block - 1)) || k <= 0 || n <= 0) {
    return fail("takes bits 4 or 8, a power-of-two block_size in [16, 4096] and positive K, N");
  }
  const int64_t blocks = (k + block - 1) / block;
  size_t inputs = 0;
  if (OrtStatus* s = g_api.info_input_count(info, &inputs)) return s;
  const void *codes = nullptr, *scales = nullptr, *zeros = nullptr;
  if (OrtStatus* s = constant(info, 1, ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8, n * blocks * block * bits / 8, "B", &codes))
    return s;
  if (OrtStatus* s = constant(info, 2, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, n * blocks, "scales", &scales)) return s;
  if (inputs > 3) {
    int is_constant = 0;
    const OrtValue* v = nullptr;
    if (OrtStatus* s = g_api.constant_input(info, 3, &is_constant, &v)) return s;
    if (v || is_constant) {  // an empty optional input is neither
      if (OrtStatus* s = constant(info, 3, ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8, n * ((blocks * bits + 7) / 8),
                                  "zero_points", &zeros))
        return s;
    }
  }
  auto kernel = std::make_unique<Kernel>();
  kernel->isa = kiln::best_isa();
  if (const char* forced = std::getenv("KILN_KERNEL_ISA")) {
    kiln::Isa isa;
    if (!kiln::parse_isa(forced, &isa)) return fail(std::string("KILN_KERNEL_ISA=") + forced + " is not scalar, avx2 or avx512vnni");
    if (!kiln::isa_supported(isa)) return fail(std::string("KILN_KERNEL_ISA=") + forced + ": this CPU cannot run it");
    kernel->isa = isa;
  }
  std::string why = kiln::pack(int(bits), int(block), k, n, static_cast<const uint8_t*>(codes),
                               static_cast<const float*>(scales), static_cast<const uint8_t*>(zeros), &kernel->w);
  if (!why.empty()) return fail(why);
  release_pages(codes, n * blocks * block * bits / 8);
  release_pages(scales, n * blocks * 4);
  *out = kernel.release();
  return nullptr;
}

void quantize_task(void* user, size_t i) {
  Work* w = static_cast<Work*>(user);
  const int64_t m0 = int64_t(i) * w->rows_per_task, m1 = std::min(w->act->m, m0 + w->rows_per_task);
  kiln::quantize_rows(w->kernel->isa, w->x, m0, m1, w->kernel->w.k, w->kernel->w.block, w->act);
}

void gemm_task(void* user, size_t i) {
  Work* w = static_cast<Work*>(user);
  const int64_t t0 = int64_t(i) * w->tiles_per_task, t1 = std::min(w->kernel->w.tiles, t0 + w->tiles_per_task);
  kiln::gemm_tiles(w->kernel->isa, w->kernel->w, *w->act, t0, t1, w->y);
}

OrtStatus* compute(void* op_kernel, OrtKernelContext* ctx) {
  const Kernel* kernel = static_cast<const Kernel*>(op_kernel);
  const kiln::Packed& p = kernel->w;
  const OrtValue* a = nullptr;
  if (OrtStatus* s = g_api.input(ctx, 0, &a)) return s;
  ONNXTensorElementDataType type;
  std::vector<int64_t> dims;
  if (OrtStatus* s = shape_of(a, &type, &dims)) return s;
  if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || dims.empty() || dims.back() != p.k) {
    return fail("A must be float32 with a last dimension of K = " + std::to_string(p.k));
  }
  void* x = nullptr;
  if (OrtStatus* s = g_api.data(const_cast<OrtValue*>(a), &x)) return s;
  const int64_t m = product(dims) / p.k;
  dims.back() = p.n;
  OrtValue* out = nullptr;
  if (OrtStatus* s = g_api.output(ctx, 0, dims.data(), dims.size(), &out)) return s;
  void* y = nullptr;
  if (OrtStatus* s = g_api.data(out, &y)) return s;
  if (m == 0) return nullptr;
  thread_local kiln::Activations act;  // one buffer per calling thread, reused across calls
  kiln::prepare(m, p.k, p.block, p.blocks, &act);
  Work work{kernel, &act, static_cast<float*>(y), 1, static_cast<const float*>(x), 1};
  if (m * p.k <= (int64_t(1) << 16)) {  // decode rows: quantized here, a pool dispatch costs more than the work
    kiln::quantize_rows(kernel->isa, work.x, 0, m, p.k, p.block, &act);
  } else {
    work.rows_per_task = std::max<int64_t>(1, m / 8);
    if (OrtStatus* s = g_api.parallel_for(ctx, quantize_task,
                                          size_t((m + work.rows_per_task - 1) / work.rows_per_task), &work))
      return s;
  }
  // about four tasks a core: enough to balance the pool, each long enough to amortise its dispatch
  static const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());  // reads /sys: once
  const int64_t tasks = std::min<int64_t>(p.tiles, 4 * cores);
  work.tiles_per_task = (p.tiles + tasks - 1) / tasks;
  return g_api.parallel_for(ctx, gemm_task, size_t((p.tiles + work.tiles_per_task - 1) / work.tiles_per_task), &work);
}

void destroy(void* op_kernel) { delete static_cast<Kernel*>(op_kernel); }

const char* name(const OrtCustomOp*) { return "MatMulNBits"; }
const char* provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
ONNXTensorElementDataType input_type(const OrtCustomOp*, size_t i) {
  return i == 0 || i == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
}
size_t input_count(const OrtCustomOp*) { return 4; }
ONNXTensorElementDataType output_type(const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
size_t output_count(const OrtCustomOp*) { return 1; }
OrtCustomOpInputOutputCharacteristic input_kind(const OrtCustomOp*, size_t i) {
  return i == 3 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}
OrtCustomOpInputOutputCharacteristic output_kind(const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; }
OrtMemType memory_type(const OrtCustomOp*, size_t) { return OrtMemTypeDefault; }
int one(const OrtCustomOp*) { return 1; }
int zero(const OrtCustomOp*) { return 0; }
int start_version(const OrtCustomOp*) { return 1; }
int end_version(const OrtCustomOp*) { return 2147483647; }

OrtCustomOp make_op() {
  OrtCustomOp op;
  std::memset(&op, 0, sizeof op);
  op.version = ort::kApiVersion;
  op.GetName = name;
  op.GetExecutionProviderType = provider;
  op.GetInputType = input_type;
  op.GetInputTypeCount = input_count;
  op.GetOutputType = output_type;
  op.GetOutputTypeCount = output_count;
  op.KernelDestroy = destroy;
  op.GetInputCharacteristic = input_kind;
  op.GetOutputCharacteristic = output_kind;
  op.GetInputMemoryType = memory_type;
  op.GetVariadicInputMinArity = one;
  op.GetVariadicInputHomogeneity = zero;
  op.GetVariadicOutputMinArity = one;
  op.GetVariadicOutputHomogeneity = zero;
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = compute;
  op.GetStartVersion = start_version;
  op.GetEndVersion = end_version;
  return op;
}

OrtCustomOp g_op = make_op();

}  // namespace

extern "C" {

__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                      const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(ort::kApiVersion);
  if (!api) return nullptr;  // an ONNX Runtime older than the API this library needs: nothing can report it
  g_api.table = reinterpret_cast<const void* const*>(api);
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* s = g_api.create_domain(kDomain, &domain)) return s;
  if (OrtStatus* s = g_api.domain_add(domain, &g_op)) return s;
  return g_api.add_domain(options, domain);  // the domain lives as long as the process: sessions may outlive options
}

// The path kernels created now take (KILN_KERNEL_ISA or the best the CPU runs): "scalar", "avx2", "avx512vnni".
__attribute__((visibility("default"))) const char* kiln_kernel_isa() { return kiln::isa_name(kiln::best_isa()); }

// Whether this CPU runs `name`'s path.
__attribute__((visibility("default"))) int kiln_kernel_supports(const char* name) {
  kiln::Isa isa;
  return kiln::parse_isa(name, &isa) && kiln::isa_supported(isa);
}

}  // extern "C"
