// Making a run's CA and certificates with OpenSSL (see run_certificates.h).
#include "spes/common/run_certificates.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/core.h>
#include <openssl/bn.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <memory>

#include "spes/common/error.h"

namespace spes {
namespace {

namespace fs = std::filesystem;

struct FreeKey {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct FreeCert {
  void operator()(X509* x) const { X509_free(x); }
};
using Key = std::unique_ptr<EVP_PKEY, FreeKey>;
using Cert = std::unique_ptr<X509, FreeCert>;

[[noreturn]] void openssl_fail(const std::string& what) {
  throw Error(fmt::format("spes certs: OpenSSL could not {}", what));
}

Key new_key() {
  Key k(EVP_EC_gen("P-256"));
  if (!k) openssl_fail("make an EC P-256 key");
  return k;
}

// Writes `text` to `path` with `mode` (a new file; the directory is ours).
void write_private(const std::string& path, const std::string& text, mode_t mode) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  SPES_CHECK(fd >= 0, "spes certs: cannot create '{}'", path);
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::fchmod(fd, mode);
  ::close(fd);
  SPES_CHECK(ok, "spes certs: cannot write '{}'", path);
}

template <class F>
std::string pem_of(F&& write) {
  BIO* b = BIO_new(BIO_s_mem());
  if (!b || write(b) != 1) openssl_fail("encode PEM");
  char* data = nullptr;
  const long n = BIO_get_mem_data(b, &data);
  std::string s(data, static_cast<size_t>(n));
  BIO_free(b);
  return s;
}

// Reads one PEM object from `path` with OpenSSL's reader for it (PEM_read_PrivateKey,
// PEM_read_X509); `what` names it in the error.
template <typename Owned, typename Reader>
Owned read_pem(const std::string& path, Reader reader, const char* what) {
  FILE* f = std::fopen(path.c_str(), "rb");
  SPES_CHECK(f, "spes certs: cannot read '{}'", path);
  Owned o(reader(f, nullptr, nullptr, nullptr));
  std::fclose(f);
  SPES_CHECK(o, "spes certs: '{}' is not a PEM {}", path, what);
  return o;
}

Key read_key(const std::string& path) {
  return read_pem<Key>(path, PEM_read_PrivateKey, "private key");
}

Cert read_cert(const std::string& path) {
  return read_pem<Cert>(path, PEM_read_X509, "certificate");
}

void add_ext(X509* x, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, x, nullptr, nullptr, 0);
  X509_EXTENSION* e = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str());
  if (!e) openssl_fail("make the extension " + value);
  X509_add_ext(x, e, -1);
  X509_EXTENSION_free(e);
}

// A certificate for `key` named `cn`, signed by the CA (`ca`, `ca_key`), or by itself when
// `ca` is null.
Cert new_cert(EVP_PKEY* key, const std::string& cn, X509* ca, EVP_PKEY* ca_key, int64_t days,
              const std::vector<std::pair<int, std::string>>& exts) {
  Cert x(X509_new());
  if (!x) openssl_fail("make a certificate");
  X509_set_version(x.get(), 2);
  unsigned char serial[16];
  if (RAND_bytes(serial, sizeof(serial)) != 1) openssl_fail("draw a serial number");
  serial[0] &= 0x7f;  // positive
  BIGNUM* bn = BN_bin2bn(serial, sizeof(serial), nullptr);
  BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(x.get()));
  BN_free(bn);
  X509_gmtime_adj(X509_getm_notBefore(x.get()), -3600);
  X509_gmtime_adj(X509_getm_notAfter(x.get()), static_cast<long>(days) * 86400);
  X509_set_pubkey(x.get(), key);
  X509_NAME* name = X509_get_subject_name(x.get());
  X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>("spes run"), -1, -1, 0);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(cn.c_str()), -1, -1, 0);
  X509_set_issuer_name(x.get(), ca ? X509_get_subject_name(ca) : name);
  X509* issuer = ca ? ca : x.get();
  for (const auto& [nid, value] : exts) add_ext(x.get(), issuer, nid, value);
  if (X509_sign(x.get(), ca ? ca_key : key, EVP_sha256()) == 0) openssl_fail("sign " + cn);
  return x;
}

// "DNS:name" or "IP:address" for a subject alternative name.
std::string san_entry(const std::string& host) {
  in6_addr a6;
  in_addr a4;
  const bool ip = ::inet_pton(AF_INET, host.c_str(), &a4) == 1 ||
                  ::inet_pton(AF_INET6, host.c_str(), &a6) == 1;
  return (ip ? "IP:" : "DNS:") + host;
}

}  // namespace

std::string TlsDirFiles::node_cert(int64_t node) const {
  return dir + "/node" + std::to_string(node) + ".pem";
}
std::string TlsDirFiles::node_key(int64_t node) const {
  return dir + "/node" + std::to_string(node) + ".key";
}

TlsDirFiles tls_dir_files(const std::string& dir) {
  TlsDirFiles f;
  f.dir = dir;
  f.ca = dir + "/ca.pem";
  f.server_cert = dir + "/server.pem";
  f.server_key = dir + "/server.key";
  f.status_cert = dir + "/status.pem";
  f.status_key = dir + "/status.key";
  return f;
}

CertificateReport make_run_certificates(const CertificateRequest& req) {
  SPES_CHECK(req.nodes >= 1 && req.nodes <= 100000, "spes certs: --nodes must be 1..100000 "
             "(got {})", req.nodes);
  SPES_CHECK(!req.hosts.empty(), "spes certs: name at least one --host the nodes dial");
  SPES_CHECK(req.days >= 1 && req.days <= 36500, "spes certs: --days must be 1..36500");
  std::error_code ec;
  fs::create_directories(req.dir, ec);
  SPES_CHECK(fs::is_directory(req.dir), "spes certs: cannot create the directory '{}'", req.dir);
  fs::permissions(req.dir, fs::perms::owner_all, ec);
  const TlsDirFiles f = tls_dir_files(req.dir);
  CertificateReport rep;
  // Writes a key and its certificate unless the certificate is there already.
  auto issue = [&](const std::string& cert_path, const std::string& key_path, Key key,
                   const Cert& cert) {
    write_private(key_path, pem_of([&](BIO* b) {
                    return PEM_write_bio_PrivateKey(b, key.get(), nullptr, nullptr, 0, nullptr,
                                                    nullptr);
                  }), 0600);
    write_private(cert_path, pem_of([&](BIO* b) { return PEM_write_bio_X509(b, cert.get()); }),
                  0644);
    rep.written.push_back(cert_path);
    rep.written.push_back(key_path);
  };
  const std::string ca_key_path = req.dir + "/ca.key";
  Key ca_key;
  Cert ca;
  if (fs::exists(f.ca) || fs::exists(ca_key_path)) {
    ca_key = read_key(ca_key_path);
    ca = read_cert(f.ca);
    SPES_CHECK(X509_check_private_key(ca.get(), ca_key.get()) == 1, "spes certs: '{}' and '{}' "
               "are not one CA (its key and certificate must match)", f.ca, ca_key_path);
    rep.kept.push_back(f.ca);
  } else {
    ca_key = new_key();
    ca = new_cert(ca_key.get(), "spes run CA", nullptr, nullptr, req.days,
                  {{NID_basic_constraints, "critical,CA:TRUE"},
                   {NID_key_usage, "critical,keyCertSign,cRLSign"},
                   {NID_subject_key_identifier, "hash"}});
    Key copy(ca_key.get());
    EVP_PKEY_up_ref(ca_key.get());
    issue(f.ca, ca_key_path, std::move(copy), ca);
  }
  auto leaf = [&](const std::string& cert_path, const std::string& key_path,
                  const std::string& cn, const std::string& usage, const std::string& san) {
    if (fs::exists(cert_path)) {
      rep.kept.push_back(cert_path);
      return;
    }
    SPES_CHECK(!fs::exists(key_path), "spes certs: '{}' exists without its certificate '{}': "
               "remove it to make a new pair", key_path, cert_path);
    Key key = new_key();
    Cert cert = new_cert(key.get(), cn, ca.get(), ca_key.get(), req.days,
                         {{NID_basic_constraints, "critical,CA:FALSE"},
                          {NID_key_usage, "critical,digitalSignature,keyEncipherment"},
                          {NID_ext_key_usage, usage},
                          {NID_subject_alt_name, san},
                          {NID_authority_key_identifier, "keyid"}});
    issue(cert_path, key_path, std::move(key), cert);
  };
  std::string hosts;
  for (const std::string& h : req.hosts) hosts += (hosts.empty() ? "" : ",") + san_entry(h);
  leaf(f.server_cert, f.server_key, req.hosts.front(), "serverAuth", hosts);
  leaf(f.status_cert, f.status_key, "status", "clientAuth", "DNS:status");
  for (int64_t i = 0; i < req.nodes; ++i) {
    const std::string name = "node" + std::to_string(i);
    leaf(f.node_cert(i), f.node_key(i), name, "clientAuth", "DNS:" + name);
  }
  return rep;
}

}  // namespace spes
