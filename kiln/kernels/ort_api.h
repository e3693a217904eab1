// The part of ONNX Runtime's C API this library uses, declared from the published API.
//
// The C API is append-only: OrtApi is a table of function pointers whose order never changes once a version has
// shipped, so a function is reached by its index. The indices below are checked by onnxruntime_c_api.cc's own
// static_asserts (ReleaseCustomOpDomain 101, GetBuildInfoString 254, KernelContext_GetResource 265,
// SessionOptionsAppendExecutionProvider_OpenVINO_V2 275) and counted from them. Nothing here needs ONNX Runtime's
// headers or libraries at build time: the library is handed the API table when ONNX Runtime loads it.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

struct OrtStatus;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtValue;
struct OrtTensorTypeAndShapeInfo;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtShapeInferContext;
struct OrtApi;

enum OrtErrorCode { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };

enum ONNXTensorElementDataType {
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED = 0,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT = 1,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 = 2,
};

enum OrtCustomOpInputOutputCharacteristic { INPUT_OUTPUT_REQUIRED = 0, INPUT_OUTPUT_OPTIONAL = 1 };
enum OrtMemType { OrtMemTypeDefault = 0 };

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

// struct OrtCustomOp as of API version 17 (the fields a version-17 op is read for), plus the later fields zeroed.
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*);
  const char* (*GetName)(const OrtCustomOp*);
  const char* (*GetExecutionProviderType)(const OrtCustomOp*);
  ONNXTensorElementDataType (*GetInputType)(const OrtCustomOp*, size_t);
  size_t (*GetInputTypeCount)(const OrtCustomOp*);
  ONNXTensorElementDataType (*GetOutputType)(const OrtCustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const OrtCustomOp*);
  void (*KernelCompute)(void*, OrtKernelContext*);
  void (*KernelDestroy)(void*);
  OrtCustomOpInputOutputCharacteristic (*GetInputCharacteristic)(const OrtCustomOp*, size_t);
  OrtCustomOpInputOutputCharacteristic (*GetOutputCharacteristic)(const OrtCustomOp*, size_t);
  OrtMemType (*GetInputMemoryType)(const OrtCustomOp*, size_t);
  int (*GetVariadicInputMinArity)(const OrtCustomOp*);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp*);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp*);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp*);
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void** kernel);
  OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
  OrtStatus* (*InferOutputShapeFn)(const OrtCustomOp*, OrtShapeInferContext*);
  int (*GetStartVersion)(const OrtCustomOp*);
  int (*GetEndVersion)(const OrtCustomOp*);
  size_t (*GetMayInplace)(int**, int**);
  void (*ReleaseMayInplace)(int*, int*);
  size_t (*GetAliasMap)(int**, int**);
  void (*ReleaseAliasMap)(int*, int*);
};

}  // extern "C"

namespace ort {

constexpr uint32_t kApiVersion = 17;  // KernelContext_ParallelFor arrived in version 17

// Index of each function in the OrtApi table.
enum : size_t {
  kCreateStatus = 0,
  kGetErrorMessage = 2,
  kCreateCustomOpDomain = 26,
  kCustomOpDomainAdd = 27,
  kAddCustomOpDomain = 28,
  kGetTensorMutableData = 51,
  kGetTensorElementType = 60,
  kGetDimensionsCount = 61,
  kGetDimensions = 62,
  kGetTensorTypeAndShape = 65,
  kKernelInfoGetAttributeInt64 = 86,
  kKernelContextGetInputCount = 88,
  kKernelContextGetInput = 90,
  kKernelContextGetOutput = 91,
  kReleaseStatus = 93,
  kReleaseTensorTypeAndShapeInfo = 99,
  kKernelInfoGetInputCount = 230,
  kKernelInfoGetConstantInputTensor = 249,
  kKernelContextParallelFor = 274,
};

// Typed access to the table.
struct Api {
  const void* const* table = nullptr;

  template <typename F>
  F fn(size_t index) const { return reinterpret_cast<F>(const_cast<void*>(table[index])); }

  OrtStatus* status(const char* message) const {
    return fn<OrtStatus* (*)(OrtErrorCode, const char*)>(kCreateStatus)(ORT_INVALID_ARGUMENT, message);
  }
  OrtStatus* create_domain(const char* name, OrtCustomOpDomain** out) const {
    return fn<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(kCreateCustomOpDomain)(name, out);
  }
  OrtStatus* domain_add(OrtCustomOpDomain* domain, const OrtCustomOp* op) const {
    return fn<OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*)>(kCustomOpDomainAdd)(domain, op);
  }
  OrtStatus* add_domain(OrtSessionOptions* options, OrtCustomOpDomain* domain) const {
    return fn<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(kAddCustomOpDomain)(options, domain);
  }
  OrtStatus* data(OrtValue* value, void** out) const {
    return fn<OrtStatus* (*)(OrtValue*, void**)>(kGetTensorMutableData)(value, out);
  }
  OrtStatus* type_and_shape(const OrtValue* value, OrtTensorTypeAndShapeInfo** out) const {
    return fn<OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**)>(kGetTensorTypeAndShape)(value, out);
  }
  OrtStatus* element_type(const OrtTensorTypeAndShapeInfo* info, ONNXTensorElementDataType* out) const {
    return fn<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, ONNXTensorElementDataType*)>(kGetTensorElementType)(
        info, out);
  }
  OrtStatus* dims_count(const OrtTensorTypeAndShapeInfo* info, size_t* out) const {
    return fn<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*)>(kGetDimensionsCount)(info, out);
  }
  OrtStatus* dims(const OrtTensorTypeAndShapeInfo* info, int64_t* out, size_t n) const {
    return fn<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t)>(kGetDimensions)(info, out, n);
  }
  void release_info(OrtTensorTypeAndShapeInfo* info) const {
    fn<void (*)(OrtTensorTypeAndShapeInfo*)>(kReleaseTensorTypeAndShapeInfo)(info);
  }
  void release_status(OrtStatus* s) const { fn<void (*)(OrtStatus*)>(kReleaseStatus)(s); }
  OrtStatus* attribute(const OrtKernelInfo* info, const char* name, int64_t* out) const {
    return fn<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttributeInt64)(info, name,
                                                                                                         out);
  }
  OrtStatus* info_input_count(const OrtKernelInfo* info, size_t* out) const {
    return fn<OrtStatus* (*)(const OrtKernelInfo*, size_t*)>(kKernelInfoGetInputCount)(info, out);
  }
  OrtStatus* constant_input(const OrtKernelInfo* info, size_t index, int* is_constant, const OrtValue** out) const {
    return fn<OrtStatus* (*)(const OrtKernelInfo*, size_t, int*, const OrtValue**)>(
        kKernelInfoGetConstantInputTensor)(info, index, is_constant, out);
  }
  OrtStatus* input_count(const OrtKernelContext* ctx, size_t* out) const {
    return fn<OrtStatus* (*)(const OrtKernelContext*, size_t*)>(kKernelContextGetInputCount)(ctx, out);
  }
  OrtStatus* input(const OrtKernelContext* ctx, size_t index, const OrtValue** out) const {
    return fn<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(kKernelContextGetInput)(ctx, index,
                                                                                                        out);
  }
  OrtStatus* output(OrtKernelContext* ctx, size_t index, const int64_t* dims, size_t n, OrtValue** out) const {
    return fn<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(
        kKernelContextGetOutput)(ctx, index, dims, n, out);
  }
  OrtStatus* parallel_for(const OrtKernelContext* ctx, void (*f)(void*, size_t), size_t total, void* user) const {
    return fn<OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*)>(
        kKernelContextParallelFor)(ctx, f, total, 0, user);
  }
};

}  // namespace ort
