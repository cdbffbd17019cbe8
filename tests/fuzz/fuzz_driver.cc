// Standalone driver for the libFuzzer targets in this folder, linked when
// FS_FUZZ is OFF (any compiler, no libFuzzer): runs every corpus file, then
// random mutations of them for a bounded count and time, so CTest runs a
// short fuzz pass in every build. Accepts the libFuzzer flags the tests and
// scripts/fuzz.sh use (-runs=N, -max_total_time=S, -seed=N); other -flags
// are ignored, other arguments are corpus files or directories.
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv)
    __attribute__((weak));

namespace {

// Inputs grow at most to this many bytes by mutation (libFuzzer's default
// -max_len for a corpus of small files is 4096).
constexpr size_t kMaxLen = 4096;

void AddPath(const std::string& path, std::vector<std::string>* files) {
  struct stat info;
  if (stat(path.c_str(), &info) != 0) {
    std::fprintf(stderr, "fuzz_driver: no such corpus path %s\n", path.c_str());
    std::exit(2);
  }
  if (!S_ISDIR(info.st_mode)) {
    files->push_back(path);
    return;
  }
  DIR* dir = opendir(path.c_str());
  if (dir == nullptr) return;
  std::vector<std::string> names;
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') names.push_back(entry->d_name);
  }
  closedir(dir);
  for (const std::string& name : names) AddPath(path + "/" + name, files);
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// One random edit of `input`: the classic byte-level mutations (flip a bit,
// set a byte to a random or interesting value, insert, erase, duplicate a
// chunk, splice in part of another corpus input, overwrite a 4-byte field).
void Mutate(std::mt19937_64& rng, const std::vector<std::string>& corpus,
            std::string* input) {
  auto pick = [&rng](size_t n) { return n == 0 ? 0 : rng() % n; };
  static const uint8_t kInteresting[] = {0,   1,   0x7f, 0x80, 0xff, 0xfe,
                                         '0', '9', '"',  '{',  '}',  ','};
  switch (rng() % 8) {
    case 0:
      if (!input->empty()) {
        (*input)[pick(input->size())] ^= static_cast<char>(1u << (rng() % 8));
      }
      break;
    case 1:
      if (!input->empty()) {
        (*input)[pick(input->size())] =
            static_cast<char>(kInteresting[pick(sizeof(kInteresting))]);
      }
      break;
    case 2:
      if (input->size() < kMaxLen) {
        input->insert(input->begin() + pick(input->size() + 1),
                      static_cast<char>(rng()));
      }
      break;
    case 3:
      if (!input->empty()) {
        const size_t at = pick(input->size());
        input->erase(at, 1 + pick(std::min<size_t>(16, input->size() - at)));
      }
      break;
    case 4:
      if (!input->empty() && input->size() < kMaxLen) {
        const size_t at = pick(input->size());
        const size_t n = 1 + pick(std::min<size_t>(64, input->size() - at));
        input->insert(pick(input->size() + 1), input->substr(at, n));
      }
      break;
    case 5: {
      const std::string& other = corpus[pick(corpus.size())];
      if (!other.empty()) {
        const size_t from = pick(other.size());
        const size_t n = 1 + pick(other.size() - from);
        const size_t at = pick(input->size() + 1);
        input->replace(at, std::min(n, input->size() - at),
                       other.substr(from, n));
      }
      break;
    }
    case 6:
      if (input->size() >= 4) {
        const uint32_t values[] = {0,           1,
                                   0xffffffffu, 0x7fffffffu,
                                   0x80000000u, static_cast<uint32_t>(rng())};
        const uint32_t v = values[pick(6)];
        std::memcpy(&(*input)[pick(input->size() - 3)], &v, 4);
      }
      break;
    default:
      if (!input->empty()) input->resize(pick(input->size()));
      break;
  }
  if (input->size() > kMaxLen) input->resize(kMaxLen);
}

}  // namespace

int main(int argc, char** argv) {
  if (LLVMFuzzerInitialize != nullptr) LLVMFuzzerInitialize(&argc, &argv);
  long long runs = 20000;
  double max_seconds = 2.0;
  uint64_t seed = 1;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("-runs=", 0) == 0) {
      runs = std::atoll(arg.c_str() + 6);
    } else if (arg.rfind("-max_total_time=", 0) == 0) {
      max_seconds = std::atof(arg.c_str() + 16);
    } else if (arg.rfind("-seed=", 0) == 0) {
      seed = std::strtoull(arg.c_str() + 6, nullptr, 10);
    } else if (arg.rfind("-", 0) == 0) {
      continue;  // a libFuzzer flag this driver has no use for
    } else {
      AddPath(arg, &files);
    }
  }
  std::vector<std::string> corpus;
  for (const std::string& file : files) {
    corpus.push_back(ReadAll(file));
    const std::string& input = corpus.back();
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(input.data()),
                           input.size());
  }
  if (corpus.empty()) corpus.push_back(std::string());
  std::printf("fuzz_driver: %zu corpus inputs ran\n", corpus.size());

  std::mt19937_64 rng(seed);
  const auto start = std::chrono::steady_clock::now();
  long long done = 0;
  for (; done < runs; ++done) {
    if ((done & 63) == 0 &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                .count() > max_seconds) {
      break;
    }
    std::string input = corpus[rng() % corpus.size()];
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) Mutate(rng, corpus, &input);
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(input.data()),
                           input.size());
    // Keep some mutants as parents so edits compound.
    if (rng() % 16 == 0 && corpus.size() < 4096) corpus.push_back(input);
  }
  std::printf("fuzz_driver: %lld mutated inputs ran (seed %llu)\n", done,
              static_cast<unsigned long long>(seed));
  return 0;
}
