// `--tls-dir DIR` of `spes serve`, `spes node` and `spes status`: the files `spes certs` wrote
// (common/run_certificates.h) put into the transport settings, each checked to exist with a
// message that says how to make or copy it.
#pragma once
#include <cstdint>
#include <string>

#include "spes/io/config.h"

namespace spes::cli {

// The server: its certificate and key, and client certificates required (the run's CA).
void server_tls_from_dir(SyncTransport& tr, const std::string& dir);
// Node `node`: the CA that verifies the server, and its own certificate node<node>.
void node_tls_from_dir(SyncTransport& tr, const std::string& dir, int64_t node);
// `spes status`: the CA, and the certificate status.pem.
void status_tls_from_dir(SyncTransport& tr, const std::string& dir);

}  // namespace spes::cli
