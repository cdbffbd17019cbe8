// The wire format walk of SplitHiddenStates: only the fields on the path to
// hidden_states.data (SampleRequest field 2, Tensor field 3) are opened,
// row_params (field 4) are set aside whole; every other field is passed
// through as views of the bytes it came in.
#include "service/serving/request_wire.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>

#include "common/dtype_convert.h"
#include "common/field_violation.h"
#include "google/protobuf/io/zero_copy_stream_impl.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

namespace flashsampler {

namespace {

constexpr uint32_t kHiddenStatesField = 2;  // SampleRequest.hidden_states
constexpr uint32_t kRowParamsField = 4;     // SampleRequest.row_params
constexpr uint32_t kDataField = 3;          // Tensor.data
constexpr int kVarint = 0;
constexpr int kFixed64 = 1;
constexpr int kLengthDelimited = 2;
constexpr int kFixed32 = 5;

// A read position over the pieces.
class Cursor {
 public:
  explicit Cursor(const std::vector<absl::string_view>& pieces)
      : pieces_(pieces) {
    SkipEmpty();
  }

  // Where the cursor is: a piece and an offset in it (never the end of a
  // piece but the last).
  struct Position {
    size_t piece = 0;
    size_t offset = 0;
  };

  uint64_t consumed() const { return consumed_; }
  bool at_end() const { return piece_ == pieces_.size(); }
  Position position() const { return {piece_, offset_}; }

  // Appends views of the bytes from `from` up to `to` (both positions of
  // this cursor, `from` first) to `views`.
  void ViewsBetween(Position from, Position to,
                    std::vector<absl::string_view>* views) const {
    for (size_t p = from.piece; p < pieces_.size() && p <= to.piece; ++p) {
      const size_t begin = p == from.piece ? from.offset : 0;
      const size_t end = p == to.piece ? to.offset : pieces_[p].size();
      if (end > begin) views->push_back(pieces_[p].substr(begin, end - begin));
    }
  }

  bool ReadByte(uint8_t* byte) {
    if (at_end()) return false;
    *byte = static_cast<uint8_t>(pieces_[piece_][offset_]);
    Advance(1);
    return true;
  }

  // A base-128 varint of at most 10 bytes, appending its bytes to `raw`.
  bool ReadVarint(uint64_t* value, std::string* raw) {
    *value = 0;
    for (int shift = 0; shift < 70; shift += 7) {
      uint8_t byte;
      if (!ReadByte(&byte)) return false;
      if (raw != nullptr) raw->push_back(static_cast<char>(byte));
      *value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return true;
    }
    return false;
  }

  // Appends the next `n` bytes to `out` (null: moves past them).
  bool Copy(uint64_t n, std::string* out) {
    return Take(n, [out](absl::string_view bytes) {
      if (out != nullptr) out->append(bytes.data(), bytes.size());
    });
  }
  // Appends views of the next `n` bytes to `views`.
  bool View(uint64_t n, std::vector<absl::string_view>* views) {
    return Take(n,
                [views](absl::string_view bytes) { views->push_back(bytes); });
  }

 private:
  template <typename Sink>
  bool Take(uint64_t n, Sink sink) {
    while (n > 0) {
      if (at_end()) return false;
      const absl::string_view piece = pieces_[piece_].substr(offset_);
      const size_t take =
          n < piece.size() ? static_cast<size_t>(n) : piece.size();
      sink(piece.substr(0, take));
      Advance(take);
      n -= take;
    }
    return true;
  }
  void Advance(size_t n) {
    offset_ += n;
    consumed_ += n;
    if (offset_ == pieces_[piece_].size()) {
      ++piece_;
      offset_ = 0;
      SkipEmpty();
    }
  }
  void SkipEmpty() {
    while (piece_ < pieces_.size() && pieces_[piece_].empty()) ++piece_;
  }

  const std::vector<absl::string_view>& pieces_;
  size_t piece_ = 0;
  size_t offset_ = 0;
  uint64_t consumed_ = 0;
};

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

// Copies one field's value (its tag already read into `out`) through, or
// moves past it where `out` is null.
bool CopyValue(Cursor& in, int wire_type, std::string* out) {
  uint64_t value;
  switch (wire_type) {
    case kVarint:
      return in.ReadVarint(&value, out);
    case kFixed64:
      return in.Copy(8, out);
    case kFixed32:
      return in.Copy(4, out);
    case kLengthDelimited:
      return in.ReadVarint(&value, out) && in.Copy(value, out);
    default:  // groups (3, 4) and the invalid 6, 7
      return false;
  }
}

// One Tensor of `length` bytes: its fields other than data are appended to
// `tensor`, the data's views replace `data`.
bool SplitTensor(Cursor& in, uint64_t length, std::string* tensor,
                 std::vector<absl::string_view>* data) {
  const uint64_t end = in.consumed() + length;
  while (in.consumed() < end) {
    std::string tag_bytes;
    uint64_t tag;
    if (!in.ReadVarint(&tag, &tag_bytes)) return false;
    const int wire_type = static_cast<int>(tag & 7);
    if ((tag >> 3) == kDataField && wire_type == kLengthDelimited) {
      uint64_t size;
      if (!in.ReadVarint(&size, nullptr)) return false;
      data->clear();
      if (!in.View(size, data)) return false;
    } else {
      tensor->append(tag_bytes);
      if (!CopyValue(in, wire_type, tensor)) return false;
    }
  }
  return in.consumed() == end;
}

}  // namespace

SplitResult SplitHiddenStates(const std::vector<absl::string_view>& pieces,
                              SplitRequest* split) {
  split->rest.clear();
  split->tensors.clear();
  split->data.clear();
  split->row_params.clear();
  split->row_params_bytes = 0;
  Cursor in(pieces);
  // The first byte of the fields passed through since the last
  // hidden_states field.
  Cursor::Position run = in.position();
  while (!in.at_end()) {
    const Cursor::Position field = in.position();
    std::string tag_bytes;
    uint64_t tag;
    if (!in.ReadVarint(&tag, &tag_bytes)) return SplitResult::kUnsupported;
    const int wire_type = static_cast<int>(tag & 7);
    if ((tag >> 3) == kHiddenStatesField && wire_type == kLengthDelimited) {
      uint64_t length;
      if (!in.ReadVarint(&length, nullptr)) return SplitResult::kUnsupported;
      std::string tensor;
      if (!SplitTensor(in, length, &tensor, &split->data)) {
        return SplitResult::kUnsupported;
      }
      in.ViewsBetween(run, field, &split->rest);
      std::string& owned = split->tensors.emplace_back(std::move(tag_bytes));
      AppendVarint(tensor.size(), &owned);
      owned.append(tensor);
      split->rest.push_back(owned);
      run = in.position();
    } else if ((tag >> 3) == kRowParamsField && wire_type == kLengthDelimited) {
      uint64_t length;
      if (!in.ReadVarint(&length, nullptr)) return SplitResult::kUnsupported;
      in.ViewsBetween(run, field, &split->rest);
      if (!in.View(length, &split->row_params.emplace_back())) {
        return SplitResult::kUnsupported;
      }
      split->row_params_bytes += length;
      run = in.position();
    } else if (!CopyValue(in, wire_type, nullptr)) {
      return SplitResult::kUnsupported;
    }
  }
  in.ViewsBetween(run, in.position(), &split->rest);
  return SplitResult::kSplit;
}

bool ParseViews(const std::vector<absl::string_view>& views,
                google::protobuf::MessageLite* message) {
  if (views.size() == 1) {
    return message->ParseFromArray(views[0].data(),
                                   static_cast<int>(views[0].size()));
  }
  std::deque<google::protobuf::io::ArrayInputStream> streams;
  std::vector<google::protobuf::io::ZeroCopyInputStream*> inputs;
  inputs.reserve(views.size());
  for (absl::string_view view : views) {
    streams.emplace_back(view.data(), static_cast<int>(view.size()));
    inputs.push_back(&streams.back());
  }
  google::protobuf::io::ConcatenatingInputStream input(
      inputs.data(), static_cast<int>(inputs.size()));
  return message->ParseFromZeroCopyStream(&input);
}

bool ParseSplitRequest(const SplitRequest& split, ThreadPool* pool,
                       v1::SampleRequest* request) {
  if (!ParseViews(split.rest, request)) return false;
  const int rows = static_cast<int>(split.row_params.size());
  if (rows == 0) return true;
  auto* fields = request->mutable_row_params();
  fields->Reserve(rows);
  for (int i = 0; i < rows; ++i) fields->Add();
  // One flag a row: the rows may be parsed on several threads.
  std::unique_ptr<bool[]> parsed(new bool[static_cast<size_t>(rows)]);
  ParallelForOrInline(pool, rows, [&](int64_t i) {
    parsed[i] = ParseViews(split.row_params[static_cast<size_t>(i)],
                           fields->Mutable(static_cast<int>(i)));
  });
  return std::all_of(parsed.get(), parsed.get() + rows,
                     [](bool ok) { return ok; });
}

namespace {

constexpr size_t kEveryElementVisited = ~size_t{0};

// Calls visit(elements, count, offset) for the whole elements of `pieces`
// in order, in runs of `element`-byte elements that stay inside one row of
// `row_bytes` (a multiple of `element`), `offset` being the run's first
// byte in the concatenated pieces; an element split between pieces is put
// together first and visited alone. Returns the offset of the first run for
// which visit returns false, or kEveryElementVisited.
template <typename Visit>
size_t VisitRowRuns(const std::vector<absl::string_view>& pieces,
                    size_t element, size_t row_bytes, const Visit& visit) {
  size_t position = 0;  // bytes of the pieces before the current one
  char straddle[4];
  size_t straddle_bytes = 0;
  for (absl::string_view piece : pieces) {
    size_t at = 0;
    if (straddle_bytes > 0) {
      const size_t take = std::min(element - straddle_bytes, piece.size());
      std::memcpy(straddle + straddle_bytes, piece.data(), take);
      straddle_bytes += take;
      at = take;
      if (straddle_bytes < element) {
        position += piece.size();
        continue;
      }
      const size_t offset = position + at - element;
      if (!visit(straddle, size_t{1}, offset)) return offset;
      straddle_bytes = 0;
    }
    while (piece.size() - at >= element) {
      const size_t offset = position + at;
      const size_t row_end = (offset / row_bytes + 1) * row_bytes;
      const size_t count =
          std::min((piece.size() - at) / element, (row_end - offset) / element);
      if (!visit(piece.data() + at, count, offset)) return offset;
      at += count * element;
    }
    straddle_bytes = piece.size() - at;
    std::memcpy(straddle, piece.data() + at, straddle_bytes);
    position += piece.size();
  }
  return kEveryElementVisited;
}

}  // namespace

int FirstNonFiniteRowInPieces(DType dtype,
                              const std::vector<absl::string_view>& pieces,
                              int64_t hidden) {
  const size_t row_bytes = static_cast<size_t>(hidden) * DTypeSize(dtype);
  const size_t bad =
      VisitRowRuns(pieces, DTypeSize(dtype), row_bytes,
                   [dtype](const char* elements, size_t count, size_t) {
                     return AllFinite(dtype, elements, count);
                   });
  return bad == kEveryElementVisited ? -1 : static_cast<int>(bad / row_bytes);
}

absl::Status CopyFinitePieces(DType dtype,
                              const std::vector<absl::string_view>& pieces,
                              int64_t hidden, char* dst) {
  const size_t row_bytes = static_cast<size_t>(hidden) * DTypeSize(dtype);
  const size_t bad = VisitRowRuns(
      pieces, DTypeSize(dtype), row_bytes,
      [dtype, dst](const char* elements, size_t count, size_t offset) {
        return CopyFinite(dtype, elements, count, dst + offset);
      });
  if (bad == kEveryElementVisited) return absl::OkStatus();
  return NonFiniteRowError("hidden_states.data",
                           static_cast<int64_t>(bad / row_bytes));
}

}  // namespace flashsampler
