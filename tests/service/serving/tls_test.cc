// TLS and mutual TLS on the real server: certificates are made per test run
// with the openssl CLI (an EC test CA, a server cert for "localhost", a
// client cert), then plaintext, wrong-trust and certificate-less clients must
// fail while properly configured ones sample.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "tests/service/serving/service_test_util.h"

namespace flashsampler {
namespace {

constexpr int64_t kHidden = 16;

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing::MakeTempDir());
    const std::string d = *dir_;
    // EC keys: fast to generate; SAN DNS:localhost for hostname checks.
    const std::string script = absl::StrCat(
        "set -e; cd ", d, "; ",
        "K='-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes'; ",
        "openssl req -x509 $K -keyout ca.key -out ca.pem -days 2 "
        "-subj /CN=fs-test-ca 2>/dev/null; ",
        "openssl req -x509 $K -keyout other_ca.key -out other_ca.pem -days 2 "
        "-subj /CN=fs-other-ca 2>/dev/null; ",
        "for who in server client; do ",
        "openssl req $K -keyout $who.key -out $who.csr -subj /CN=localhost "
        "2>/dev/null; ",
        "printf 'subjectAltName=DNS:localhost\\n' > $who.ext; ",
        "openssl x509 -req -in $who.csr -CA ca.pem -CAkey ca.key "
        "-CAcreateserial -out $who.pem -days 2 -extfile $who.ext 2>/dev/null; ",
        "done; ",
        // Bad material for the start-up checks.
        "openssl pkey -in server.key -aes256 -passout pass:secret "
        "-out encrypted.key 2>/dev/null; ",
        "printf 'not a certificate\\n' > garbage.pem; ",
        "head -c 300 server.pem > truncated.pem; ", "mkdir keydir");
    {
      std::ofstream out(d + "/make_certs.sh");
      out << script << "\n";
    }
    ok_ = std::system(("bash " + d + "/make_certs.sh").c_str()) == 0;
  }
  static void TearDownTestSuite() {
    std::error_code ignored;
    std::filesystem::remove_all(*dir_, ignored);
    delete dir_;
  }

  static std::string Read(const std::string& name) {
    return testing::ReadFileOrEmpty(*dir_ + "/" + name);
  }

  // Starts a fake-engine server with TLS (and mTLS when `mutual`).
  testing::FakeServer StartTls(bool mutual) {
    ServerOptions options = testing::TestServerOptions();
    options.tls.cert_path = *dir_ + "/server.pem";
    options.tls.key_path = *dir_ + "/server.key";
    if (mutual) options.tls.client_ca_path = *dir_ + "/ca.pem";
    absl::StatusOr<testing::FakeServer> f = testing::StartFakeServer(options);
    EXPECT_TRUE(f.ok()) << f.status();
    return *std::move(f);
  }

  // One Sample over a channel with `credentials`.
  static grpc::Status SampleWith(
      int port, std::shared_ptr<grpc::ChannelCredentials> credentials) {
    grpc::ChannelArguments args;
    args.SetSslTargetNameOverride("localhost");
    auto channel = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                             credentials, args);
    auto stub = v1::Sampler::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::SampleResponse response;
    return stub->Sample(&context, testing::MakeRequest(1, kHidden, 1),
                        &response);
  }

  static grpc::SslCredentialsOptions Trusting(const std::string& ca) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = Read(ca);
    return ssl;
  }

  static std::string* dir_;
  static bool ok_;
};

std::string* TlsTest::dir_ = nullptr;
bool TlsTest::ok_ = false;

TEST_F(TlsTest, TlsServesTrustingClientsOnly) {
  ASSERT_TRUE(ok_) << "openssl could not make test certificates";
  testing::FakeServer f = StartTls(/*mutual=*/false);
  EXPECT_TRUE(
      SampleWith(f.server->port(), grpc::SslCredentials(Trusting("ca.pem")))
          .ok());
  EXPECT_FALSE(
      SampleWith(f.server->port(), grpc::InsecureChannelCredentials()).ok());
  EXPECT_FALSE(SampleWith(f.server->port(),
                          grpc::SslCredentials(Trusting("other_ca.pem")))
                   .ok());
}

TEST_F(TlsTest, MutualTlsRequiresAClientCertificate) {
  ASSERT_TRUE(ok_) << "openssl could not make test certificates";
  testing::FakeServer f = StartTls(/*mutual=*/true);
  EXPECT_FALSE(
      SampleWith(f.server->port(), grpc::SslCredentials(Trusting("ca.pem")))
          .ok());
  grpc::SslCredentialsOptions with_cert = Trusting("ca.pem");
  with_cert.pem_private_key = Read("client.key");
  with_cert.pem_cert_chain = Read("client.pem");
  EXPECT_TRUE(
      SampleWith(f.server->port(), grpc::SslCredentials(with_cert)).ok());
}

TEST_F(TlsTest, HalfConfiguredTlsIsRefused) {
  ServerOptions options = testing::TestServerOptions();
  options.tls.cert_path = *dir_ + "/server.pem";
  absl::StatusOr<testing::FakeServer> f = testing::StartFakeServer(options);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  options.tls.key_path = *dir_ + "/missing.key";
  f = testing::StartFakeServer(options);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
}

// Defect: bad TLS files were reported as "cannot listen on ... (in use, or
// not a valid address)". Each is now named with what is wrong with it.
TEST_F(TlsTest, BadTlsFilesWereReportedAsAnAddressProblem) {
  ASSERT_TRUE(ok_) << "openssl could not make test certificates";
  struct Case {
    std::string cert, key, client_ca;
    std::string expected;  // in the error message
  };
  const std::string d = *dir_ + "/";
  const std::vector<Case> cases = {
      {"garbage.pem", "server.key", "",
       "tls_cert: \"" + d + "garbage.pem\" holds no PEM certificate"},
      {"truncated.pem", "server.key", "",
       "tls_cert: \"" + d + "truncated.pem\" holds no PEM certificate"},
      {"server.key", "server.key", "",
       "tls_cert: \"" + d + "server.key\" holds no PEM certificate"},
      {"server.pem", "garbage.pem", "",
       "tls_key: \"" + d + "garbage.pem\" holds no PEM private key"},
      {"server.pem", "client.key", "",
       "tls_key: \"" + d + "client.key\" does not match the certificate"},
      {"server.pem", "encrypted.key", "",
       "tls_key: \"" + d + "encrypted.key\" is encrypted"},
      {"server.pem", "keydir", "",
       "tls_key: \"" + d + "keydir\" is a directory"},
      {"server.pem", "nothing.key", "",
       "tls_key: \"" + d + "nothing.key\" does not exist"},
      {"server.pem", "server.key", "garbage.pem",
       "tls_client_ca: \"" + d + "garbage.pem\" holds no PEM certificate"},
      {"server.pem", "server.key", "keydir",
       "tls_client_ca: \"" + d + "keydir\" is a directory"},
  };
  for (const Case& c : cases) {
    ServerOptions options = testing::TestServerOptions();
    options.tls.cert_path = d + c.cert;
    options.tls.key_path = d + c.key;
    if (!c.client_ca.empty()) options.tls.client_ca_path = d + c.client_ca;
    absl::StatusOr<testing::FakeServer> f = testing::StartFakeServer(options);
    ASSERT_FALSE(f.ok()) << c.cert << " " << c.key << " " << c.client_ca;
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument)
        << f.status();
    EXPECT_TRUE(absl::StrContains(f.status().message(), c.expected))
        << "expected \"" << c.expected << "\" in: " << f.status();
    EXPECT_FALSE(absl::StrContains(f.status().message(), "cannot listen"))
        << f.status();
  }
}

}  // namespace
}  // namespace flashsampler
