// fs_tp_bench: tensor-parallel sampling, one run, one CSV. Compares TP1 fused
// (one GPU, whole vocabulary) with TPn fused over the NCCL device-API exchange,
// TPn fused over plain CUDA peer stores, and the TPn all-gather baseline
// (cuBLAS GEMM + ncclAllGather of logits + sampling), at each batch size.
// Method: per (mode, B) warm-up calls, then `runs` runs of `calls`
// back-to-back calls timed with CUDA events on rank 0 (every rank's stream
// joined into the stop event); reported: min and median over runs of the mean
// time per call. Tokens of every mode are checked against TP1's.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/baselines/allgather_baseline.h"
#include "kernels/baselines/bench_common.h"
#include "kernels/sampler/fused_sampler.h"
#include "kernels/tp/tp_exchange.h"
#include "kernels/tp/tp_layout.h"

namespace flashsampler {
namespace {

#define BENCH_CHECK_CUDA(expr)                                            \
  do {                                                                    \
    const cudaError_t bench_err_ = (expr);                                \
    if (bench_err_ != cudaSuccess) {                                      \
      std::fprintf(stderr, "fs_tp_bench: %s failed: %s (%s:%d)\n", #expr, \
                   cudaGetErrorString(bench_err_), __FILE__, __LINE__);   \
      std::exit(1);                                                       \
    }                                                                     \
  } while (0)

#define BENCH_CHECK_TP(expr)                                      \
  do {                                                            \
    const TpStatus bench_status_ = (expr);                        \
    if (!bench_status_.ok()) {                                    \
      std::fprintf(stderr, "fs_tp_bench: %s failed: %s\n", #expr, \
                   bench_status_.message.c_str());                \
      std::exit(1);                                               \
    }                                                             \
  } while (0)

struct Flags {
  std::vector<int> batches = {1, 16, 64, 256};
  int64_t vocab = 128256;
  int hidden = 8192;
  int runs = 5;
  int calls = 100;
  int warmup = 10;
  std::vector<int> devices = {0, 1};
  std::string split = "even";
  std::vector<std::string> modes = {"tp1", "nccl", "tiles", "peer",
                                    "allgather"};
  std::string csv = "tp_bench.csv";
  std::string kernel = "auto";
};

void Usage() {
  std::fprintf(
      stderr,
      "usage: fs_tp_bench [--batches=1,16,64,256] [--vocab=128256]\n"
      "  [--hidden=8192] [--runs=5] [--calls=100] [--warmup=10]\n"
      "  [--devices=0,1] [--split=even|60:40] [--kernel=auto|mma|wgmma]\n"
      "  [--modes=tp1,nccl,tiles,peer,allgather] [--csv=tp_bench.csv]\n");
}

bool ParseFlags(int argc, char** argv, Flags* f) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos) return false;
    const std::string key = arg.substr(2, eq - 2);
    const std::string value = arg.substr(eq + 1);
    if (key == "batches") {
      f->batches = SplitInts(value);
    } else if (key == "vocab") {
      f->vocab = std::atoll(value.c_str());
    } else if (key == "hidden") {
      f->hidden = std::atoi(value.c_str());
    } else if (key == "runs") {
      f->runs = std::atoi(value.c_str());
    } else if (key == "calls") {
      f->calls = std::atoi(value.c_str());
    } else if (key == "warmup") {
      f->warmup = std::atoi(value.c_str());
    } else if (key == "devices") {
      f->devices = SplitInts(value);
    } else if (key == "split") {
      f->split = value;
    } else if (key == "modes") {
      f->modes = SplitCommas(value);
    } else if (key == "csv") {
      f->csv = value;
    } else if (key == "kernel") {
      f->kernel = value;
    } else {
      return false;
    }
  }
  for (int b : f->batches) {
    if (b < 1 || b > kMaxFusedBatch) return false;
  }
  return !f->batches.empty() && f->vocab > 0 && f->hidden > 0 && f->runs > 0 &&
         f->calls > 0 && f->warmup >= 0 && !f->devices.empty();
}

// Deterministic pseudo-random fill on the device: value(i) uniform in
// [-scale, scale), from a 32-bit integer hash of (i, salt).
__device__ __forceinline__ uint32_t Hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

__global__ void FillBf16Kernel(__nv_bfloat16* out, int64_t count, uint64_t salt,
                               float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < count; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float u =
        static_cast<float>(
            Hash32(static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull ^ salt) >>
            8) *
        (1.0f / 16777216.0f);
    out[i] = __float2bfloat16((2.0f * u - 1.0f) * scale);
  }
}

void FillBf16(void* out, int64_t count, uint64_t salt, float scale) {
  FillBf16Kernel<<<1024, 256>>>(static_cast<__nv_bfloat16*>(out), count, salt,
                                scale);
  BENCH_CHECK_CUDA(cudaGetLastError());
}

// Per-rank device copies of one batch's inputs (identical on every rank).
struct RankInputs {
  void* weights = nullptr;  // this rank's shard (or whole W for TP1)
  void* hidden = nullptr;   // [kMaxFusedBatch][D]
  float* inv_temperature = nullptr;
  uint64_t* seeds = nullptr;
  uint64_t* steps = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int32_t* tokens = nullptr;  // [kMaxFusedBatch]
};

void AllocRowControls(RankInputs* in) {
  std::vector<float> inv_t(kMaxFusedBatch, 1.0f);
  std::vector<uint64_t> seeds(kMaxFusedBatch);
  std::vector<uint64_t> steps(kMaxFusedBatch);
  for (int b = 0; b < kMaxFusedBatch; ++b) {
    seeds[b] = 0x5eed0000ull + 7919ull * b;
    steps[b] = 3 + b;
  }
  BENCH_CHECK_CUDA(
      cudaMalloc(&in->inv_temperature, sizeof(float) * kMaxFusedBatch));
  BENCH_CHECK_CUDA(cudaMalloc(&in->seeds, sizeof(uint64_t) * kMaxFusedBatch));
  BENCH_CHECK_CUDA(cudaMalloc(&in->steps, sizeof(uint64_t) * kMaxFusedBatch));
  BENCH_CHECK_CUDA(cudaMalloc(&in->tokens, sizeof(int32_t) * kMaxFusedBatch));
  BENCH_CHECK_CUDA(cudaMemcpy(in->inv_temperature, inv_t.data(),
                              sizeof(float) * kMaxFusedBatch,
                              cudaMemcpyHostToDevice));
  BENCH_CHECK_CUDA(cudaMemcpy(in->seeds, seeds.data(),
                              sizeof(uint64_t) * kMaxFusedBatch,
                              cudaMemcpyHostToDevice));
  BENCH_CHECK_CUDA(cudaMemcpy(in->steps, steps.data(),
                              sizeof(uint64_t) * kMaxFusedBatch,
                              cudaMemcpyHostToDevice));
}

FusedSampleParams ParamsFor(const RankInputs& in, int64_t rows, int64_t offset,
                            int hidden, int batch, FusedKernel kernel) {
  FusedSampleParams p;
  p.weights = in.weights;
  p.hidden = in.hidden;
  p.dtype = DType::kBf16;
  p.vocab_rows = rows;
  p.vocab_offset = offset;
  p.hidden_size = hidden;
  p.batch = batch;
  // H holds kMaxFusedBatch rows: every batch's rows rounded up to a tile.
  p.hidden_capacity_rows = kMaxFusedBatch;
  p.num_samples = 1;
  p.inv_temperature = in.inv_temperature;
  p.seeds = in.seeds;
  p.steps = in.steps;
  p.tuning.kernel = kernel;
  return p;
}

struct Timing {
  double min_us = 0;
  double median_us = 0;
};

// Times `runs` runs of `calls` calls of `step`, each run bracketed by events
// on rank 0's stream that every other rank's stream joins.
Timing TimeRuns(const std::function<void()>& step,
                const std::vector<int>& devices,
                const std::vector<cudaStream_t>& streams, int warmup, int runs,
                int calls) {
  const int n = static_cast<int>(streams.size());
  for (int i = 0; i < warmup; ++i) step();
  std::vector<cudaEvent_t> done(n, nullptr);
  for (int r = 1; r < n; ++r) {
    BENCH_CHECK_CUDA(cudaSetDevice(devices[r]));
    BENCH_CHECK_CUDA(
        cudaEventCreateWithFlags(&done[r], cudaEventDisableTiming));
  }
  BENCH_CHECK_CUDA(cudaSetDevice(devices[0]));
  cudaEvent_t start, stop;
  BENCH_CHECK_CUDA(cudaEventCreate(&start));
  BENCH_CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<double> per_call;
  for (int run = 0; run < runs; ++run) {
    BENCH_CHECK_CUDA(cudaSetDevice(devices[0]));
    BENCH_CHECK_CUDA(cudaEventRecord(start, streams[0]));
    for (int r = 1; r < n; ++r) {
      BENCH_CHECK_CUDA(cudaStreamWaitEvent(streams[r], start, 0));
    }
    for (int i = 0; i < calls; ++i) step();
    for (int r = 1; r < n; ++r) {
      BENCH_CHECK_CUDA(cudaSetDevice(devices[r]));
      BENCH_CHECK_CUDA(cudaEventRecord(done[r], streams[r]));
      BENCH_CHECK_CUDA(cudaSetDevice(devices[0]));
      BENCH_CHECK_CUDA(cudaStreamWaitEvent(streams[0], done[r], 0));
    }
    BENCH_CHECK_CUDA(cudaEventRecord(stop, streams[0]));
    BENCH_CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    BENCH_CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    per_call.push_back(1000.0 * ms / calls);
  }
  BENCH_CHECK_CUDA(cudaEventDestroy(start));
  BENCH_CHECK_CUDA(cudaEventDestroy(stop));
  for (int r = 1; r < n; ++r) {
    BENCH_CHECK_CUDA(cudaSetDevice(devices[r]));
    BENCH_CHECK_CUDA(cudaEventDestroy(done[r]));
  }
  BENCH_CHECK_CUDA(cudaSetDevice(devices[0]));
  std::sort(per_call.begin(), per_call.end());
  return Timing{per_call.front(), per_call[per_call.size() / 2]};
}

std::vector<int32_t> Tokens(int device, const int32_t* tokens, int batch) {
  std::vector<int32_t> host(batch);
  BENCH_CHECK_CUDA(cudaSetDevice(device));
  BENCH_CHECK_CUDA(cudaMemcpy(host.data(), tokens, sizeof(int32_t) * batch,
                              cudaMemcpyDeviceToHost));
  return host;
}

int Mismatches(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  int count = 0;
  for (size_t i = 0; i < a.size(); ++i) count += a[i] != b[i];
  return count;
}

struct Row {
  std::string mode;
  int tp = 1;
  int batch = 0;
  Timing t;
  int mismatches = 0;
};

int Main(int argc, char** argv) {
  DisableNvlinkMulticastEnv();
  Flags flags;
  if (!ParseFlags(argc, argv, &flags)) {
    Usage();
    return 2;
  }
  FusedKernel kernel = FusedKernel::kAuto;
  if (flags.kernel == "mma") kernel = FusedKernel::kMmaSync;
  if (flags.kernel == "wgmma") kernel = FusedKernel::kWgmma;

  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count < 1) {
    std::fprintf(stderr, "NEEDS a GPU: fs_tp_bench found none\n");
    return 1;
  }
  const int tp = static_cast<int>(flags.devices.size());
  for (int d : flags.devices) {
    if (d >= device_count) {
      std::fprintf(stderr,
                   "NEEDS %d GPUs: skipping the TP%d modes (%d visible)\n", tp,
                   tp, device_count);
      flags.modes = {"tp1"};
      flags.devices = {0};
      break;
    }
  }
  const std::vector<int>& devices = flags.devices;
  const int ranks = static_cast<int>(devices.size());
  const int64_t V = flags.vocab;
  const int D = flags.hidden;
  const int tile_rows = FusedSampleTileRows();

  std::vector<int64_t> parts;
  std::string error;
  TpLayout layout;
  if (!ParseTpSplit(flags.split, ranks, &parts, &error) ||
      !MakeTpLayout(V, parts, tile_rows, &layout, &error)) {
    std::fprintf(stderr, "fs_tp_bench: %s\n", error.c_str());
    return 2;
  }

  cudaDeviceProp prop;
  BENCH_CHECK_CUDA(cudaGetDeviceProperties(&prop, devices[0]));
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d", std::gmtime(&now));
  std::fprintf(stderr,
               "fs_tp_bench: %s x%d, V=%lld D=%d split=%s tile_rows=%d, %d "
               "runs x %d calls, %s\n",
               prop.name, ranks, static_cast<long long>(V), D,
               flags.split.c_str(), tile_rows, flags.runs, flags.calls, date);

  // Whole W on rank 0 (TP1) and each rank's shard, same values.
  const float w_scale = 0.05f;
  RankInputs full;
  BENCH_CHECK_CUDA(cudaSetDevice(devices[0]));
  BENCH_CHECK_CUDA(cudaMalloc(&full.weights, sizeof(__nv_bfloat16) * V * D));
  FillBf16(full.weights, V * D, 0x11, w_scale);
  BENCH_CHECK_CUDA(
      cudaMalloc(&full.hidden, sizeof(__nv_bfloat16) * kMaxFusedBatch * D));
  FillBf16(full.hidden, int64_t{kMaxFusedBatch} * D, 0x22, 1.0f);
  AllocRowControls(&full);
  full.workspace_bytes = FusedSampleWorkspaceSize(kMaxFusedBatch, V, D);
  if (full.workspace_bytes > 0) {
    BENCH_CHECK_CUDA(cudaMalloc(&full.workspace, full.workspace_bytes));
    BENCH_CHECK_CUDA(cudaMemset(full.workspace, 0, full.workspace_bytes));
  }
  Candidate* tp1_candidates = nullptr;
  BENCH_CHECK_CUDA(
      cudaMalloc(&tp1_candidates,
                 sizeof(Candidate) * FusedSampleNumTiles(V) * kMaxFusedBatch));
  BENCH_CHECK_CUDA(cudaDeviceSynchronize());

  std::vector<RankInputs> shard(ranks);
  std::vector<cudaStream_t> streams(ranks);
  for (int r = 0; r < ranks; ++r) {
    const TpShard& s = layout.shards[r];
    BENCH_CHECK_CUDA(cudaSetDevice(devices[r]));
    BENCH_CHECK_CUDA(
        cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
    BENCH_CHECK_CUDA(cudaMalloc(&shard[r].weights,
                                sizeof(__nv_bfloat16) * s.vocab_rows * D));
    BENCH_CHECK_CUDA(cudaMemcpyPeer(
        shard[r].weights, devices[r],
        static_cast<const __nv_bfloat16*>(full.weights) + s.vocab_offset * D,
        devices[0], sizeof(__nv_bfloat16) * s.vocab_rows * D));
    BENCH_CHECK_CUDA(cudaMalloc(&shard[r].hidden,
                                sizeof(__nv_bfloat16) * kMaxFusedBatch * D));
    BENCH_CHECK_CUDA(
        cudaMemcpyPeer(shard[r].hidden, devices[r], full.hidden, devices[0],
                       sizeof(__nv_bfloat16) * kMaxFusedBatch * D));
    AllocRowControls(&shard[r]);
    shard[r].workspace_bytes =
        FusedSampleWorkspaceSize(kMaxFusedBatch, s.vocab_rows, D);
    if (shard[r].workspace_bytes > 0) {
      BENCH_CHECK_CUDA(
          cudaMalloc(&shard[r].workspace, shard[r].workspace_bytes));
      BENCH_CHECK_CUDA(
          cudaMemset(shard[r].workspace, 0, shard[r].workspace_bytes));
    }
    BENCH_CHECK_CUDA(cudaDeviceSynchronize());
  }

  auto has_mode = [&](const std::string& m) {
    return std::find(flags.modes.begin(), flags.modes.end(), m) !=
           flags.modes.end();
  };
  std::unique_ptr<TpComms> comms;
  std::unique_ptr<TpExchange> nccl_ex, nccl_tiles_ex, peer_ex;
  std::unique_ptr<AllGatherBaseline> baseline;
  TpExchangeOptions ex_options;
  ex_options.max_batch = kMaxFusedBatch;
  if (ranks > 1 &&
      (has_mode("nccl") || has_mode("tiles") || has_mode("allgather"))) {
    BENCH_CHECK_TP(TpComms::Create(devices, &comms));
  }
  if (ranks > 1 && has_mode("nccl")) {
    ex_options.transport = TpTransport::kNcclDevice;
    BENCH_CHECK_TP(
        TpExchange::Create(devices, comms.get(), layout, ex_options, &nccl_ex));
  }
  if (ranks > 1 && has_mode("tiles")) {
    // The NCCL exchange with every tile's candidate sent to rank 0 instead
    // of each rank's winners (what the winners save).
    TpExchangeOptions tiles_options = ex_options;
    tiles_options.transport = TpTransport::kNcclDevice;
    tiles_options.send_shard_winners = false;
    BENCH_CHECK_TP(TpExchange::Create(devices, comms.get(), layout,
                                      tiles_options, &nccl_tiles_ex));
  }
  if (ranks > 1 && has_mode("peer")) {
    ex_options.transport = TpTransport::kCudaPeer;
    BENCH_CHECK_TP(
        TpExchange::Create(devices, nullptr, layout, ex_options, &peer_ex));
  }
  if (ranks > 1 && has_mode("allgather")) {
    AllGatherBaselineOptions options;
    options.hidden_size = D;
    BENCH_CHECK_TP(
        AllGatherBaseline::Create(comms.get(), layout, options, &baseline));
  }

  std::vector<Row> rows;
  for (int batch : flags.batches) {
    // TP1: the reference tokens of this batch size.
    const FusedSampleParams p1 = ParamsFor(full, V, 0, D, batch, kernel);
    const std::vector<int> dev0 = {devices[0]};
    const std::vector<cudaStream_t> s0 = {streams[0]};
    auto tp1_step = [&]() {
      FusedSampleParams p = p1;
      p.candidates = tp1_candidates;
      // Pruned against the workspace's floor, as every TP rank's kernel is.
      p.floor_in_workspace = full.workspace != nullptr;
      BENCH_CHECK_CUDA(cudaSetDevice(devices[0]));
      BENCH_CHECK_CUDA(LaunchFusedSample(p, full.workspace,
                                         full.workspace_bytes, streams[0]));
      BENCH_CHECK_CUDA(
          LaunchReduceCandidates(tp1_candidates, FusedSampleNumTiles(V), 1,
                                 batch, full.tokens, nullptr, streams[0]));
    };
    tp1_step();
    BENCH_CHECK_CUDA(cudaStreamSynchronize(streams[0]));
    const std::vector<int32_t> reference =
        Tokens(devices[0], full.tokens, batch);
    if (has_mode("tp1")) {
      Row row{
          "tp1_fused", 1, batch,
          TimeRuns(tp1_step, dev0, s0, flags.warmup, flags.runs, flags.calls),
          0};
      rows.push_back(row);
    }
    std::vector<FusedSampleParams> params(ranks);
    std::vector<void*> workspaces(ranks);
    std::vector<size_t> workspace_bytes(ranks);
    std::vector<int32_t*> tokens(ranks);
    for (int r = 0; r < ranks; ++r) {
      params[r] = ParamsFor(shard[r], layout.shards[r].vocab_rows,
                            layout.shards[r].vocab_offset, D, batch, kernel);
      workspaces[r] = shard[r].workspace;
      workspace_bytes[r] = shard[r].workspace_bytes;
      tokens[r] = shard[r].tokens;
    }
    const std::string tp_name = "tp" + std::to_string(ranks);
    for (TpExchange* ex : {nccl_ex.get(), nccl_tiles_ex.get(), peer_ex.get()}) {
      if (ex == nullptr) continue;
      auto step = [&]() {
        BENCH_CHECK_CUDA(ex->Step(params, workspaces, workspace_bytes, streams,
                                  shard[0].tokens, nullptr));
      };
      Row row;
      row.mode = tp_name + "_fused_" +
                 TpTransportName(ex->options().transport) +
                 (ex->options().send_shard_winners ? "" : "_tiles");
      row.tp = ranks;
      row.batch = batch;
      row.t = TimeRuns(step, devices, streams, flags.warmup, flags.runs,
                       flags.calls);
      if (ex->status() != TpBarrierResult::kOk) {
        std::fprintf(stderr, "fs_tp_bench: %s barrier %s\n", row.mode.c_str(),
                     TpBarrierResultName(ex->status()));
        return 1;
      }
      row.mismatches =
          Mismatches(reference, Tokens(devices[0], shard[0].tokens, batch));
      rows.push_back(row);
    }
    if (baseline != nullptr) {
      auto step = [&]() {
        BENCH_CHECK_TP(baseline->Step(params, tokens, streams));
      };
      Row row;
      row.mode = tp_name + "_allgather";
      row.tp = ranks;
      row.batch = batch;
      row.t = TimeRuns(step, devices, streams, flags.warmup, flags.runs,
                       flags.calls);
      // bf16 logits differ from the fused kernel's fp32 ones, so a few
      // tokens may differ; reported for information, not as a failure.
      row.mismatches =
          Mismatches(reference, Tokens(devices[0], shard[0].tokens, batch));
      rows.push_back(row);
    }
  }

  FILE* csv = std::fopen(flags.csv.c_str(), "w");
  if (csv == nullptr) {
    std::fprintf(stderr, "fs_tp_bench: cannot write %s\n", flags.csv.c_str());
    return 1;
  }
  std::fprintf(csv,
               "device,gpus,date,mode,tp,batch,vocab,hidden,split,runs,calls,"
               "us_min,us_median,speedup_vs_tp1,ratio_vs_allgather,"
               "token_mismatches_vs_tp1\n");
  std::printf("%-22s %5s %10s %10s %12s %12s %10s\n", "mode", "B", "us_min",
              "us_median", "x_vs_tp1", "vs_allgather", "mismatch");
  for (const Row& row : rows) {
    double tp1 = 0, allgather = 0;
    for (const Row& other : rows) {
      if (other.batch != row.batch) continue;
      if (other.mode == "tp1_fused") tp1 = other.t.min_us;
      if (other.mode.find("_allgather") != std::string::npos) {
        allgather = other.t.min_us;
      }
    }
    const double speedup = tp1 > 0 ? tp1 / row.t.min_us : 0;
    const double vs_allgather = allgather > 0 ? row.t.min_us / allgather : 0;
    std::fprintf(csv,
                 "\"%s\",%d,%s,%s,%d,%d,%lld,%d,%s,%d,%d,%.2f,%.2f,%.3f,"
                 "%.3f,%d\n",
                 prop.name, ranks, date, row.mode.c_str(), row.tp, row.batch,
                 static_cast<long long>(V), D, flags.split.c_str(), flags.runs,
                 flags.calls, row.t.min_us, row.t.median_us, speedup,
                 vs_allgather, row.mismatches);
    std::printf("%-22s %5d %10.1f %10.1f %12.3f %12.3f %10d\n",
                row.mode.c_str(), row.batch, row.t.min_us, row.t.median_us,
                speedup, vs_allgather, row.mismatches);
  }
  std::fclose(csv);
  std::fflush(stdout);

  // Fused TP modes must reproduce TP1's tokens exactly
  // (docs/design.md#invariance).
  int fused_mismatches = 0;
  for (const Row& row : rows) {
    if (row.mode.find("_fused_") != std::string::npos) {
      fused_mismatches += row.mismatches;
    }
  }
  for (int r = 0; r < ranks; ++r) {
    BENCH_CHECK_CUDA(cudaSetDevice(devices[r]));
    BENCH_CHECK_CUDA(cudaStreamSynchronize(streams[r]));
  }
  baseline.reset();
  nccl_ex.reset();
  nccl_tiles_ex.reset();
  peer_ex.reset();
  comms.reset();
  if (fused_mismatches != 0) {
    std::fprintf(stderr,
                 "fs_tp_bench: FAIL: %d fused TP tokens differ from TP1\n",
                 fused_mismatches);
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace flashsampler

int main(int argc, char** argv) {
  // Before anything can initialise NCCL: never NVLink multicast
  // (docs/design.md#tensor-parallelism).
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
  setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1", 1);
  return flashsampler::Main(argc, argv);
}
