// .npy / raw fp32 loading and random generation of hidden-state batches. The
// .npy parser reads only what numpy.save writes for a C-ordered array: the
// magic, a version, the header length and a Python-literal dict.
#include "client/hidden_states.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/dtype_convert.h"

namespace flashsampler {
namespace {

constexpr absl::string_view kNpyMagic = "\x93NUMPY";

// The value of `key` in numpy's header dict, e.g. "'<f4'" or "(2, 512)".
absl::StatusOr<std::string> HeaderValue(absl::string_view header,
                                        absl::string_view key) {
  const std::string quoted = absl::StrCat("'", key, "'");
  size_t at = header.find(quoted);
  if (at == absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(".npy header has no ", quoted));
  }
  at = header.find(':', at);
  if (at == absl::string_view::npos) {
    return absl::InvalidArgumentError(".npy header is malformed");
  }
  absl::string_view rest =
      absl::StripLeadingAsciiWhitespace(header.substr(at + 1));
  // A tuple runs to its ')'; anything else to the next ','.
  const size_t end = rest.empty() || rest[0] != '(' ? rest.find_first_of(",}")
                                                    : rest.find(')') + 1;
  if (end == absl::string_view::npos || end == 0) {
    return absl::InvalidArgumentError(".npy header is malformed");
  }
  return std::string(absl::StripTrailingAsciiWhitespace(rest.substr(0, end)));
}

absl::StatusOr<HiddenStates> ParseNpy(const std::string& path,
                                      const std::string& bytes) {
  if (bytes.size() < 10) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": truncated .npy"));
  }
  const auto major = static_cast<uint8_t>(bytes[6]);
  size_t header_len = 0;
  size_t offset = 0;
  if (major == 1) {
    header_len = static_cast<uint8_t>(bytes[8]) |
                 (static_cast<size_t>(static_cast<uint8_t>(bytes[9])) << 8);
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": truncated .npy"));
    }
    for (int i = 0; i < 4; ++i) {
      header_len |= static_cast<size_t>(static_cast<uint8_t>(bytes[8 + i]))
                    << (8 * i);
    }
    offset = 12;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": unsupported .npy version ", major));
  }
  if (header_len > bytes.size() - offset) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": truncated .npy"));
  }
  const absl::string_view header(bytes.data() + offset, header_len);
  const size_t data_offset = offset + header_len;

  auto descr = HeaderValue(header, "descr");
  if (!descr.ok()) return descr.status();
  HiddenStates hidden;
  if (*descr == "'<f4'") {
    hidden.dtype = DType::kFp32;
  } else if (*descr == "'<f2'") {
    hidden.dtype = DType::kFp16;
  } else if (*descr == "'<u2'") {
    hidden.dtype = DType::kBf16;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": dtype ", *descr,
        " is not supported; use float32 ('<f4'), float16 ('<f2') or bfloat16 "
        "bits as uint16 ('<u2')"));
  }
  auto fortran = HeaderValue(header, "fortran_order");
  if (!fortran.ok()) return fortran.status();
  if (*fortran != "False") {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": Fortran-ordered arrays are not supported"));
  }
  auto shape_text = HeaderValue(header, "shape");
  if (!shape_text.ok()) return shape_text.status();
  std::vector<int64_t> shape;
  absl::string_view inner = *shape_text;
  absl::ConsumePrefix(&inner, "(");
  absl::ConsumeSuffix(&inner, ")");
  for (absl::string_view part :
       absl::StrSplit(inner, ',', absl::SkipWhitespace())) {
    int64_t dim = 0;
    if (!absl::SimpleAtoi(part, &dim) || dim < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": bad shape ", *shape_text));
    }
    shape.push_back(dim);
  }
  if (shape.size() == 1) {
    hidden.rows = 1;
    hidden.dim = shape[0];
  } else if (shape.size() == 2) {
    hidden.rows = shape[0];
    hidden.dim = shape[1];
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": expected shape [D] or [B, D], got ", *shape_text));
  }
  const size_t expected =
      static_cast<size_t>(hidden.rows * hidden.dim) * DTypeSize(hidden.dtype);
  if (bytes.size() - data_offset != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": expected ", expected, " data bytes for shape ",
                     *shape_text, ", found ", bytes.size() - data_offset));
  }
  hidden.data = bytes.substr(data_offset);
  return hidden;
}

}  // namespace

absl::StatusOr<HiddenStates> LoadHiddenStates(const std::string& path,
                                              int64_t raw_rows) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream contents;
  contents << in.rdbuf();
  const std::string bytes = contents.str();
  if (absl::StartsWith(bytes, kNpyMagic)) return ParseNpy(path, bytes);

  if (raw_rows < 1) {
    return absl::InvalidArgumentError("raw fp32 file: rows must be >= 1");
  }
  const size_t row_bytes = bytes.size() / static_cast<size_t>(raw_rows);
  if (bytes.empty() || bytes.size() % static_cast<size_t>(raw_rows) != 0 ||
      row_bytes % sizeof(float) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": raw fp32 file of ", bytes.size(),
        " bytes is not rows x D x 4 bytes with rows = ", raw_rows));
  }
  HiddenStates hidden;
  hidden.dtype = DType::kFp32;
  hidden.rows = raw_rows;
  hidden.dim = static_cast<int64_t>(row_bytes / sizeof(float));
  hidden.data = bytes;
  return hidden;
}

HiddenStates RandomHiddenStates(int64_t rows, int64_t dim, uint64_t seed,
                                DType dtype, float scale) {
  // mt19937_64 and a Box-Muller transform written out, so that the values
  // do not depend on the standard library's normal_distribution.
  std::mt19937_64 gen(seed);
  std::vector<float> values(static_cast<size_t>(rows * dim));
  constexpr double kTwoPi = 6.283185307179586;
  for (size_t i = 0; i < values.size(); i += 2) {
    const double u1 = (static_cast<double>(gen() >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(gen() >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1)) * scale;
    values[i] = static_cast<float>(r * std::cos(kTwoPi * u2));
    if (i + 1 < values.size()) {
      values[i + 1] = static_cast<float>(r * std::sin(kTwoPi * u2));
    }
  }
  HiddenStates hidden;
  hidden.dtype = dtype;
  hidden.rows = rows;
  hidden.dim = dim;
  hidden.data.resize(values.size() * DTypeSize(dtype));
  ConvertDType(DType::kFp32, values.data(), values.size(), dtype,
               hidden.data.data());
  return hidden;
}

HiddenStates ConvertHiddenStates(const HiddenStates& hidden, DType dtype) {
  HiddenStates out;
  out.dtype = dtype;
  out.rows = hidden.rows;
  out.dim = hidden.dim;
  const size_t count = static_cast<size_t>(hidden.rows * hidden.dim);
  out.data.resize(count * DTypeSize(dtype));
  ConvertDType(hidden.dtype, hidden.data.data(), count, dtype, out.data.data());
  return out;
}

absl::StatusOr<v1::SampleRequest> MakeSampleRequest(
    const HiddenStates& hidden, const RequestFields& fields) {
  const size_t elements = hidden.data.size() / DTypeSize(hidden.dtype);
  if (hidden.dtype == DType::kFp32) {
    std::vector<float> values(elements);
    std::memcpy(values.data(), hidden.data.data(), hidden.data.size());
    return MakeSampleRequest(values, hidden.rows, hidden.dim, fields);
  }
  std::vector<uint16_t> bits(elements);
  std::memcpy(bits.data(), hidden.data.data(), hidden.data.size());
  return MakeSampleRequest16(bits, hidden.rows, hidden.dim, fields,
                             hidden.dtype);
}

}  // namespace flashsampler
