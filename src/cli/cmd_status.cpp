// `spes status --server HOST:PORT`: asks a running sync server for its rounds and every node's
// state, step, last loss and tokens/s, and why a closed round is not published (a failed save),
// via the Status RPC (with --read-token-file the read token the server asks for off loopback),
// and prints them as a table, or as JSON.
#include <fmt/core.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>

#include "cli/command.h"
#include "cli/tls_dir.h"
#include "spes/sync/node/client.h"
#include "spes/sync/wire/auth.h"

namespace {

// A figure the node may not have reported yet (NaN): "-" in the table, null in JSON.
std::string figure(double x, int decimals) {
  return std::isfinite(x) ? fmt::format("{:.{}f}", x, decimals) : std::string("-");
}
nlohmann::json figure_json(double x) {
  return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr);
}

struct StatusArgs {
  std::string server = "127.0.0.1:50551", tls_ca, read_token_file, tls_dir;
  bool json = false, insecure = false;
};

void run_status(const StatusArgs& a) {
  spes::SyncTransport tr;
  tr.tls_ca = a.tls_ca;
  if (!a.tls_dir.empty()) spes::cli::status_tls_from_dir(tr, a.tls_dir);
  spes::sync::ClientTls tls;
  tls.root_pem = spes::sync::read_pem(tr.tls_ca, "tls_ca");
  tls.cert_pem = spes::sync::read_pem(tr.tls_client_cert, "tls_client_cert");
  tls.key_pem = spes::sync::read_pem(tr.tls_client_key, "tls_client_key");
  tls.insecure = a.insecure;
  const std::string read_token =
      spes::sync::read_token_file(a.read_token_file, "--read-token-file");
  spes::sync::SyncClient client(a.server, spes::sync::NodeId{}, tls);
  spes::sync::ServerStatus s;
  try {
    s = client.status(read_token);
  } catch (const spes::sync::SyncError& e) {
    spes::fail("cannot get the status of sync server {}: {} (is `spes serve` running there?)",
               a.server, e.what());
  }
  if (a.json) {
    nlohmann::json j = {{"published_round", s.published_round},
                        {"published_step", s.published_step},
                        {"model_sha256", s.model_sha256},
                        {"collecting_round", s.collecting_round},
                        {"round_open_s", s.round_open_s},
                        {"protocol_version", s.protocol_version},
                        {"publish_error", s.publish_error},
                        {"ownership_epoch", s.ownership_epoch},
                        {"departed", s.departed},
                        {"frozen_experts", s.frozen_experts},
                        {"nodes", nlohmann::json::array()}};
    for (const auto& n : s.nodes)
      j["nodes"].push_back({{"node", n.node_id}, {"state", n.state}, {"step", n.step},
                            {"last_seen_s", n.last_seen_s}, {"loss", figure_json(n.loss)},
                            {"tokens_per_s", figure_json(n.tokens_per_s)},
                            {"detail", n.detail}});
    fmt::print("{}\n", j.dump(2));
    return;
  }
  fmt::print("sync server {} (protocol {})\n", a.server, s.protocol_version);
  fmt::print("published round {} (step {}), model sha256 {}\n", s.published_round,
             s.published_step, s.model_sha256.substr(0, 16));
  fmt::print("collecting round {}{}\n", s.collecting_round,
             s.round_open_s > 0 ? fmt::format(", open for {:.1f} s", s.round_open_s) : "");
  fmt::print("ownership epoch {}{}{}\n", s.ownership_epoch,
             s.departed.empty() ? "" : fmt::format(", departed node(s) {}", fmt::join(s.departed, ", ")),
             s.frozen_experts.empty() ? ""
                 : fmt::format(", {} expert(s) frozen with no live owner ({})",
                               s.frozen_experts.size(), fmt::join(s.frozen_experts, " ")));
  if (!s.publish_error.empty())
    fmt::print("round {} is closed but NOT published: {} (the server retries)\n",
               s.collecting_round, s.publish_error);
  fmt::print("{:>5}  {:<11} {:>8}  {:>11}  {:>8}  {:>9}  {}\n", "node", "state", "step",
             "last seen", "loss", "tokens/s", "detail");
  for (const auto& n : s.nodes)
    fmt::print("{:>5}  {:<11} {:>8}  {:>11}  {:>8}  {:>9}  {}\n", n.node_id, n.state, n.step,
               n.last_seen_s < 0 ? std::string("never") : fmt::format("{:.1f} s ago", n.last_seen_s),
               figure(n.loss, 4), figure(n.tokens_per_s, 0), n.detail);
}

spes::cli::SubcommandRegistrar register_status("status", "Show a sync server's rounds and node states",
                                   [](CLI::App& sub) {
  auto a = std::make_shared<StatusArgs>();
  sub.add_option("--server", a->server, "host:port of `spes serve`");
  sub.add_option("--tls-ca", a->tls_ca, "PEM roots to verify a TLS server (spes_config.tls_ca)");
  sub.add_option("--tls-dir", a->tls_dir, "Mutual TLS with the files `spes certs` made: "
                 "DIR/ca.pem, status.pem and status.key");
  sub.add_option("--read-token-file", a->read_token_file, "File with the server's read token "
                 "(spes serve --read-token-file)");
  sub.add_flag("--insecure", a->insecure, "Allow plaintext to a server that is not on loopback");
  sub.add_flag("--json", a->json, "Print JSON instead of a table");
  sub.callback([a] { run_status(*a); });
}, spes::cli::GpuUse::Never);

}  // namespace
