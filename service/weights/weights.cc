// Loads the LM head from safetensors checkpoints (memory-mapped, validated
// before any tensor byte is trusted) or generates deterministic synthetic
// weights, and writes safetensors files for tests and tools.
#include "service/weights/weights.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/dtype_convert.h"
#include "kernels/noise/philox.h"
#include "nlohmann/json.hpp"

namespace flashsampler {
namespace {

using Json = nlohmann::json;

constexpr char kLmHeadTensor[] = "lm_head.weight";
constexpr char kTiedTensor[] = "model.embed_tokens.weight";
constexpr char kIndexFileName[] = "model.safetensors.index.json";
constexpr char kSingleFileName[] = "model.safetensors";
constexpr char kMetadataKey[] = "__metadata__";
// The safetensors reference reader refuses headers above 100 MB; a larger
// length field is corruption, not a header worth reading.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
// An index of a 1T-parameter model is a few MB; anything far larger is not one.
constexpr int64_t kMaxIndexBytes = int64_t{64} << 20;
// Owned buffers are page-aligned so a backend may pin them in place.
constexpr size_t kOwnedAlignment = 4096;
// Largest synthetic tensor: 64 GiB, beyond any real LM head (Llama-3-405B's
// is 128256 x 16384 bf16 = 4.2 GB).
constexpr uint64_t kMaxSyntheticBytes = uint64_t{64} << 30;
constexpr int64_t kMaxSyntheticHidden = 65536;
// Counter word 3 of every synthetic-weights Philox call, so the stream is
// distinct from the sampling noise's (step high word) for ordinary steps.
constexpr uint32_t kSyntheticStream = 0x57e16475u;
// Names listed when a tensor is missing; the rest are counted.
constexpr size_t kMaxListedNames = 8;

const char* SafetensorsName(DType dtype) {
  switch (dtype) {
    case DType::kBf16:
      return "BF16";
    case DType::kFp16:
      return "F16";
    case DType::kFp32:
      return "F32";
  }
  return "?";
}

std::optional<DType> DTypeFromSafetensors(absl::string_view name) {
  if (name == "BF16") return DType::kBf16;
  if (name == "F16") return DType::kFp16;
  if (name == "F32") return DType::kFp32;
  return std::nullopt;
}

std::string ListNames(std::vector<std::string> names) {
  std::sort(names.begin(), names.end());
  const size_t total = names.size();
  if (total == 0) return "(none)";
  if (total > kMaxListedNames) names.resize(kMaxListedNames);
  std::string listed = absl::StrJoin(names, ", ");
  if (total > kMaxListedNames) {
    absl::StrAppend(&listed, ", ... and ", total - kMaxListedNames, " more");
  }
  return absl::StrCat(listed, " (", total, " in all)");
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  if (dir.back() == '/') return dir + name;
  return absl::StrCat(dir, "/", name);
}

std::string DirName(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

absl::Status ErrnoStatus(int error_number, const std::string& what) {
  if (error_number == ENOENT) {
    return absl::NotFoundError(
        absl::StrCat(what, ": no such file or directory"));
  }
  return absl::ErrnoToStatus(error_number, what);
}

// What a file that is not a regular file is, for error messages.
const char* FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

absl::Status NotRegular(const std::string& path, mode_t mode) {
  return absl::InvalidArgumentError(absl::StrCat(
      path, ": is ", FileKind(mode),
      ", not a regular file; the weights must be a .safetensors file, a "
      "model.safetensors.index.json or a directory holding either"));
}

// Opens `path` read-only and returns its descriptor, refusing anything but a
// regular file before open() can block: open() of a FIFO waits for a writer
// forever, and a character device such as /dev/zero never ends. The stat
// comes first; O_NONBLOCK keeps the open itself from waiting if the path is
// swapped for a FIFO in between, and the fstat of the opened descriptor
// settles what was really opened. `info` receives that fstat.
absl::StatusOr<int> OpenRegularFile(const std::string& path,
                                    struct stat* info) {
  if (stat(path.c_str(), info) != 0) {
    return ErrnoStatus(errno, absl::StrCat("stat of ", path));
  }
  if (!S_ISREG(info->st_mode)) return NotRegular(path, info->st_mode);
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening ", path));
  if (fstat(fd, info) != 0) {
    const int error_number = errno;
    close(fd);
    return ErrnoStatus(error_number, absl::StrCat("stat of ", path));
  }
  if (!S_ISREG(info->st_mode)) {
    close(fd);
    return NotRegular(path, info->st_mode);
  }
  // Regular files ignore O_NONBLOCK; clear it anyway so reads are plain.
  const int flags = fcntl(fd, F_GETFL);
  if (flags >= 0) fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

// Heap memory from posix_memalign, released with free().
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using OwnedBuffer = std::unique_ptr<uint8_t, FreeDeleter>;

absl::StatusOr<OwnedBuffer> AllocateAligned(uint64_t bytes) {
  void* memory = nullptr;
  if (bytes == 0 || bytes > std::numeric_limits<size_t>::max() ||
      posix_memalign(&memory, kOwnedAlignment, static_cast<size_t>(bytes)) !=
          0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes for the weights"));
  }
  return OwnedBuffer(static_cast<uint8_t*>(memory));
}

// A read-only private mapping of a whole file. The descriptor is closed right
// after mmap: the mapping keeps the file alive by itself.
class MappedFile {
 public:
  static absl::StatusOr<MappedFile> Open(const std::string& path) {
    struct stat info;
    absl::StatusOr<int> opened = OpenRegularFile(path, &info);
    if (!opened.ok()) return opened.status();
    const int fd = *opened;
    MappedFile file;
    file.size_ = static_cast<size_t>(info.st_size);
    if (file.size_ > 0) {  // mmap refuses length 0; the header check reports it
      void* base = mmap(nullptr, file.size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (base == MAP_FAILED) {
        const int error_number = errno;
        close(fd);
        return ErrnoStatus(error_number, absl::StrCat("mmap of ", path));
      }
      file.base_ = static_cast<const uint8_t*>(base);
    }
    close(fd);
    return file;
  }

  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept
      : base_(std::exchange(other.base_, nullptr)),
        size_(std::exchange(other.size_, 0)) {}
  MappedFile& operator=(MappedFile&& other) noexcept {
    if (this != &other) {
      Unmap();
      base_ = std::exchange(other.base_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() { Unmap(); }

  const uint8_t* data() const { return base_; }
  size_t size() const { return size_; }

 private:
  void Unmap() {
    if (base_ != nullptr) munmap(const_cast<uint8_t*>(base_), size_);
    base_ = nullptr;
    size_ = 0;
  }
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
};

// One tensor entry of a safetensors header; offsets are relative to the
// first byte after the header.
struct TensorEntry {
  std::string dtype;
  std::vector<uint64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

struct SafetensorsHeader {
  uint64_t data_start = 0;  // 8 + header length
  std::map<std::string, TensorEntry> tensors;
};

absl::Status Malformed(const std::string& path, absl::string_view what) {
  return absl::DataLossError(
      absl::StrCat(path, ": malformed safetensors header: ", what));
}

// Reads a JSON integer that must be >= 0; `what` names it in errors.
absl::StatusOr<uint64_t> NonNegative(const Json& value, const std::string& path,
                                     const std::string& what) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer()) {
    return absl::DataLossError(absl::StrCat(path, ": ", what, " is negative (",
                                            value.get<int64_t>(), ")"));
  }
  return Malformed(path, absl::StrCat(what, " is not an integer"));
}

// Parses and validates the header: structure of every entry, every tensor
// inside the file, no two tensors overlapping.
absl::StatusOr<SafetensorsHeader> ParseHeader(const std::string& path,
                                              const MappedFile& file) {
  const uint64_t file_size = file.size();
  if (file_size < 8) {
    return absl::DataLossError(absl::StrCat(
        path, ": truncated: ", file_size,
        " bytes, too short for the 8-byte safetensors header length"));
  }
  uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) {  // little-endian on every host
    header_length = (header_length << 8) | file.data()[i];
  }
  if (header_length > file_size - 8) {
    return absl::DataLossError(absl::StrCat(
        path, ": header length ", header_length, " runs past the end of the ",
        file_size, "-byte file (truncated or not a safetensors file)"));
  }
  if (header_length > kMaxHeaderBytes) {
    return Malformed(path, absl::StrCat("header length ", header_length,
                                        " exceeds the 100 MB limit"));
  }
  const char* text = reinterpret_cast<const char*>(file.data() + 8);
  size_t text_length = static_cast<size_t>(header_length);
  // Writers pad the header with spaces (allowed by JSON); some pad with NULs.
  while (text_length > 0 && text[text_length - 1] == '\0') --text_length;
  const Json header = Json::parse(text, text + text_length, nullptr,
                                  /*allow_exceptions=*/false);
  if (header.is_discarded()) return Malformed(path, "not valid JSON");
  if (!header.is_object()) return Malformed(path, "not a JSON object");

  SafetensorsHeader result;
  result.data_start = 8 + header_length;
  const uint64_t data_size = file_size - result.data_start;
  for (const auto& [name, entry] : header.items()) {
    if (name == kMetadataKey) continue;  // free-form strings; not ours to judge
    const std::string what = absl::StrCat("tensor '", name, "'");
    if (!entry.is_object()) {
      return Malformed(path, absl::StrCat(what, " is not a JSON object"));
    }
    TensorEntry tensor;
    const auto dtype = entry.find("dtype");
    if (dtype == entry.end() || !dtype->is_string()) {
      return Malformed(path, absl::StrCat(what, " has no string \"dtype\""));
    }
    tensor.dtype = dtype->get<std::string>();
    const auto shape = entry.find("shape");
    if (shape == entry.end() || !shape->is_array()) {
      return Malformed(path, absl::StrCat(what, " has no \"shape\" array"));
    }
    for (const Json& extent : *shape) {
      absl::StatusOr<uint64_t> value =
          NonNegative(extent, path, absl::StrCat("a shape extent of ", what));
      if (!value.ok()) return value.status();
      tensor.shape.push_back(*value);
    }
    const auto offsets = entry.find("data_offsets");
    if (offsets == entry.end() || !offsets->is_array() ||
        offsets->size() != 2) {
      return Malformed(
          path, absl::StrCat(what, " has no \"data_offsets\" [begin, end]"));
    }
    absl::StatusOr<uint64_t> begin = NonNegative(
        (*offsets)[0], path, absl::StrCat("data_offsets of ", what));
    if (!begin.ok()) return begin.status();
    absl::StatusOr<uint64_t> end = NonNegative(
        (*offsets)[1], path, absl::StrCat("data_offsets of ", what));
    if (!end.ok()) return end.status();
    tensor.begin = *begin;
    tensor.end = *end;
    if (tensor.end < tensor.begin) {
      return absl::DataLossError(
          absl::StrCat(path, ": ", what, " has data_offsets [", tensor.begin,
                       ", ", tensor.end, "] with end before begin"));
    }
    if (tensor.end > data_size) {
      return absl::DataLossError(absl::StrCat(
          path, ": truncated: ", what, " has data_offsets [", tensor.begin,
          ", ", tensor.end, "] but the file holds only ", data_size,
          " data bytes after its header"));
    }
    result.tensors.emplace(name, std::move(tensor));
  }

  // Overlap check: sorted by begin, each non-empty tensor must end before the
  // next one starts.
  std::vector<std::pair<const std::string*, const TensorEntry*>> by_offset;
  for (const auto& [name, tensor] : result.tensors) {
    if (tensor.end > tensor.begin) by_offset.emplace_back(&name, &tensor);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const auto& a, const auto& b) {
              return a.second->begin < b.second->begin;
            });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const auto& [previous_name, previous] = by_offset[i - 1];
    const auto& [name, tensor] = by_offset[i];
    if (tensor->begin < previous->end) {
      return absl::DataLossError(
          absl::StrCat(path, ": tensors '", *previous_name, "' [",
                       previous->begin, ", ", previous->end, ") and '", *name,
                       "' [", tensor->begin, ", ", tensor->end, ") overlap"));
    }
  }
  return result;
}

// Picks the tensor to load among `names`: the requested one, else the LM head,
// else the tied embedding. `where` names the file or index for errors.
template <typename Contains>
absl::StatusOr<std::string> ChooseTensor(const std::string& requested,
                                         const std::string& where,
                                         const std::vector<std::string>& names,
                                         Contains contains) {
  if (!requested.empty()) {
    if (contains(requested)) return requested;
    return absl::NotFoundError(
        absl::StrCat("tensor '", requested, "' not found in ", where,
                     "; tensors there: ", ListNames(names)));
  }
  if (contains(kLmHeadTensor)) return std::string(kLmHeadTensor);
  if (contains(kTiedTensor)) return std::string(kTiedTensor);
  return absl::NotFoundError(
      absl::StrCat("neither '", kLmHeadTensor, "' nor '", kTiedTensor,
                   "' (tied embeddings) found in ", where, "; tensors there: ",
                   ListNames(names), ". Name the tensor to load explicitly."));
}

// Elements scanned per block by the non-finite check: each block is one
// branch-free OR-reduction the compiler vectorizes; only a block that holds a
// bad element is searched element by element.
constexpr size_t kScanBlock = 4096;
// Bytes per scanning thread: below this a thread costs more than it saves.
constexpr uint64_t kScanBytesPerThread = uint64_t{64} << 20;

// An element is NaN or +-Inf exactly when all its exponent bits are set.
template <typename Word, Word kExponent>
size_t FirstNonFiniteIn(const Word* words, size_t begin, size_t end) {
  for (size_t block = begin; block < end; block += kScanBlock) {
    const size_t stop = std::min(end, block + kScanBlock);
    Word any = 0;
    for (size_t i = block; i < stop; ++i) {
      any |= static_cast<Word>((words[i] & kExponent) == kExponent);
    }
    if (any == 0) continue;
    for (size_t i = block; i < stop; ++i) {
      if ((words[i] & kExponent) == kExponent) return i;
    }
  }
  return end;
}

size_t FirstNonFiniteRange(DType dtype, const void* data, size_t begin,
                           size_t end) {
  switch (dtype) {
    case DType::kBf16:
      return FirstNonFiniteIn<uint16_t, 0x7f80u>(
          static_cast<const uint16_t*>(data), begin, end);
    case DType::kFp16:
      return FirstNonFiniteIn<uint16_t, 0x7c00u>(
          static_cast<const uint16_t*>(data), begin, end);
    case DType::kFp32:
      return FirstNonFiniteIn<uint32_t, 0x7f800000u>(
          static_cast<const uint32_t*>(data), begin, end);
  }
  return end;
}

// Index of the first NaN or Inf among `count` elements of `data`, or `count`.
// Large tensors are split over a few threads: a 2 GB mapped checkpoint is
// faulted in by the scan, and several threads keep several reads in flight.
size_t FirstNonFinite(DType dtype, const void* data, size_t count) {
  const uint64_t bytes = static_cast<uint64_t>(count) * DTypeSize(dtype);
  const uint64_t hardware =
      std::max<uint64_t>(1, std::thread::hardware_concurrency());
  const size_t threads = static_cast<size_t>(std::clamp<uint64_t>(
      bytes / kScanBytesPerThread, 1, std::min<uint64_t>(hardware, 16)));
  std::vector<size_t> first(threads, count);
  std::vector<std::thread> workers;
  size_t inline_from = threads;  // parts this thread scans itself
  for (size_t t = 1; t < threads; ++t) {
    const size_t begin = count / threads * t;
    const size_t end = t + 1 == threads ? count : count / threads * (t + 1);
    try {
      workers.emplace_back([&first, t, dtype, data, begin, end] {
        const size_t found = FirstNonFiniteRange(dtype, data, begin, end);
        if (found != end) first[t] = found;
      });
    } catch (const std::system_error&) {
      inline_from = t;  // no thread to be had: scan the rest here
      break;
    }
  }
  {
    const size_t end = threads == 1 ? count : count / threads;
    const size_t found = FirstNonFiniteRange(dtype, data, 0, end);
    if (found != end) first[0] = found;
  }
  for (size_t t = inline_from; t < threads; ++t) {
    const size_t begin = count / threads * t;
    const size_t end = t + 1 == threads ? count : count / threads * (t + 1);
    const size_t found = FirstNonFiniteRange(dtype, data, begin, end);
    if (found != end) first[t] = found;
  }
  for (std::thread& worker : workers) worker.join();
  return *std::min_element(first.begin(), first.end());
}

float ElementAsFloat(DType dtype, const void* data, size_t index) {
  switch (dtype) {
    case DType::kBf16:
      return Bf16ToFloat(static_cast<const uint16_t*>(data)[index]);
    case DType::kFp16:
      return HalfToFloat(static_cast<const uint16_t*>(data)[index]);
    case DType::kFp32:
      return static_cast<const float*>(data)[index];
  }
  return 0.0f;
}

class MappedWeights final : public Weights {
 public:
  MappedWeights(MappedFile file, OwnedBuffer copy)
      : file_(std::move(file)), copy_(std::move(copy)) {}

  void Set(int64_t vocab, int64_t hidden, DType dtype, const void* data,
           std::string source, std::string tensor_name) {
    vocab_size_ = vocab;
    hidden_size_ = hidden;
    dtype_ = dtype;
    data_ = data;
    source_ = std::move(source);
    tensor_name_ = std::move(tensor_name);
  }

 private:
  MappedFile file_;   // the checkpoint; unmapped in the destructor
  OwnedBuffer copy_;  // set only when the tensor was misaligned in the file
};

// Loads tensor `tensor_name` (or the default choice when empty) from one
// safetensors file. `index_path` is set when an index sent us here.
absl::StatusOr<std::unique_ptr<Weights>> LoadSafetensorsFile(
    const std::string& path, const std::string& tensor_name,
    std::optional<DType> expected, const std::string& index_path) {
  absl::StatusOr<MappedFile> file = MappedFile::Open(path);
  if (!file.ok()) return file.status();
  absl::StatusOr<SafetensorsHeader> header = ParseHeader(path, *file);
  if (!header.ok()) return header.status();

  std::vector<std::string> names;
  names.reserve(header->tensors.size());
  for (const auto& [name, unused] : header->tensors) names.push_back(name);
  absl::StatusOr<std::string> chosen = ChooseTensor(
      tensor_name, path, names,
      [&](const std::string& name) { return header->tensors.count(name) > 0; });
  if (!chosen.ok()) {
    if (!index_path.empty()) {
      return absl::DataLossError(absl::StrCat(
          "index ", index_path, " places tensor '", tensor_name, "' in ", path,
          " but that file does not hold it; tensors there: ",
          ListNames(names)));
    }
    return chosen.status();
  }
  const TensorEntry& tensor = header->tensors.at(*chosen);
  const std::string what = absl::StrCat("tensor '", *chosen, "' in ", path);

  if (tensor.shape.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has rank ", tensor.shape.size(), " (shape [",
                     absl::StrJoin(tensor.shape, ", "),
                     "]); an LM head must have rank 2: [vocab, hidden]"));
  }
  const uint64_t vocab = tensor.shape[0];
  const uint64_t hidden = tensor.shape[1];
  if (vocab == 0 || hidden == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is empty: shape [", vocab, ", ", hidden, "]"));
  }
  // Token ids travel as int32 on the wire.
  if (vocab > static_cast<uint64_t>(std::numeric_limits<int32_t>::max()) ||
      hidden > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has shape [", vocab, ", ", hidden,
                     "]; each extent must be below 2^31"));
  }
  const std::optional<DType> dtype = DTypeFromSafetensors(tensor.dtype);
  if (!dtype.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has unsupported dtype '", tensor.dtype,
                     "'; supported: BF16, F16, F32"));
  }
  if (expected.has_value() && *expected != *dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has dtype ", SafetensorsName(*dtype), " but ",
                     SafetensorsName(*expected), " (", DTypeName(*expected),
                     ") was required"));
  }
  // Both extents are < 2^31 and the element size <= 4: no overflow.
  const uint64_t needed = vocab * hidden * DTypeSize(*dtype);
  if (tensor.end - tensor.begin != needed) {
    return absl::DataLossError(absl::StrCat(
        what, " has data_offsets [", tensor.begin, ", ", tensor.end,
        "] spanning ", tensor.end - tensor.begin, " bytes, but shape [", vocab,
        ", ", hidden, "] of ", tensor.dtype, " needs ", needed, " bytes"));
  }

  const uint8_t* bytes = file->data() + header->data_start + tensor.begin;
  OwnedBuffer copy;
  if (reinterpret_cast<uintptr_t>(bytes) % DTypeSize(*dtype) != 0) {
    // The format does not promise alignment; element loads need it.
    absl::StatusOr<OwnedBuffer> buffer = AllocateAligned(needed);
    if (!buffer.ok()) return buffer.status();
    std::memcpy(buffer->get(), bytes, static_cast<size_t>(needed));
    copy = *std::move(buffer);
  } else {
    // Start reading ahead now: the backend will stream the whole tensor.
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t start = reinterpret_cast<uintptr_t>(bytes) & ~(page - 1);
    madvise(reinterpret_cast<void*>(start),
            static_cast<size_t>(reinterpret_cast<uintptr_t>(bytes) + needed -
                                start),
            MADV_WILLNEED);
  }
  const void* data = copy ? static_cast<const void*>(copy.get()) : bytes;
  // A NaN or Inf weight turns every logit of its row into NaN: each request
  // would then fail as if the caller's hidden state were bad. Refuse the
  // checkpoint instead, naming the first bad element.
  const size_t elements = static_cast<size_t>(vocab * hidden);
  const size_t bad = FirstNonFinite(*dtype, data, elements);
  if (bad != elements) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " holds a non-finite value at row ", bad / hidden, ", column ",
        bad % hidden, " (element ", bad,
        "): ", absl::StrFormat("%g", ElementAsFloat(*dtype, data, bad)),
        "; every weight of an LM head must be finite"));
  }
  auto weights =
      std::make_unique<MappedWeights>(*std::move(file), std::move(copy));
  weights->Set(static_cast<int64_t>(vocab), static_cast<int64_t>(hidden),
               *dtype, data, index_path.empty() ? path : index_path, *chosen);
  return std::unique_ptr<Weights>(std::move(weights));
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path,
                                          int64_t max_bytes) {
  struct stat info;
  absl::StatusOr<int> opened = OpenRegularFile(path, &info);
  if (!opened.ok()) return opened.status();
  const int fd = *opened;
  std::string contents;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int error_number = errno;
      close(fd);
      return ErrnoStatus(error_number, absl::StrCat("reading ", path));
    }
    if (n == 0) break;
    contents.append(buffer, static_cast<size_t>(n));
    if (static_cast<int64_t>(contents.size()) > max_bytes) {
      close(fd);
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": larger than ", max_bytes, " bytes; not a checkpoint index"));
    }
  }
  close(fd);
  return contents;
}

// A sharded checkpoint: the index maps tensor names to shard files beside it;
// the chosen tensor lies wholly inside its shard.
absl::StatusOr<std::unique_ptr<Weights>> LoadIndex(
    const std::string& index_path, const std::string& tensor_name,
    std::optional<DType> expected) {
  absl::StatusOr<std::string> text = ReadSmallFile(index_path, kMaxIndexBytes);
  if (!text.ok()) return text.status();
  const Json index = Json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded() || !index.is_object()) {
    return absl::DataLossError(
        absl::StrCat(index_path, ": malformed index: not a JSON object"));
  }
  const auto weight_map = index.find("weight_map");
  if (weight_map == index.end() || !weight_map->is_object()) {
    return absl::DataLossError(absl::StrCat(
        index_path, ": malformed index: no \"weight_map\" object"));
  }
  std::vector<std::string> names;
  for (const auto& [name, file] : weight_map->items()) {
    if (!file.is_string()) {
      return absl::DataLossError(
          absl::StrCat(index_path, ": malformed index: weight_map entry '",
                       name, "' is not a file name string"));
    }
    names.push_back(name);
  }
  absl::StatusOr<std::string> chosen = ChooseTensor(
      tensor_name, index_path, names, [&](const std::string& name) {
        return weight_map->find(name) != weight_map->end();
      });
  if (!chosen.ok()) return chosen.status();
  const std::string shard = weight_map->find(*chosen)->get<std::string>();
  // Shards live beside the index; a path out of that folder is not a shard.
  if (shard.empty() || shard.front() == '/' ||
      absl::StrContains(absl::StrCat("/", shard, "/"), "/../")) {
    return absl::DataLossError(absl::StrCat(
        index_path, ": malformed index: shard file name '", shard,
        "' for tensor '", *chosen, "' must be relative to the index's folder"));
  }
  return LoadSafetensorsFile(JoinPath(DirName(index_path), shard), *chosen,
                             expected, index_path);
}

absl::StatusOr<std::unique_ptr<Weights>> LoadDirectory(
    const std::string& dir, const std::string& tensor_name,
    std::optional<DType> expected) {
  struct stat info;
  const std::string index = JoinPath(dir, kIndexFileName);
  if (stat(index.c_str(), &info) == 0) {
    return LoadIndex(index, tensor_name, expected);
  }
  const std::string single = JoinPath(dir, kSingleFileName);
  if (stat(single.c_str(), &info) == 0) {
    return LoadSafetensorsFile(single, tensor_name, expected, "");
  }
  // Otherwise accept exactly one *.safetensors file.
  std::vector<std::string> candidates;
  DIR* handle = opendir(dir.c_str());
  if (handle == nullptr) {
    return ErrnoStatus(errno, absl::StrCat("listing ", dir));
  }
  while (const dirent* entry = readdir(handle)) {
    const std::string name = entry->d_name;
    if (absl::EndsWith(name, ".safetensors")) candidates.push_back(name);
  }
  closedir(handle);
  if (candidates.size() == 1) {
    return LoadSafetensorsFile(JoinPath(dir, candidates[0]), tensor_name,
                               expected, "");
  }
  if (candidates.empty()) {
    return absl::NotFoundError(
        absl::StrCat(dir, ": no ", kIndexFileName, ", ", kSingleFileName,
                     " or other .safetensors file in this directory"));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      dir, ": no ", kIndexFileName, " and several .safetensors files (",
      ListNames(candidates), "); name the file or the index"));
}

class SyntheticWeights final : public Weights {
 public:
  SyntheticWeights(const SyntheticSpec& spec, std::string source,
                   OwnedBuffer buffer)
      : buffer_(std::move(buffer)) {
    vocab_size_ = spec.vocab;
    hidden_size_ = spec.hidden;
    dtype_ = spec.dtype;
    data_ = buffer_.get();
    source_ = std::move(source);
  }

 private:
  OwnedBuffer buffer_;
};

// Elements [first_pair * 2, end_pair * 2) of the synthetic tensor. Element
// 2p and 2p+1 come from one Philox call keyed by the seed with counter
// (p low, p high, 0, kSyntheticStream): each is a sum of four 16-bit uniforms
// (Irwin-Hall, close to normal within +-3.46 sigma), centred and scaled. Only
// integer arithmetic and one correctly rounded fp32 multiply: every machine
// and every thread split gives the same bits.
void FillSyntheticPairs(const SyntheticSpec& spec, float scale,
                        uint64_t first_pair, uint64_t end_pair, void* out) {
  const uint32_t key0 = static_cast<uint32_t>(spec.seed);
  const uint32_t key1 = static_cast<uint32_t>(spec.seed >> 32);
  auto* bf16 = static_cast<uint16_t*>(out);
  auto* fp32 = static_cast<float*>(out);
  for (uint64_t p = first_pair; p < end_pair; ++p) {
    const Philox4x32 bits = Philox4x32_10(
        Philox4x32{{static_cast<uint32_t>(p), static_cast<uint32_t>(p >> 32),
                    0u, kSyntheticStream}},
        key0, key1);
    float value[2];
    for (int k = 0; k < 2; ++k) {
      const uint32_t a = bits.v[2 * k];
      const uint32_t b = bits.v[2 * k + 1];
      const int32_t sum = static_cast<int32_t>((a & 0xffffu) + (a >> 16) +
                                               (b & 0xffffu) + (b >> 16));
      // 2 * sum - 4 * 65535 is an even integer in [-262140, 262140]: exact.
      value[k] = static_cast<float>(2 * sum - 4 * 65535) * scale;
    }
    switch (spec.dtype) {
      case DType::kBf16:
        bf16[2 * p] = FloatToBf16(value[0]);
        bf16[2 * p + 1] = FloatToBf16(value[1]);
        break;
      case DType::kFp16:
        bf16[2 * p] = FloatToHalf(value[0]);
        bf16[2 * p + 1] = FloatToHalf(value[1]);
        break;
      case DType::kFp32:
        fp32[2 * p] = value[0];
        fp32[2 * p + 1] = value[1];
        break;
    }
  }
}

absl::StatusOr<std::unique_ptr<Weights>> MakeSynthetic(
    const std::string& source, std::optional<DType> expected) {
  absl::StatusOr<SyntheticSpec> spec = ParseSyntheticSpec(source);
  if (!spec.ok()) return spec.status();
  if (expected.has_value() && *expected != spec->dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "synthetic weights '", source, "' have dtype ", DTypeName(spec->dtype),
        " but ", DTypeName(*expected), " was required"));
  }
  const uint64_t elements =
      static_cast<uint64_t>(spec->vocab) * static_cast<uint64_t>(spec->hidden);
  absl::StatusOr<OwnedBuffer> buffer =
      AllocateAligned(elements * DTypeSize(spec->dtype));
  if (!buffer.ok()) return buffer.status();

  // Target std 2.5 / sqrt(D): logits of a standard-normal hidden state then
  // have std 2.5, a spread of a few units like a trained LM head. The std of
  // 2 * sum is 4 * sqrt((65536^2 - 1) / 12); sqrt and the division are
  // correctly rounded, so the scale is the same everywhere.
  const double sum_std = 4.0 * std::sqrt((65536.0 * 65536.0 - 1.0) / 12.0);
  const float scale = static_cast<float>(
      2.5 / std::sqrt(static_cast<double>(spec->hidden)) / sum_std);

  // Split by pairs over a few threads; the values do not depend on the split.
  const uint64_t pairs = elements / 2;  // hidden is even
  constexpr uint64_t kPairsPerThread = uint64_t{1} << 21;
  const uint64_t hardware =
      std::max<uint64_t>(1, std::thread::hardware_concurrency());
  const uint64_t threads = std::clamp<uint64_t>(
      pairs / kPairsPerThread, 1, std::min<uint64_t>(hardware, 16));
  void* out = buffer->get();
  std::vector<std::thread> workers;
  uint64_t done_inline_from = 0;
  for (uint64_t t = 1; t < threads; ++t) {
    const uint64_t first = pairs * t / threads;
    const uint64_t end = pairs * (t + 1) / threads;
    try {
      workers.emplace_back(FillSyntheticPairs, std::cref(*spec), scale, first,
                           end, out);
    } catch (const std::system_error&) {
      // No thread to be had: this thread does the rest itself.
      done_inline_from = first;
      break;
    }
  }
  FillSyntheticPairs(*spec, scale, 0, pairs / threads, out);
  if (done_inline_from != 0) {
    FillSyntheticPairs(*spec, scale, done_inline_from, pairs, out);
  }
  for (std::thread& worker : workers) worker.join();

  return std::unique_ptr<Weights>(
      std::make_unique<SyntheticWeights>(*spec, source, *std::move(buffer)));
}

}  // namespace

size_t Weights::size_bytes() const {
  return static_cast<size_t>(vocab_size_) * static_cast<size_t>(hidden_size_) *
         DTypeSize(dtype_);
}

absl::StatusOr<DType> ParseWeightsDType(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "bf16" || lower == "bfloat16") return DType::kBf16;
  if (lower == "fp16" || lower == "f16" || lower == "float16" ||
      lower == "half") {
    return DType::kFp16;
  }
  if (lower == "fp32" || lower == "f32" || lower == "float32" ||
      lower == "float") {
    return DType::kFp32;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("weight dtype '", name, "' is not one of bf16, fp16, fp32"));
}

absl::StatusOr<SyntheticSpec> ParseSyntheticSpec(absl::string_view source) {
  if (!absl::StartsWith(source, kSyntheticPrefix)) {
    return absl::InvalidArgumentError(
        absl::StrCat("synthetic weights spec '", source, "' must start with '",
                     kSyntheticPrefix, "'"));
  }
  const absl::string_view body = source.substr(kSyntheticPrefix.size());
  const std::string context = absl::StrCat(
      "synthetic weights spec '", source,
      "' (expected synthetic:vocab=V,hidden=D,seed=S[,dtype=bf16|fp16|fp32])");
  SyntheticSpec spec;
  std::set<std::string> seen;
  std::vector<absl::string_view> items;
  if (!absl::StripAsciiWhitespace(body).empty()) {
    items = absl::StrSplit(body, ',');
  }
  for (absl::string_view item : items) {
    item = absl::StripAsciiWhitespace(item);
    if (item.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(context, ": empty item"));
    }
    const size_t equals = item.find('=');
    if (equals == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          context, ": item '", item, "' is not of the form key=value"));
    }
    const std::string key(absl::StripAsciiWhitespace(item.substr(0, equals)));
    const absl::string_view value =
        absl::StripAsciiWhitespace(item.substr(equals + 1));
    if (!seen.insert(key).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(context, ": key '", key, "' given twice"));
    }
    if (key == "vocab" || key == "hidden") {
      int64_t number = 0;
      if (!absl::SimpleAtoi(value, &number)) {
        return absl::InvalidArgumentError(absl::StrCat(
            context, ": ", key, "='", value, "' is not an integer"));
      }
      (key == "vocab" ? spec.vocab : spec.hidden) = number;
    } else if (key == "seed") {
      if (!absl::SimpleAtoi(value, &spec.seed)) {
        return absl::InvalidArgumentError(absl::StrCat(
            context, ": seed='", value, "' is not an unsigned 64-bit integer"));
      }
    } else if (key == "dtype") {
      absl::StatusOr<DType> dtype = ParseWeightsDType(value);
      if (!dtype.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            context, ": dtype='", value, "' is not one of bf16, fp16, fp32"));
      }
      spec.dtype = *dtype;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(context, ": unknown key '", key,
                       "' (known: vocab, hidden, seed, dtype)"));
    }
  }
  if (seen.count("vocab") == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": missing key 'vocab'"));
  }
  if (seen.count("hidden") == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": missing key 'hidden'"));
  }
  if (spec.vocab <= 0 || spec.vocab > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        context, ": vocab=", spec.vocab, " must be in [1, 2^31 - 1]"));
  }
  if (spec.hidden < 8 || spec.hidden > kMaxSyntheticHidden ||
      spec.hidden % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        context, ": hidden=", spec.hidden, " must be a multiple of 8 in [8, ",
        kMaxSyntheticHidden, "] (the CUDA kernels need a multiple of 64)"));
  }
  const uint64_t bytes = static_cast<uint64_t>(spec.vocab) *
                         static_cast<uint64_t>(spec.hidden) *
                         DTypeSize(spec.dtype);
  if (bytes > kMaxSyntheticBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": vocab x hidden is ", bytes,
                     " bytes, above the 64 GiB limit"));
  }
  return spec;
}

absl::StatusOr<std::unique_ptr<Weights>> Weights::Load(
    const WeightsOptions& options) {
  std::optional<DType> expected;
  if (!options.expected_dtype.empty()) {
    absl::StatusOr<DType> dtype = ParseWeightsDType(options.expected_dtype);
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("expected weight dtype: ", dtype.status().message()));
    }
    expected = *dtype;
  }
  const std::string& source = options.source;
  if (source.empty()) {
    return absl::InvalidArgumentError(
        "weights source is empty: give a .safetensors file, a "
        "model.safetensors.index.json, a directory holding either, or "
        "synthetic:vocab=V,hidden=D,seed=S");
  }
  if (absl::StartsWith(source, kSyntheticPrefix)) {
    if (!options.tensor_name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a tensor name ('", options.tensor_name,
          "') makes no sense for synthetic weights '", source, "'"));
    }
    return MakeSynthetic(source, expected);
  }
  struct stat info;
  if (stat(source.c_str(), &info) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) {
      return absl::NotFoundError(absl::StrCat(
          "weights source '", source,
          "' does not exist (expected a .safetensors file, a "
          "model.safetensors.index.json, a directory holding either, or "
          "synthetic:vocab=V,hidden=D,seed=S)"));
    }
    return ErrnoStatus(errno, absl::StrCat("stat of ", source));
  }
  if (S_ISDIR(info.st_mode)) {
    return LoadDirectory(source, options.tensor_name, expected);
  }
  if (absl::EndsWith(source, ".json")) {
    return LoadIndex(source, options.tensor_name, expected);
  }
  return LoadSafetensorsFile(source, options.tensor_name, expected, "");
}

namespace {

absl::Status WriteAll(int fd, const std::string& path, const void* data,
                      uint64_t size) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  while (size > 0) {
    // Linux writes at most ~2 GiB per call.
    const size_t chunk =
        static_cast<size_t>(std::min<uint64_t>(size, uint64_t{1} << 30));
    const ssize_t n = write(fd, bytes, chunk);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("writing ", path));
    }
    bytes += n;
    size -= static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteSafetensors(
    const std::string& path, const std::vector<TensorToWrite>& tensors,
    const std::map<std::string, std::string>& metadata) {
  std::set<std::string> names;
  for (const TensorToWrite& tensor : tensors) {
    if (tensor.name.empty() || tensor.name == kMetadataKey) {
      return absl::InvalidArgumentError(absl::StrCat("WriteSafetensors(", path,
                                                     "): invalid tensor name '",
                                                     tensor.name, "'"));
    }
    if (!names.insert(tensor.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("WriteSafetensors(", path,
                                                     "): tensor '", tensor.name,
                                                     "' given twice"));
    }
    if (tensor.rows < 0 || tensor.cols < 0 ||
        tensor.rows > std::numeric_limits<int32_t>::max() ||
        tensor.cols > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat("WriteSafetensors(", path, "): tensor '", tensor.name,
                       "' has shape [", tensor.rows, ", ", tensor.cols,
                       "]; extents must be in [0, 2^31)"));
    }
    if (tensor.data == nullptr && tensor.rows * tensor.cols > 0) {
      return absl::InvalidArgumentError(absl::StrCat("WriteSafetensors(", path,
                                                     "): tensor '", tensor.name,
                                                     "' has no data"));
    }
  }
  // Widest dtype first: with the header padded to 8 bytes, every tensor then
  // starts at a multiple of its element size, as safetensors itself does.
  std::vector<const TensorToWrite*> order;
  for (const TensorToWrite& tensor : tensors) order.push_back(&tensor);
  std::stable_sort(order.begin(), order.end(),
                   [](const TensorToWrite* a, const TensorToWrite* b) {
                     return DTypeSize(a->dtype) > DTypeSize(b->dtype);
                   });
  Json header = Json::object();
  if (!metadata.empty()) {
    Json meta = Json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header[kMetadataKey] = std::move(meta);
  }
  uint64_t offset = 0;
  std::vector<uint64_t> sizes;
  for (const TensorToWrite* tensor : order) {
    const uint64_t size = static_cast<uint64_t>(tensor->rows) *
                          static_cast<uint64_t>(tensor->cols) *
                          DTypeSize(tensor->dtype);
    header[tensor->name] = {
        {"dtype", SafetensorsName(tensor->dtype)},
        {"shape", {tensor->rows, tensor->cols}},
        {"data_offsets", {offset, offset + size}},
    };
    sizes.push_back(size);
    offset += size;
  }
  // Replace (not throw on) invalid UTF-8 in names: this function never throws.
  std::string text = header.dump(-1, ' ', /*ensure_ascii=*/false,
                                 Json::error_handler_t::replace);
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) {
    length[i] =
        static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  }

  const int fd =
      open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("creating ", path));
  absl::Status status = WriteAll(fd, path, length, sizeof(length));
  if (status.ok()) status = WriteAll(fd, path, text.data(), text.size());
  for (size_t i = 0; i < order.size() && status.ok(); ++i) {
    status = WriteAll(fd, path, order[i]->data, sizes[i]);
  }
  if (close(fd) != 0 && status.ok()) {
    status = ErrnoStatus(errno, absl::StrCat("closing ", path));
  }
  return status;
}

}  // namespace flashsampler
