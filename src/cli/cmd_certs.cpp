// `spes certs --out DIR --nodes N --host NAME...`: makes a run's CA, the server's certificate
// (for the names and addresses the nodes dial), one client certificate per node (naming
// node<i>) and one for `spes status`, with OpenSSL's library (common/run_certificates.h), and
// prints the one flag each machine then needs (--tls-dir) and which files go where.
#include <fmt/core.h>
#include <unistd.h>

#include "cli/command.h"
#include "spes/common/run_certificates.h"

namespace {

struct CertsArgs {
  std::string out = "certs";
  int64_t nodes = 0;
  int64_t days = 365;
  std::vector<std::string> hosts;
};

std::vector<std::string> default_hosts() {
  std::vector<std::string> h = {"localhost", "127.0.0.1"};
  char name[256] = {0};
  if (::gethostname(name, sizeof(name) - 1) == 0 && name[0] && std::string(name) != "localhost")
    h.insert(h.begin(), name);
  return h;
}

void run_certs(const CertsArgs& a) {
  spes::CertificateRequest req;
  req.dir = a.out;
  req.nodes = a.nodes;
  req.days = a.days;
  req.hosts = a.hosts.empty() ? default_hosts() : a.hosts;
  const spes::CertificateReport rep = spes::make_run_certificates(req);
  for (const auto& f : rep.written) fmt::print("wrote {}\n", f);
  for (const auto& f : rep.kept) fmt::print("kept  {} (already there)\n", f);
  const spes::TlsDirFiles f = spes::tls_dir_files(a.out);
  std::string names;
  for (const auto& h : req.hosts) names += (names.empty() ? "" : ", ") + h;
  fmt::print(
      "\nMutual TLS for this run (the server's certificate names: {}):\n"
      "  server machine:  spes serve ... --tls-dir {}\n"
      "                   (needs {}, {}, {})\n"
      "  node i:          spes node ... --tls-dir DIR\n"
      "                   (DIR holds a copy of ca.pem, node<i>.pem and node<i>.key only)\n"
      "  spes status:     spes status --server HOST:PORT --tls-dir DIR (ca.pem, status.pem, "
      "status.key)\n"
      "Keep ca.key on this machine: whoever holds it can make certificates for the run.\n",
      names, a.out, f.ca, f.server_cert, f.server_key);
}

spes::cli::SubcommandRegistrar register_certs(
    "certs", "Make a run's CA and TLS certificates (server, nodes, spes status)",
    [](CLI::App& sub) {
      auto a = std::make_shared<CertsArgs>();
      sub.add_option("--out", a->out, "Directory to write (created private; files already "
                     "there are kept, and an existing CA signs the new certificates)");
      sub.add_option("--nodes", a->nodes, "Number of nodes (certificates node0 .. node<N-1>)")
          ->required()->check(CLI::Range(int64_t{1}, int64_t{100000}));
      sub.add_option("--host", a->hosts, "A name or IP address the nodes use to reach the "
                     "server (repeat for several; default: this machine's name, localhost, "
                     "127.0.0.1)");
      sub.add_option("--days", a->days, "Validity in days")
          ->check(CLI::Range(int64_t{1}, int64_t{36500}));
      sub.callback([a] { run_certs(*a); });
    },
    spes::cli::GpuUse::Never);

}  // namespace
