// Hidden states by reference: SharedMemoryRegistry's refusals and copies, a
// region that shrinks under the daemon (SIGBUS turned into one failed
// request), and Sample() over gRPC with Tensor.shared_memory against the same
// request carrying its bytes.
#include "service/serving/shared_memory.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/shared_memory.h"
#include "common/field_violation.h"
#include "common/status_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/service/serving/service_test_util.h"

namespace flashsampler {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr int64_t kVocab = 1000;
constexpr int64_t kHidden = 16;
constexpr absl::Duration kWait = absl::Seconds(10);

// A key no other test process uses.
std::string UniqueKey() {
  static std::atomic<int> next{0};
  return absl::StrCat("/fs_test_", getpid(), "_", next++);
}

std::unique_ptr<SharedMemoryRegion> MakeRegion(size_t bytes) {
  auto region = SharedMemoryRegion::Create(UniqueKey(), bytes);
  EXPECT_TRUE(region.ok()) << region.status();
  return region.ok() ? *std::move(region) : nullptr;
}

TEST(SharedMemoryRegistryTest, RegistersAndCopiesOutTheBytesAtAnOffset) {
  std::unique_ptr<SharedMemoryRegion> region = MakeRegion(4096);
  ASSERT_NE(region, nullptr);
  for (size_t i = 0; i < region->size(); ++i) {
    region->data()[i] = static_cast<char>(i * 7);
  }
  SharedMemoryRegistry registry(2);
  ASSERT_TRUE(registry.Register("a", region->key(), 4096).ok());
  EXPECT_EQ(registry.size(), 1);
  std::vector<char> out(100);
  ASSERT_TRUE(registry.Read("a", 1000, out.size(), "t", out.data()).ok());
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i], static_cast<char>((1000 + i) * 7)) << i;
  }
  // The region is read at each request: later writes are seen.
  region->data()[1000] = 42;
  ASSERT_TRUE(registry.Read("a", 1000, 1, "t", out.data()).ok());
  EXPECT_EQ(out[0], 42);
  ASSERT_TRUE(registry.Unregister("a").ok());
  EXPECT_EQ(registry.size(), 0);
  EXPECT_EQ(registry.Read("a", 0, 1, "t", out.data()).code(),
            absl::StatusCode::kNotFound);
}

TEST(SharedMemoryRegistryTest, RefusalsNameTheField) {
  std::unique_ptr<SharedMemoryRegion> region = MakeRegion(4096);
  ASSERT_NE(region, nullptr);
  SharedMemoryRegistry registry(1);
  const struct {
    std::string name, key;
    uint64_t bytes;
    absl::StatusCode code;
    std::string field;  // of the violation; "" when none
  } cases[] = {
      {"", region->key(), 16, absl::StatusCode::kInvalidArgument, "name"},
      {std::string(257, 'n'), region->key(), 16,
       absl::StatusCode::kInvalidArgument, "name"},
      {"a", "no_slash", 16, absl::StatusCode::kInvalidArgument, "key"},
      {"a", "/two/slashes", 16, absl::StatusCode::kInvalidArgument, "key"},
      {"a", "/", 16, absl::StatusCode::kInvalidArgument, "key"},
      {"a", region->key(), 0, absl::StatusCode::kInvalidArgument, "byte_size"},
      {"a", region->key(), 4097, absl::StatusCode::kInvalidArgument,
       "byte_size"},
      {"a", UniqueKey(), 16, absl::StatusCode::kNotFound, ""},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(absl::StrCat(c.name.substr(0, 8), " ", c.key, " ", c.bytes));
    const absl::Status s = registry.Register(c.name, c.key, c.bytes);
    EXPECT_EQ(s.code(), c.code) << s;
    const auto violation = GetFieldViolation(s);
    if (c.field.empty()) {
      EXPECT_FALSE(violation.has_value()) << s;
    } else {
      ASSERT_TRUE(violation.has_value()) << s;
      EXPECT_EQ(violation->field, c.field);
    }
  }
  EXPECT_EQ(registry.size(), 0);

  ASSERT_TRUE(registry.Register("a", region->key(), 4096).ok());
  EXPECT_EQ(registry.Register("a", region->key(), 16).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry.Register("b", region->key(), 16).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(registry.Unregister("b").code(), absl::StatusCode::kNotFound);

  char out[16];
  const absl::Status past_end = registry.Read("a", 4090, 16, "t", out);
  EXPECT_EQ(past_end.code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(GetFieldViolation(past_end).has_value());
  EXPECT_EQ(GetFieldViolation(past_end)->field, "t.offset");
  // An offset beyond 2^64 - bytes must not wrap around into the region.
  EXPECT_EQ(registry.Read("a", ~uint64_t{0}, 16, "t", out).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(registry.Read("z", 0, 16, "t", out).message()),
              StartsWith("t.region: "));
}

// A caller that shrinks its object after registering it: the read past the
// new end raises SIGBUS, which fails that read alone.
TEST(SharedMemoryRegistryTest, AShrunkRegionFailsTheReadAndTheProcessLives) {
  std::unique_ptr<SharedMemoryRegion> region = MakeRegion(1 << 16);
  ASSERT_NE(region, nullptr);
  SharedMemoryRegistry registry(1);
  ASSERT_TRUE(registry.Register("a", region->key(), 1 << 16).ok());
  const int fd = shm_open(region->key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  close(fd);
  std::vector<char> out(1 << 16);
  const absl::Status s = registry.Read(
      "a", 0, out.size(), "hidden_states.shared_memory", out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("smaller than when it was registered"));
  // What is still there reads as before, and again after a failure.
  EXPECT_TRUE(registry.Read("a", 0, 4096, "t", out.data()).ok());
  EXPECT_FALSE(registry.Read("a", 0, 8192, "t", out.data()).ok());
}

// The launch-time copy: rows past a 64 KB chunk keep their index, and the
// check reads what was copied.
TEST(SharedMemoryRegistryTest, CopyFiniteRowsNamesTheFirstBadRow) {
  constexpr int kRows = 40;
  constexpr int64_t kDim = 1024;  // 16 fp32 rows per 64 KB chunk
  std::vector<float> src(kRows * kDim, 1.5f);
  std::vector<float> dst(src.size(), 0.0f);
  ASSERT_TRUE(CopyFiniteRows(DType::kFp32,
                             reinterpret_cast<const char*>(src.data()), kRows,
                             kDim, reinterpret_cast<char*>(dst.data()))
                  .ok());
  EXPECT_EQ(dst, src);
  src[37 * kDim + 5] = std::numeric_limits<float>::infinity();
  const absl::Status s =
      CopyFiniteRows(DType::kFp32, reinterpret_cast<const char*>(src.data()),
                     kRows, kDim, reinterpret_cast<char*>(dst.data()));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(s.message()),
            "hidden_states.shared_memory: must be finite, row 37 holds NaN "
            "or Inf");
}

// The launch-time copy from an object shrunk under its mapping: the rows
// past the new end fail the copy alone, and the rows before it still copy.
TEST(SharedMemoryRegistryTest, CopyFiniteRowsFromAShrunkRegionFailsAlone) {
  constexpr int64_t kDim = 1024;  // 4 KB fp32 rows
  std::unique_ptr<SharedMemoryRegion> region = MakeRegion(1 << 16);
  ASSERT_NE(region, nullptr);
  SharedMemoryRegistry registry(1);
  ASSERT_TRUE(registry.Register("a", region->key(), 1 << 16).ok());
  absl::StatusOr<SharedBytes> bytes =
      registry.Find("a", 0, 1 << 16, "hidden_states.shared_memory");
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  const int fd = shm_open(region->key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  close(fd);
  std::vector<float> dst(16 * kDim);
  const absl::Status s = CopyFiniteRows(DType::kFp32, bytes->data, 16, kDim,
                                        reinterpret_cast<char*>(dst.data()));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("smaller than when it was registered"));
  EXPECT_TRUE(CopyFiniteRows(DType::kFp32, bytes->data, 1, kDim,
                             reinterpret_cast<char*>(dst.data()))
                  .ok());
}

TEST(SharedMemoryRegistryDeathTest, ASigbusOutsideACopyStillKills) {
  SharedMemoryRegistry registry(1);  // installs the handler
  EXPECT_EXIT(raise(SIGBUS), ::testing::KilledBySignal(SIGBUS), "");
}

testing::FakeServer StartWithRegions(int regions) {
  ServerOptions options = testing::TestServerOptions();
  options.max_shared_memory_regions = regions;
  absl::StatusOr<testing::FakeServer> fake = testing::StartFakeServer(options);
  EXPECT_TRUE(fake.ok()) << fake.status();
  return *std::move(fake);
}

grpc::Status Call(testing::FakeServer& f, const v1::SampleRequest& request,
                  v1::SampleResponse* response) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kWait));
  return f.stub->Sample(&context, request, response);
}

grpc::Status Register(testing::FakeServer& f, const std::string& name,
                      const std::string& key, uint64_t bytes) {
  v1::RegisterSharedMemoryRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_byte_size(bytes);
  v1::RegisterSharedMemoryResponse response;
  grpc::ClientContext context;
  return f.stub->RegisterSharedMemory(&context, request, &response);
}

TEST(SharedMemoryServerTest, RequestsByReferenceGetTheTokensOfTheirBytes) {
  testing::FakeServer f = StartWithRegions(4);
  v1::ModelInfo info;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(
        f.stub->GetModelInfo(&context, v1::GetModelInfoRequest(), &info).ok());
  }
  EXPECT_EQ(info.max_shared_memory_regions(), 4);

  // Two requests side by side in one region.
  const v1::SampleRequest first = testing::MakeRequest(3, kHidden, 11, 0.5f);
  const v1::SampleRequest second = testing::MakeRequest(5, kHidden, 21, 2.0f);
  const size_t first_bytes = first.hidden_states().data().size();
  std::unique_ptr<SharedMemoryRegion> region =
      MakeRegion(first_bytes + second.hidden_states().data().size());
  ASSERT_NE(region, nullptr);
  ASSERT_TRUE(Register(f, "r", region->key(), region->size()).ok());
  v1::SampleRequest by_ref_first = first;
  v1::SampleRequest by_ref_second = second;
  ASSERT_TRUE(
      MoveHiddenStatesToSharedMemory(*region, "r", 0, &by_ref_first).ok());
  ASSERT_TRUE(
      MoveHiddenStatesToSharedMemory(*region, "r", first_bytes, &by_ref_second)
          .ok());
  EXPECT_TRUE(by_ref_first.hidden_states().data().empty());

  v1::SampleResponse response;
  ASSERT_TRUE(Call(f, by_ref_first, &response).ok());
  EXPECT_THAT(response.token_ids(),
              ElementsAreArray(testing::ExpectedFakeTokens(first, kVocab)));
  ASSERT_TRUE(Call(f, by_ref_second, &response).ok());
  EXPECT_THAT(response.token_ids(),
              ElementsAreArray(testing::ExpectedFakeTokens(second, kVocab)));

  // The region's bytes are read at each request, never cached.
  std::memcpy(region->data(), second.hidden_states().data().data(),
              first_bytes);
  ASSERT_TRUE(Call(f, by_ref_first, &response).ok());
  v1::SampleRequest rewritten = first;
  rewritten.mutable_hidden_states()->set_data(
      second.hidden_states().data().substr(0, first_bytes));
  EXPECT_THAT(response.token_ids(),
              ElementsAreArray(testing::ExpectedFakeTokens(rewritten, kVocab)));

  // Unregistered: the same request is NOT_FOUND naming the reference.
  {
    v1::UnregisterSharedMemoryRequest request;
    request.set_name("r");
    v1::UnregisterSharedMemoryResponse unregistered;
    grpc::ClientContext context;
    ASSERT_TRUE(
        f.stub->UnregisterSharedMemory(&context, request, &unregistered).ok());
  }
  const grpc::Status gone = Call(f, by_ref_first, &response);
  EXPECT_EQ(gone.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(gone.error_message(),
              StartsWith("hidden_states.shared_memory.region: "));
}

TEST(SharedMemoryServerTest, BadReferencesFailTheirRequestAlone) {
  testing::FakeServer f = StartWithRegions(1);
  const v1::SampleRequest valid = testing::MakeRequest(2, kHidden, 5);
  std::unique_ptr<SharedMemoryRegion> region =
      MakeRegion(valid.hidden_states().data().size());
  ASSERT_NE(region, nullptr);
  ASSERT_TRUE(Register(f, "r", region->key(), region->size()).ok());
  EXPECT_EQ(Register(f, "r2", region->key(), region->size()).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);

  v1::SampleRequest by_ref = valid;
  ASSERT_TRUE(MoveHiddenStatesToSharedMemory(*region, "r", 0, &by_ref).ok());

  v1::SampleRequest both = by_ref;
  both.mutable_hidden_states()->set_data(valid.hidden_states().data());
  v1::SampleRequest past_end = by_ref;
  past_end.mutable_hidden_states()->mutable_shared_memory()->set_offset(4);
  v1::SampleRequest not_finite = by_ref;
  const struct {
    const char* name;
    const v1::SampleRequest* request;
    grpc::StatusCode code;
    std::string field;
  } cases[] = {
      {"data and shared_memory", &both, grpc::StatusCode::INVALID_ARGUMENT,
       "hidden_states.data"},
      {"past the region's end", &past_end, grpc::StatusCode::INVALID_ARGUMENT,
       "hidden_states.shared_memory.offset"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    v1::SampleResponse response;
    const grpc::Status s = Call(f, *c.request, &response);
    EXPECT_EQ(s.error_code(), c.code) << s.error_message();
    const std::vector<FieldViolation> violations = FieldViolations(s);
    ASSERT_EQ(violations.size(), 1u) << s.error_message();
    EXPECT_EQ(violations[0].field, c.field);
  }
  // Validation reads the copy: a NaN written into the region is refused.
  const float nan = std::nanf("");
  std::memcpy(region->data() + 4, &nan, sizeof(nan));
  v1::SampleResponse response;
  const grpc::Status refused = Call(f, not_finite, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(refused.error_message(),
              StartsWith("hidden_states.shared_memory: must be finite, row 0"));
  // A shrunk object fails the request and the daemon keeps serving.
  const int fd = shm_open(region->key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 0), 0);
  close(fd);
  const grpc::Status shrunk = Call(f, by_ref, &response);
  EXPECT_EQ(shrunk.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(shrunk.error_message(),
              StartsWith("hidden_states.shared_memory.region: "));
  ASSERT_TRUE(Call(f, valid, &response).ok());
  EXPECT_THAT(response.token_ids(),
              ElementsAreArray(testing::ExpectedFakeTokens(valid, kVocab)));
}

TEST(SharedMemoryServerTest, ADaemonWithoutRegionsRefusesThemAsAPrecondition) {
  testing::FakeServer f = StartWithRegions(0);
  std::unique_ptr<SharedMemoryRegion> region = MakeRegion(4096);
  ASSERT_NE(region, nullptr);
  const grpc::Status refused = Register(f, "r", region->key(), 4096);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(refused.error_message(),
              HasSubstr("--max_shared_memory_regions"));

  v1::SampleRequest by_ref = testing::MakeRequest(1, kHidden, 5);
  ASSERT_TRUE(MoveHiddenStatesToSharedMemory(*region, "r", 0, &by_ref).ok());
  v1::SampleResponse response;
  const grpc::Status s = Call(f, by_ref, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), StartsWith("hidden_states.shared_memory: "));
}

TEST(SharedMemoryServerTest, RegionCountOutOfRangeIsRefusedAtCreate) {
  ServerOptions options = testing::TestServerOptions();
  options.max_shared_memory_regions = -1;
  absl::StatusOr<testing::FakeServer> fake = testing::StartFakeServer(options);
  ASSERT_FALSE(fake.ok());
  EXPECT_THAT(std::string(fake.status().message()),
              StartsWith("max_shared_memory_regions"));
}

}  // namespace
}  // namespace flashsampler
