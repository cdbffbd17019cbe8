// Fuzz target: the weights loader on arbitrary checkpoints. The first byte
// picks the layout: a single .safetensors file, or a directory holding a
// model.safetensors.index.json (the bytes before the first NUL) and the shard
// it may name, model-00001.safetensors (the bytes after). The loader must
// return a status or weights whose tensor lies inside the file, has the
// declared shape and size, and holds no NaN or Inf.
#include <fcntl.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "common/dtype_convert.h"
#include "service/weights/weights.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

const std::string& WorkDir() {
  static const std::string* dir = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern =
        std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") +
        "/fs_safetensors_fuzz_XXXXXX";
    FUZZ_CHECK(mkdtemp(pattern.data()) != nullptr, "mkdtemp %s",
               pattern.c_str());
    return new std::string(pattern);
  }();
  return *dir;
}

void WriteFile(const std::string& path, absl::string_view bytes) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  FUZZ_CHECK(fd >= 0, "creating %s", path.c_str());
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    FUZZ_CHECK(n > 0, "writing %s", path.c_str());
    done += static_cast<size_t>(n);
  }
  close(fd);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace flashsampler;
  if (size < 1) return 0;
  const std::string& dir = WorkDir();
  const absl::string_view rest(reinterpret_cast<const char*>(data + 1),
                               size - 1);
  const std::string single = dir + "/single.safetensors";
  const std::string index = dir + "/model.safetensors.index.json";
  const std::string shard = dir + "/model-00001.safetensors";
  unlink(single.c_str());
  unlink(index.c_str());
  unlink(shard.c_str());
  WeightsOptions options;
  absl::string_view file_bytes = rest;
  if (data[0] & 1) {
    const size_t nul = rest.find('\0');
    WriteFile(index, rest.substr(0, nul));
    file_bytes = nul == absl::string_view::npos ? absl::string_view()
                                                : rest.substr(nul + 1);
    WriteFile(shard, file_bytes);
    options.source = (data[0] & 2) ? index : dir;
  } else {
    WriteFile(single, rest);
    options.source = single;
  }
  // Sometimes name a tensor (one of the corpus's names) or require a dtype.
  if (data[0] & 4) options.tensor_name = "t";
  if (data[0] & 8) options.expected_dtype = (data[0] & 16) ? "bf16" : "F32";

  absl::StatusOr<std::unique_ptr<Weights>> weights = Weights::Load(options);
  if (!weights.ok()) {
    FUZZ_CHECK(weights.status().code() != absl::StatusCode::kUnknown &&
                   weights.status().code() != absl::StatusCode::kInternal &&
                   !weights.status().message().empty(),
               "%s", weights.status().ToString().c_str());
    return 0;
  }
  const Weights& w = **weights;
  FUZZ_CHECK(w.vocab_size() >= 1 && w.hidden_size() >= 1, "empty tensor");
  const size_t bytes = w.size_bytes();
  FUZZ_CHECK(bytes == static_cast<size_t>(w.vocab_size()) *
                          static_cast<size_t>(w.hidden_size()) *
                          DTypeSize(w.dtype()),
             "size_bytes %zu", bytes);
  FUZZ_CHECK(bytes <= file_bytes.size(),
             "%zu tensor bytes from a %zu-byte file", bytes, file_bytes.size());
  FUZZ_CHECK(reinterpret_cast<uintptr_t>(w.data()) % DTypeSize(w.dtype()) == 0,
             "misaligned data");
  // The tensor's bytes are somewhere in the file (they may have been copied
  // to aligned memory): search for them.
  const absl::string_view tensor(static_cast<const char*>(w.data()), bytes);
  FUZZ_CHECK(file_bytes.find(tensor) != absl::string_view::npos,
             "tensor bytes not found in the file");
  FUZZ_CHECK(AllFinite(w.dtype(), w.data(), bytes / DTypeSize(w.dtype())),
             "non-finite weights accepted");
  return 0;
}
