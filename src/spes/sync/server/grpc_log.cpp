// gRPC's log lines through a LogThrottle into spdlog (see grpc_log.h).
#include "spes/sync/server/grpc_log.h"

#include <fmt/core.h>
#include <grpc/support/log.h>
#include <spdlog/spdlog.h>

#include <cstring>

#include "spes/sync/server/log_throttle.h"

namespace spes::sync {
namespace {

LogThrottle& grpc_throttle() {
  static LogThrottle throttle(10);
  return throttle;
}

// gRPC calls this from its own threads for every line it would have written to stderr.
void on_grpc_log(gpr_log_func_args* args) {
  const char* file = args->file != nullptr ? args->file : "?";
  const char* slash = std::strrchr(file, '/');
  const std::string where = fmt::format("grpc {}:{}", slash != nullptr ? slash + 1 : file,
                                        args->line);
  const auto line = grpc_throttle().admit(
      where, fmt::format("{}: {}", where, args->message != nullptr ? args->message : ""));
  if (!line) return;
  switch (args->severity) {
    case GPR_LOG_SEVERITY_ERROR: spdlog::error("{}", *line); break;
    case GPR_LOG_SEVERITY_INFO: spdlog::info("{}", *line); break;
    default: spdlog::debug("{}", *line); break;
  }
}

}  // namespace

void route_grpc_logs() { gpr_set_log_function(on_grpc_log); }

std::vector<std::string> flush_grpc_logs() { return grpc_throttle().flush(); }

}  // namespace spes::sync
