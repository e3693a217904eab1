// llama.cpp's own matmul, timed the way tools/bench_kernel.py times kiln's kernel: y (M, N) = x (M, K) @ W, W in one
// of ggml's quantized types, on ggml's CPU backend with the weights where llama.cpp puts them (its repacked,
// interleaved buffer when the CPU backend has one for the type and the ISA, else the plain CPU buffer).
//
//   ggml_matmul TYPE K N M COPIES THREADS SECONDS
//
// TYPE: q4_0, q4_k, q8_0. COPIES matmuls run one after another in one graph, each on its own copy of the weights
// (more copies than the last-level cache holds: the weights come from memory, as in a model), all reading x.
// Prints one line: "<median seconds per matmul> <buffer the weights went to>".
// Built by tools/bench_kernel.py against the llama.cpp that tools/llama_cpp.py builds (not shipped with kiln).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

static ggml_type parse_type(const std::string& name) {
  if (name == "q4_0") return GGML_TYPE_Q4_0;
  if (name == "q4_k") return GGML_TYPE_Q4_K;
  if (name == "q8_0") return GGML_TYPE_Q8_0;
  std::fprintf(stderr, "ggml_matmul: type %s is not q4_0, q4_k or q8_0\n", name.c_str());
  std::exit(2);
}

// the CPU backend's extra buffer type that repacks weights (CPU_REPACK), or null
static ggml_backend_buffer_type_t repack_buffer_type(ggml_backend_dev_t dev) {
  auto get = (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(
      ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts");
  if (!get) return nullptr;
  for (ggml_backend_buffer_type_t* b = get(dev); b && *b; ++b) {
    if (std::strstr(ggml_backend_buft_name(*b), "REPACK")) return *b;
  }
  return nullptr;
}

int main(int argc, char** argv) {
  if (argc != 8) {
    std::fprintf(stderr, "usage: ggml_matmul TYPE K N M COPIES THREADS SECONDS\n");
    return 2;
  }
  const ggml_type type = parse_type(argv[1]);
  const int64_t k = std::atoll(argv[2]), n = std::atoll(argv[3]), m = std::atoll(argv[4]);
  const int copies = std::atoi(argv[5]), threads = std::atoi(argv[6]);
  const double seconds = std::atof(argv[7]);

  ggml_log_set([](ggml_log_level, const char*, void*) {}, nullptr);  // the repacking buffer logs every tensor
  ggml_backend_t cpu = ggml_backend_cpu_init();
  ggml_backend_cpu_set_n_threads(cpu, threads);
  ggml_threadpool_params tpp = ggml_threadpool_params_default(threads);
  ggml_threadpool* pool = ggml_threadpool_new(&tpp);  // one pool for every compute, as a llama.cpp context keeps
  ggml_backend_cpu_set_threadpool(cpu, pool);
  ggml_backend_dev_t dev = ggml_backend_get_device(cpu);

  // the weights: one quantized matrix (N rows of K), copied into every copy's tensor
  std::vector<float> w(size_t(k * n));
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  for (float& v : w) v = normal(rng);
  std::vector<uint8_t> q(ggml_row_size(type, k) * size_t(n));
  ggml_quantize_chunk(type, w.data(), q.data(), 0, n, k, nullptr);

  // where llama.cpp would put them: the repacking buffer when it has a layout for this type, shape and ISA (a probe
  // tensor tells: the buffer leaves its traits null otherwise), else the CPU buffer
  ggml_backend_buffer_type_t buft = ggml_backend_cpu_buffer_type();
  if (ggml_backend_buffer_type_t repack = repack_buffer_type(dev)) {
    ggml_init_params pp = {ggml_tensor_overhead(), nullptr, true};
    ggml_context* probe = ggml_init(pp);
    ggml_tensor* t = ggml_new_tensor_2d(probe, type, k, n);
    ggml_backend_buffer_t b = ggml_backend_alloc_ctx_tensors_from_buft(probe, repack);
    if (b && t->extra) buft = repack;
    if (b) ggml_backend_buffer_free(b);
    ggml_free(probe);
  }
  ggml_init_params wp = {ggml_tensor_overhead() * size_t(copies + 1), nullptr, true};
  ggml_context* wctx = ggml_init(wp);
  std::vector<ggml_tensor*> ws;
  for (int i = 0; i < copies; ++i) ws.push_back(ggml_new_tensor_2d(wctx, type, k, n));
  ggml_backend_buffer_t wbuf = ggml_backend_alloc_ctx_tensors_from_buft(wctx, buft);
  if (!wbuf) {
    std::fprintf(stderr, "ggml_matmul: cannot allocate %d copies of the weights\n", copies);
    return 1;
  }
  const std::string where = ggml_backend_buft_name(buft);
  for (ggml_tensor* t : ws) ggml_backend_tensor_set(t, q.data(), 0, q.size());

  const size_t graph_size = size_t(copies) + 16;
  ggml_init_params gp = {ggml_tensor_overhead() * (graph_size + 4) + ggml_graph_overhead_custom(graph_size, false),
                         nullptr, true};
  ggml_context* gctx = ggml_init(gp);
  ggml_tensor* x = ggml_new_tensor_2d(gctx, GGML_TYPE_F32, k, m);
  ggml_set_input(x);
  ggml_cgraph* graph = ggml_new_graph_custom(gctx, graph_size, false);
  for (ggml_tensor* t : ws) {
    ggml_tensor* y = ggml_mul_mat(gctx, t, x);
    ggml_set_output(y);
    ggml_build_forward_expand(graph, y);
  }
  ggml_gallocr_t alloc = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
  if (!ggml_gallocr_alloc_graph(alloc, graph)) {
    std::fprintf(stderr, "ggml_matmul: cannot allocate the graph\n");
    return 1;
  }
  std::vector<float> xs(size_t(k * m));
  for (float& v : xs) v = normal(rng);
  ggml_backend_tensor_set(x, xs.data(), 0, xs.size() * sizeof(float));

  for (int i = 0; i < 3; ++i) ggml_backend_graph_compute(cpu, graph);
  std::vector<double> times;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end || times.size() < 5) {
    const auto t0 = std::chrono::steady_clock::now();
    ggml_backend_graph_compute(cpu, graph);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / copies);
  }
  std::sort(times.begin(), times.end());
  std::printf("%.9f %s\n", times[times.size() / 2], where.c_str());

  ggml_gallocr_free(alloc);
  ggml_free(gctx);
  ggml_backend_buffer_free(wbuf);
  ggml_free(wctx);
  ggml_backend_free(cpu);
  ggml_threadpool_free(pool);
  return 0;
}
