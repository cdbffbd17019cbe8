// The boundary between the wire contract and the engine: turns a
// SampleRequest into validated SamplingParams / RowSpecs (every rule of
// docs/api.md, INVALID_ARGUMENT naming the field and the expected value, then
// UNIMPLEMENTED for controls the backend lacks) and engine results back into
// a SampleResponse. Pure functions of their inputs (and of the registered
// shared-memory regions a request names); never blocks.
#ifndef FLASHSAMPLER_SERVICE_SERVING_REQUEST_CODEC_H_
#define FLASHSAMPLER_SERVICE_SERVING_REQUEST_CODEC_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/thread_pool.h"
#include "flashsampler/v1/sampler.pb.h"
#include "service/backends/sampling_params.h"
#include "service/serving/server_options.h"
#include "service/serving/shared_memory.h"

namespace flashsampler {

// What a request is validated against.
struct CodecConfig {
  int64_t vocab_size = 0;   // V of the loaded weights
  int64_t hidden_size = 0;  // D of the loaded weights
  int max_batch_rows = 0;   // largest B per request
  // dtype the engine computes in (EngineInfo::input_dtype): hidden states
  // must stay finite after the conversion into it (fp32 -> fp16 overflows
  // above 65504, fp32 -> bf16 just below FLT_MAX).
  DType input_dtype = DType::kFp32;
  RequestLimits limits;
  std::string backend;  // named in UNIMPLEMENTED messages
  // Regions Tensor.shared_memory may name; null = none may be named
  // (FAILED_PRECONDITION). Must outlive every decode.
  const SharedMemoryRegistry* shared_memory = nullptr;
  // EngineInfo::supported_controls.
  std::vector<std::string> supported_controls;
  // True where the decoded request goes to a Batcher, which checks the rows
  // as it copies them into the batch (CopyFinitePieces): rows already in
  // input_dtype are then left unchecked here, as DecodedRequest's
  // hidden_pieces (a 2 MB request's bytes are read once instead of twice).
  bool rows_checked_when_copied = false;
};

// A validated request. `hidden` and the params' allowed bitmasks point into
// the SampleRequest, so the request must outlive this object; `specs` point
// into `params`, whose heap buffer survives moves of this struct.
struct DecodedRequest {
  int rows = 0;
  DType dtype = DType::kFp32;    // dtype of `hidden` on the wire
  const void* hidden = nullptr;  // rows x D elements of dtype
  // Set instead of `hidden` when the request's data came in pieces
  // (DecodeSampleRequest with `data`) and needs no conversion, or when
  // config.rows_checked_when_copied leaves the check of rows that need none
  // to the batch: the rows' bytes, in order, already in config.input_dtype.
  std::vector<absl::string_view> hidden_pieces;
  // The pieces gathered, when they must be converted: `hidden` points here.
  std::string gathered;
  // Set instead of `hidden` and `hidden_pieces` when the rows' bytes, in
  // config.input_dtype, are in a shared-memory region: the batch copies
  // them and checks they are finite (CopyFiniteRows).
  SharedBytes shared;
  // The bytes copied out of a shared-memory region when they must be
  // converted: `hidden` points here, and they have been checked.
  std::unique_ptr<char[]> shared_copy;
  std::vector<SamplingParams> params;  // 1 (broadcast) or `rows` entries
  std::vector<uint64_t> seeds;         // rows; drawn by the server if absent
  std::vector<RowSpec> specs;          // rows
  int n = 1;                           // samples per row (same for all rows)
  LogprobRequest logprobs;             // same for all rows
};

// Validates `request` and fills `out`. Missing seeds are drawn from a
// per-thread absl::BitGen (64 bits each). Returns INVALID_ARGUMENT or
// UNIMPLEMENTED with a message that names the offending field.
absl::Status DecodeSampleRequest(const v1::SampleRequest& request,
                                 const CodecConfig& config,
                                 DecodedRequest* out);

// The same for a request parsed without its hidden states' bytes
// (request_wire.h): request.hidden_states().data() is ignored and `data`,
// views that must outlive `out`, holds them instead. With a `pool`, the
// rows' controls are decoded on its workers and the calling thread (for
// requests whose row_params are large enough to gain: RowsWorthAPool);
// the result is the same.
absl::Status DecodeSampleRequest(const v1::SampleRequest& request,
                                 const std::vector<absl::string_view>& data,
                                 const CodecConfig& config, DecodedRequest* out,
                                 ThreadPool* pool = nullptr);

// Fills `response` (request_id, n, token_ids, seeds, logprob fields) from one
// result per row. INTERNAL if the engine returned a malformed result (a bug,
// reported rather than sent).
absl::Status EncodeSampleResponse(const v1::SampleRequest& request,
                                  const DecodedRequest& decoded,
                                  const std::vector<RowResult>& results,
                                  v1::SampleResponse* response);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_SERVING_REQUEST_CODEC_H_
