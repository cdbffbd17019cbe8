// Fuzz target: SampleRequest bytes -> proto parse -> DecodeSampleRequest ->
// the rows handed to the CPU engine -> EncodeSampleResponse. Nothing may
// crash; an accepted request must decode into consistent rows (count, bytes,
// per-row params, seeds and steps) and sample into a response that encodes.
// The first input byte picks the codec configuration; the rest is the proto.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "common/dtype_convert.h"
#include "flashsampler/v1/sampler.pb.h"
#include "google/protobuf/stubs/logging.h"
#include "service/backends/cpu/cpu_engine.h"
#include "service/serving/request_codec.h"
#include "tests/fuzz/fuzz_check.h"

namespace flashsampler {
namespace {

// Small enough for tens of thousands of runs a second; V is not a multiple
// of the CPU sampler's 256-row tile, so partial tiles are exercised.
constexpr int64_t kVocab = 300;
constexpr int64_t kHidden = 8;
constexpr int kMaxRows = 8;

CpuEngine& Engine() {
  static CpuEngine* engine = [] {
    auto w = std::make_shared<std::vector<float>>(kVocab * kHidden);
    for (size_t i = 0; i < w->size(); ++i) {
      (*w)[i] = static_cast<float>(static_cast<int>(i * 7919 % 97) - 48) / 64;
    }
    CpuEngineOptions options;
    options.sampler.threads = 1;
    options.max_batch_rows = kMaxRows;
    auto created =
        CpuEngine::CreateFromFloat(w, kVocab, kHidden, DType::kFp32, options);
    FUZZ_CHECK(created.ok(), "%s", created.status().ToString().c_str());
    return created->release();
  }();
  return *engine;
}

void CheckDecoded(const v1::SampleRequest& request, const CodecConfig& config,
                  const DecodedRequest& decoded) {
  const v1::Tensor& tensor = request.hidden_states();
  FUZZ_CHECK(decoded.rows >= 1 && decoded.rows <= config.max_batch_rows,
             "rows %d", decoded.rows);
  FUZZ_CHECK(tensor.shape_size() == 2 && tensor.shape(0) == decoded.rows &&
                 tensor.shape(1) == config.hidden_size,
             "shape disagrees with %d rows", decoded.rows);
  FUZZ_CHECK(tensor.data().size() ==
                 decoded.rows * config.hidden_size * DTypeSize(decoded.dtype),
             "%zu data bytes for %d rows", tensor.data().size(), decoded.rows);
  FUZZ_CHECK(decoded.hidden == tensor.data().data(), "hidden not in request");
  FUZZ_CHECK(AllFinite(decoded.dtype, decoded.hidden,
                       decoded.rows * config.hidden_size),
             "non-finite hidden state accepted");
  FUZZ_CHECK(decoded.params.size() == 1 ||
                 decoded.params.size() == static_cast<size_t>(decoded.rows),
             "%zu params for %d rows", decoded.params.size(), decoded.rows);
  FUZZ_CHECK(decoded.seeds.size() == static_cast<size_t>(decoded.rows) &&
                 decoded.specs.size() == static_cast<size_t>(decoded.rows),
             "seeds/specs sizes");
  FUZZ_CHECK(decoded.n >= 1 && decoded.n <= config.limits.max_samples_per_row,
             "n %d", decoded.n);
  for (int r = 0; r < decoded.rows; ++r) {
    const RowSpec& spec = decoded.specs[r];
    FUZZ_CHECK(spec.params >= decoded.params.data() &&
                   spec.params < decoded.params.data() + decoded.params.size(),
               "row %d params outside the decoded params", r);
    FUZZ_CHECK(spec.params->n == decoded.n, "row %d n", r);
    if (request.seeds_size() != 0) {
      FUZZ_CHECK(spec.seed == request.seeds(r), "row %d seed", r);
    }
    FUZZ_CHECK(spec.step == (request.steps_size() != 0 ? request.steps(r) : 0),
               "row %d step", r);
  }
}

void SampleAndEncode(const v1::SampleRequest& request,
                     const CodecConfig& config, const DecodedRequest& decoded) {
  CpuEngine& engine = Engine();
  ConvertDType(decoded.dtype, decoded.hidden,
               static_cast<size_t>(decoded.rows * config.hidden_size),
               DType::kFp32, engine.slot_input(0));
  BatchView batch;
  batch.slot = 0;
  batch.rows = decoded.rows;
  batch.specs = decoded.specs.data();
  std::vector<RowResult> results;
  const absl::Status sampled = engine.Sample(batch, &results);
  FUZZ_CHECK(sampled.ok(), "Sample: %s", sampled.ToString().c_str());
  FUZZ_CHECK(results.size() == static_cast<size_t>(decoded.rows),
             "%zu results for %d rows", results.size(), decoded.rows);
  for (const RowResult& row : results) {
    if (!row.error.empty()) return;  // the server answers INVALID_ARGUMENT
    FUZZ_CHECK(row.token_ids.size() == static_cast<size_t>(decoded.n),
               "%zu tokens, n = %d", row.token_ids.size(), decoded.n);
    for (int32_t id : row.token_ids) {
      FUZZ_CHECK(id >= 0 && id < kVocab, "token id %d", id);
    }
  }
  v1::SampleResponse response;
  const absl::Status encoded =
      EncodeSampleResponse(request, decoded, results, &response);
  FUZZ_CHECK(encoded.ok(), "Encode: %s", encoded.ToString().c_str());
  FUZZ_CHECK(response.token_ids_size() == decoded.rows * decoded.n,
             "%d token ids for %d x %d", response.token_ids_size(),
             decoded.rows, decoded.n);
}

}  // namespace
}  // namespace flashsampler

// Protobuf logs every string field with invalid UTF-8 it refuses to parse:
// noise at thousands of inputs a second.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace flashsampler;
  if (size < 1) return 0;
  const uint8_t mode = data[0];
  v1::SampleRequest request;
  if (!request.ParseFromArray(data + 1, static_cast<int>(size - 1))) return 0;
  CodecConfig config;
  config.vocab_size = kVocab;
  config.hidden_size = kHidden;
  config.max_batch_rows = kMaxRows;
  // The engines' input dtypes: fp32 (CPU), bf16 or fp16 (CUDA).
  static const DType kInput[] = {DType::kFp32, DType::kBf16, DType::kFp16};
  config.input_dtype = kInput[mode % 3];
  config.backend = "fuzz";
  // Every control (the CPU backend), or only the CUDA backend's.
  if ((mode & 4) == 0) {
    config.supported_controls = AllSamplingControls();
  } else {
    config.supported_controls = {"temperature", "n"};
  }
  DecodedRequest decoded;
  const absl::Status status = DecodeSampleRequest(request, config, &decoded);
  if (!status.ok()) {
    FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument ||
                   status.code() == absl::StatusCode::kUnimplemented,
               "refused with %s", status.ToString().c_str());
    FUZZ_CHECK(!status.message().empty(), "refusal without a message");
    return 0;
  }
  CheckDecoded(request, config, decoded);
  // The CPU engine computes in fp32 and implements every control.
  if (config.input_dtype == DType::kFp32 && (mode & 4) == 0) {
    SampleAndEncode(request, config, decoded);
  }
  return 0;
}
