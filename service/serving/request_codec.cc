// Validation of SampleRequest and encoding of SampleResponse. Every check
// names the field the way a caller wrote it ("row_params[3].top_p") and the
// value expected, because a message like "invalid argument" costs an
// integration engineer an afternoon. The sampling controls are checked by
// ValidateSamplingParams (service/backends/sampling_params.h), the same
// check every engine applies.
#include "service/serving/request_codec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype_convert.h"
#include "common/field_violation.h"
#include "service/serving/request_wire.h"

// Tensor.data and allowed_token_bitmask_bytes are little-endian on the
// wire; the codec copies them as they are.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "flashsampler's request codec assumes a little-endian host");

namespace flashsampler {

namespace {

absl::Status Invalid(absl::string_view field, absl::string_view expected) {
  return FieldViolationError(field, expected);
}

absl::StatusOr<DType> FromProtoDType(int dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
      return DType::kBf16;
    case v1::DTYPE_FP16:
      return DType::kFp16;
    case v1::DTYPE_FP32:
      return DType::kFp32;
    default:
      return Invalid(
          "hidden_states.dtype",
          absl::StrCat("must be DTYPE_BF16, DTYPE_FP16 or "
                       "DTYPE_FP32, got ",
                       dtype == 0 ? "DTYPE_UNSPECIFIED" : absl::StrCat(dtype)));
  }
}

// Converts one SamplingParams message and validates it (field names
// prefixed by `prefix`, e.g. "params" or "row_params[2]").
absl::Status DecodeParams(const v1::SamplingParams& in,
                          const std::string& prefix, const CodecConfig& config,
                          SamplingParams* out) {
  out->temperature = in.has_temperature() ? in.temperature() : 1.0f;
  out->top_k = in.top_k();
  out->top_p = in.has_top_p() ? in.top_p() : 1.0f;
  out->min_p = in.min_p();
  out->logit_bias.clear();
  out->logit_bias.reserve(in.logit_bias_size());
  for (const v1::TokenBias& b : in.logit_bias()) {
    out->logit_bias.push_back({b.token_id(), b.bias()});
  }
  out->banned_token_ids.assign(in.banned_token_ids().begin(),
                               in.banned_token_ids().end());
  SamplingRules rules = SamplingRules::Wire(config.limits.max_samples_per_row,
                                            config.limits.max_top_logprobs);
  const std::string& bitmask_bytes = in.allowed_token_bitmask_bytes();
  if (bitmask_bytes.empty()) {
    // The repeated field's int32 words, viewed as the uint32 they are.
    out->allowed_bitmask = TokenBitmask::View(absl::MakeConstSpan(
        reinterpret_cast<const uint32_t*>(in.allowed_token_bitmask().data()),
        static_cast<size_t>(in.allowed_token_bitmask_size())));
  } else {
    rules.bitmask_field = "allowed_token_bitmask_bytes";
    const std::string field =
        absl::StrCat(prefix, ".allowed_token_bitmask_bytes");
    if (in.allowed_token_bitmask_size() != 0) {
      return Invalid(field,
                     "must be empty when allowed_token_bitmask is set (one "
                     "bitmask a row)");
    }
    const size_t words = static_cast<size_t>((config.vocab_size + 31) / 32);
    if (bitmask_bytes.size() != 4 * words) {
      return Invalid(field,
                     absl::StrCat("must be empty or hold 4 * ceil(V / 32) = ",
                                  4 * words, " bytes (V = ", config.vocab_size,
                                  "), got ", bitmask_bytes.size()));
    }
    // Viewed where the parsed request holds them, which outlives `out`
    // (DecodedRequest); copied only where they are not word-aligned (the
    // heap and protobuf's arena align them, so in practice never).
    if (reinterpret_cast<uintptr_t>(bitmask_bytes.data()) % alignof(uint32_t) ==
        0) {
      out->allowed_bitmask = TokenBitmask::View(absl::MakeConstSpan(
          reinterpret_cast<const uint32_t*>(bitmask_bytes.data()), words));
    } else {
      std::vector<uint32_t> copy(words);
      std::memcpy(copy.data(), bitmask_bytes.data(), bitmask_bytes.size());
      out->allowed_bitmask = std::move(copy);
    }
  }
  out->repetition_penalty =
      in.has_repetition_penalty() ? in.repetition_penalty() : 1.0f;
  out->presence_penalty = in.presence_penalty();
  out->frequency_penalty = in.frequency_penalty();
  out->prompt_token_ids.assign(in.prompt_token_ids().begin(),
                               in.prompt_token_ids().end());
  out->output_token_counts.clear();
  out->output_token_counts.reserve(in.output_token_counts_size());
  for (const v1::TokenCount& c : in.output_token_counts()) {
    out->output_token_counts.push_back({c.token_id(), c.count()});
  }
  out->n = in.has_n() ? in.n() : 1;
  const v1::LogprobOptions& lp = in.logprobs();
  out->logprobs.sampled = lp.sampled_logprob();
  out->logprobs.rank = lp.sampled_rank();
  out->logprobs.logsumexp = lp.row_logsumexp();
  out->logprobs.top_n = lp.top_logprobs();
  // The space matters only where a logprob is asked for: RAW is the wire's
  // default, and a row without logprobs must not count as a raw-logprobs
  // row (a control the backend must support, and on the CUDA backend a row
  // the unit candidates cannot serve).
  out->logprobs.raw =
      lp.space() == v1::LogprobOptions::RAW && out->logprobs.any();

  if (absl::Status s =
          ValidateSamplingParams(*out, config.vocab_size, prefix, rules);
      !s.ok()) {
    return s;
  }
  // The one rule of the wire alone: an enum value this build does not know.
  if (lp.space() != v1::LogprobOptions::RAW &&
      lp.space() != v1::LogprobOptions::PROCESSED) {
    return Invalid(absl::StrCat(prefix, ".logprobs.space"),
                   absl::StrCat("must be RAW (0) or PROCESSED (1), got ",
                                static_cast<int>(lp.space())));
  }
  return absl::OkStatus();
}

bool SameLogprobs(const LogprobRequest& a, const LogprobRequest& b) {
  return a.sampled == b.sampled && a.rank == b.rank &&
         a.logsumexp == b.logsumexp && a.top_n == b.top_n && a.raw == b.raw;
}

// Finds the first row of `data` ([rows, hidden] of `dtype`) that is not
// finite, or -1. When the engine computes in a narrower dtype, a value that
// is finite on the wire but overflows in the conversion counts as non-finite.
int FirstNonFiniteRow(DType dtype, const void* data, int rows, int64_t hidden,
                      DType input_dtype) {
  const size_t row_bytes = hidden * DTypeSize(dtype);
  const bool narrows = input_dtype != DType::kFp32 && dtype != input_dtype;
  std::vector<uint16_t> converted(narrows ? hidden : 0);
  for (int r = 0; r < rows; ++r) {
    const void* row = static_cast<const char*>(data) + r * row_bytes;
    if (!AllFinite(dtype, row, hidden)) return r;
    if (narrows) {
      ConvertDType(dtype, row, hidden, input_dtype, converted.data());
      if (!AllFinite(input_dtype, converted.data(), hidden)) return r;
    }
  }
  return -1;
}

absl::BitGen& ThreadBitGen() {
  thread_local absl::BitGen gen;
  return gen;
}

}  // namespace

namespace {

// Both forms of DecodeSampleRequest: the hidden states are `data` when not
// null, else request.hidden_states().data().
absl::Status Decode(const v1::SampleRequest& request,
                    const std::vector<absl::string_view>* data,
                    const CodecConfig& config, ThreadPool* pool,
                    DecodedRequest* out) {
  const int64_t hidden = config.hidden_size;
  if (!request.has_hidden_states()) {
    return Invalid("hidden_states",
                   absl::StrCat("required: a [B, ", hidden, "] tensor"));
  }
  const v1::Tensor& tensor = request.hidden_states();
  absl::StatusOr<DType> dtype = FromProtoDType(tensor.dtype());
  if (!dtype.ok()) return dtype.status();
  if (tensor.shape_size() != 2) {
    return Invalid("hidden_states.shape",
                   absl::StrCat("must be [B, ", hidden, "] (rank 2), got rank ",
                                tensor.shape_size()));
  }
  if (tensor.shape(1) != hidden) {
    return Invalid("hidden_states.shape[1]",
                   absl::StrCat("must equal the model's hidden size D = ",
                                hidden, ", got ", tensor.shape(1)));
  }
  const int64_t rows = tensor.shape(0);
  if (rows < 1) {
    return Invalid("hidden_states.shape[0]",
                   absl::StrCat("B must be >= 1, got ", rows));
  }
  if (rows > config.max_batch_rows) {
    return Invalid("hidden_states.shape[0]",
                   absl::StrCat("B must be <= max_batch_rows = ",
                                config.max_batch_rows, ", got ", rows));
  }
  const size_t expected_bytes = rows * hidden * DTypeSize(*dtype);
  size_t data_bytes = tensor.data().size();
  if (data != nullptr) {
    data_bytes = 0;
    for (absl::string_view piece : *data) data_bytes += piece.size();
  }
  const bool by_reference = tensor.has_shared_memory();
  if (by_reference && data_bytes != 0) {
    return Invalid(
        "hidden_states.data",
        absl::StrCat("must be empty when hidden_states.shared_memory "
                     "is set, got ",
                     data_bytes, " bytes"));
  }
  if (!by_reference && data_bytes != expected_bytes) {
    return Invalid(
        "hidden_states.data",
        absl::StrCat("must hold B x D x ", DTypeSize(*dtype), " = ", rows,
                     " x ", hidden, " x ", DTypeSize(*dtype), " = ",
                     expected_bytes, " bytes, got ", data_bytes));
  }
  // Pieces are kept as they are when the engine takes this dtype, and
  // gathered into one buffer when they must be converted (or are one piece).
  out->hidden_pieces.clear();
  out->gathered.clear();
  out->shared_copy.reset();
  out->shared = SharedBytes();
  const void* contiguous = tensor.data().data();
  bool checked_at_launch = false;
  if (by_reference) {
    constexpr char kField[] = "hidden_states.shared_memory";
    if (config.shared_memory == nullptr) return SharedMemoryOff(kField);
    const v1::SharedMemoryRef& ref = tensor.shared_memory();
    if (*dtype == config.input_dtype) {
      // Copied once, straight into the batch's input, and checked there
      // (CopyFiniteRows): the caller cannot change what the engine gets
      // after the check.
      absl::StatusOr<SharedBytes> found = config.shared_memory->Find(
          ref.region(), ref.offset(), expected_bytes, kField);
      if (!found.ok()) return found.status();
      out->shared = *std::move(found);
      contiguous = nullptr;
      checked_at_launch = true;
    } else {
      // Converted at launch: copied out here first and checked in the copy.
      out->shared_copy.reset(new char[expected_bytes]);
      if (absl::Status s = config.shared_memory->Read(
              ref.region(), ref.offset(), expected_bytes, kField,
              out->shared_copy.get());
          !s.ok()) {
        return s;
      }
      contiguous = out->shared_copy.get();
    }
  } else if (*dtype == config.input_dtype && config.rows_checked_when_copied) {
    // Checked as the batch copies them (CopyFinitePieces): one read of them.
    if (data != nullptr) {
      out->hidden_pieces = *data;
    } else {
      out->hidden_pieces.push_back(tensor.data());
    }
    contiguous = nullptr;
    checked_at_launch = true;
  } else if (data != nullptr) {
    // A conversion reads whole elements, so a piece it reads in place must
    // be aligned to one.
    const bool aligned =
        reinterpret_cast<uintptr_t>(data->front().data()) % DTypeSize(*dtype) ==
        0;
    if (data->size() == 1 && (aligned || *dtype == config.input_dtype)) {
      contiguous = data->front().data();
    } else if (*dtype == config.input_dtype) {
      contiguous = nullptr;
    } else {
      out->gathered.reserve(expected_bytes);
      for (absl::string_view piece : *data) {
        out->gathered.append(piece.data(), piece.size());
      }
      contiguous = out->gathered.data();
    }
  }
  const int bad_row = checked_at_launch ? -1
                      : contiguous != nullptr
                          ? FirstNonFiniteRow(*dtype, contiguous, rows, hidden,
                                              config.input_dtype)
                          : FirstNonFiniteRowInPieces(*dtype, *data, hidden);
  if (bad_row >= 0) {
    return NonFiniteRowError(
        by_reference ? "hidden_states.shared_memory" : "hidden_states.data",
        bad_row,
        config.input_dtype != *dtype && config.input_dtype != DType::kFp32
            ? absl::StrCat(" (or overflows the engine's ",
                           DTypeName(config.input_dtype), ")")
            : std::string());
  }

  if (request.row_params_size() != 0 && request.row_params_size() != rows) {
    return Invalid("row_params",
                   absl::StrCat("must be empty or hold B = ", rows,
                                " entries, got ", request.row_params_size()));
  }
  if (request.seeds_size() != 0 && request.seeds_size() != rows) {
    return Invalid("seeds",
                   absl::StrCat("must be empty or hold B = ", rows,
                                " entries, got ", request.seeds_size()));
  }
  if (request.steps_size() != 0 && request.steps_size() != rows) {
    return Invalid("steps",
                   absl::StrCat("must be empty or hold B = ", rows,
                                " entries, got ", request.steps_size()));
  }

  out->rows = static_cast<int>(rows);
  out->dtype = *dtype;
  out->hidden = contiguous;
  if (contiguous == nullptr && !checked_at_launch) out->hidden_pieces = *data;
  out->params.clear();
  std::vector<std::string> prefixes;
  if (request.row_params_size() == 0) {
    out->params.resize(1);
    prefixes.push_back("params");
    if (absl::Status s =
            DecodeParams(request.params(), "params", config, &out->params[0]);
        !s.ok()) {
      return s;
    }
  } else {
    out->params.resize(rows);
    for (int r = 0; r < rows; ++r) {
      prefixes.push_back(absl::StrCat("row_params[", r, "]"));
    }
    // Each row alone; the first failing row in order is the answer, as on
    // one thread.
    std::vector<absl::Status> statuses(static_cast<size_t>(rows));
    auto decode_row = [&](int64_t r) {
      statuses[r] = DecodeParams(request.row_params(static_cast<int>(r)),
                                 prefixes[r], config, &out->params[r]);
    };
    ParallelForOrInline(pool, rows, decode_row);
    for (absl::Status& s : statuses) {
      if (!s.ok()) return std::move(s);
    }
    // The response packs token ids as [B, n] and logprob fields per row, so
    // every row of one request must agree on them.
    for (int r = 1; r < rows; ++r) {
      if (out->params[r].n != out->params[0].n) {
        return Invalid(
            absl::StrCat(prefixes[r], ".n"),
            absl::StrCat("must equal row 0's n = ", out->params[0].n,
                         " (one n per request), got ", out->params[r].n));
      }
      if (!SameLogprobs(out->params[r].logprobs, out->params[0].logprobs)) {
        return Invalid(absl::StrCat(prefixes[r], ".logprobs"),
                       "must equal row 0's logprobs options (one set of "
                       "logprob options per request)");
      }
    }
  }
  out->n = out->params[0].n;
  out->logprobs = out->params[0].logprobs;

  // Declared but not implemented by this backend: refuse, never ignore.
  for (size_t i = 0; i < out->params.size(); ++i) {
    const std::string control =
        FirstUnsupportedControl(out->params[i], config.supported_controls);
    if (!control.empty()) {
      return absl::UnimplementedError(
          absl::StrCat(prefixes[i], ".", control, ": not implemented by the ",
                       config.backend, " backend (supported: ",
                       absl::StrJoin(config.supported_controls, ", "), ")"));
    }
  }

  out->seeds.resize(rows);
  for (int r = 0; r < rows; ++r) {
    out->seeds[r] = request.seeds_size() != 0
                        ? request.seeds(r)
                        : absl::Uniform<uint64_t>(ThreadBitGen());
  }
  out->specs.resize(rows);
  for (int r = 0; r < rows; ++r) {
    RowSpec& spec = out->specs[r];
    spec.params = &out->params[out->params.size() == 1 ? 0 : r];
    spec.seed = out->seeds[r];
    spec.step = request.steps_size() != 0 ? request.steps(r) : 0;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status DecodeSampleRequest(const v1::SampleRequest& request,
                                 const CodecConfig& config,
                                 DecodedRequest* out) {
  return Decode(request, nullptr, config, nullptr, out);
}

absl::Status DecodeSampleRequest(const v1::SampleRequest& request,
                                 const std::vector<absl::string_view>& data,
                                 const CodecConfig& config, DecodedRequest* out,
                                 ThreadPool* pool) {
  return Decode(request, &data, config, pool, out);
}

absl::Status EncodeSampleResponse(const v1::SampleRequest& request,
                                  const DecodedRequest& decoded,
                                  const std::vector<RowResult>& results,
                                  v1::SampleResponse* response) {
  if (static_cast<int>(results.size()) != decoded.rows) {
    return absl::InternalError(absl::StrCat("engine returned ", results.size(),
                                            " results for ", decoded.rows,
                                            " rows"));
  }
  response->set_request_id(request.request_id());
  response->set_n(decoded.n);
  response->mutable_token_ids()->Reserve(decoded.rows * decoded.n);
  for (int r = 0; r < decoded.rows; ++r) {
    const RowResult& result = results[r];
    if (static_cast<int>(result.token_ids.size()) != decoded.n) {
      return absl::InternalError(
          absl::StrCat("engine returned ", result.token_ids.size(),
                       " samples for row ", r, ", expected ", decoded.n));
    }
    for (int32_t token : result.token_ids) response->add_token_ids(token);
    response->add_seeds(decoded.seeds[r]);
    if (decoded.logprobs.sampled) {
      if (static_cast<int>(result.sampled_logprobs.size()) != decoded.n) {
        return absl::InternalError(
            absl::StrCat("engine returned no sampled logprobs for row ", r));
      }
      for (float lp : result.sampled_logprobs) {
        response->add_sampled_logprobs(lp);
      }
    }
    if (decoded.logprobs.rank) {
      if (static_cast<int>(result.sampled_ranks.size()) != decoded.n) {
        return absl::InternalError(
            absl::StrCat("engine returned no sampled ranks for row ", r));
      }
      response->mutable_sampled_ranks()->Add(result.sampled_ranks.begin(),
                                             result.sampled_ranks.end());
    }
    if (decoded.logprobs.logsumexp) {
      response->add_row_logsumexp(result.logsumexp);
    }
    if (decoded.logprobs.top_n > 0) {
      if (result.top_token_ids.size() != result.top_logprobs.size()) {
        return absl::InternalError(absl::StrCat(
            "engine returned mismatched top logprobs for row ", r));
      }
      v1::TopLogprobs* top = response->add_top_logprobs();
      top->mutable_token_ids()->Add(result.top_token_ids.begin(),
                                    result.top_token_ids.end());
      top->mutable_logprobs()->Add(result.top_logprobs.begin(),
                                   result.top_logprobs.end());
    }
  }
  return absl::OkStatus();
}

}  // namespace flashsampler
