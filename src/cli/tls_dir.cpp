// The files of a --tls-dir directory, checked and put into SyncTransport (see tls_dir.h).
#include "cli/tls_dir.h"

#include <filesystem>

#include "spes/common/error.h"
#include "spes/common/run_certificates.h"

namespace spes::cli {
namespace {

const std::string& existing(const std::string& path, const std::string& who) {
  SPES_CHECK(std::filesystem::is_regular_file(path), "--tls-dir: {} is missing ({} needs it). "
             "Make the run's certificates on one machine with `spes certs --out DIR --nodes N "
             "--host NAME` and copy the files each machine needs (spes certs lists them)",
             path, who);
  return path;
}

}  // namespace

void server_tls_from_dir(SyncTransport& tr, const std::string& dir) {
  const TlsDirFiles f = tls_dir_files(dir);
  tr.tls_cert = existing(f.server_cert, "the server");
  tr.tls_key = existing(f.server_key, "the server");
  tr.tls_client_ca = existing(f.ca, "the server");
}

void node_tls_from_dir(SyncTransport& tr, const std::string& dir, int64_t node) {
  const TlsDirFiles f = tls_dir_files(dir);
  const std::string who = "node " + std::to_string(node);
  tr.tls_ca = existing(f.ca, who);
  tr.tls_client_cert = existing(f.node_cert(node), who);
  tr.tls_client_key = existing(f.node_key(node), who);
}

void status_tls_from_dir(SyncTransport& tr, const std::string& dir) {
  const TlsDirFiles f = tls_dir_files(dir);
  tr.tls_ca = existing(f.ca, "spes status");
  tr.tls_client_cert = existing(f.status_cert, "spes status");
  tr.tls_client_key = existing(f.status_key, "spes status");
}

}  // namespace spes::cli
