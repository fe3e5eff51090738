// A run's certificates for mutual TLS (issue 35, finding 1), made with OpenSSL's library: a CA
// of the run, the server's certificate (for the host names and addresses the nodes dial), one
// client certificate per node naming node<i> (what `spes serve --bind-client-certs` checks)
// and one for `spes status`. EC P-256 keys, SHA-256 signatures; private keys written 0600.
// Files a directory already holds are kept (a CA made earlier signs the new certificates), so
// nodes can be added later. The file names are the ones `--tls-dir` reads (tls_dir_files).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace spes {

struct CertificateRequest {
  std::string dir;                   // written (created 0700 when missing)
  int64_t nodes = 0;                 // node0 .. node<nodes-1>
  std::vector<std::string> hosts;    // the server's names and IP addresses
  int64_t days = 365;                // validity
};

struct CertificateReport {
  std::vector<std::string> written, kept;  // file paths
};

CertificateReport make_run_certificates(const CertificateRequest& req);

// The files of a --tls-dir directory.
struct TlsDirFiles {
  std::string ca, server_cert, server_key, status_cert, status_key;
  std::string node_cert(int64_t node) const;
  std::string node_key(int64_t node) const;
  std::string dir;
};
TlsDirFiles tls_dir_files(const std::string& dir);

}  // namespace spes
