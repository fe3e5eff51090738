// Routes gRPC's own log lines through a LogThrottle into the server's log. gRPC's core library
// writes its lines itself, one per event: a stranger's failed TLS handshake costs one "Handshake
// failed" line, so a flood of them (6,489 lines, 1.2 MB in 20 s in scripts/attack_load.sh) filled
// the log past the cap on the server's own refusal lines (docs/SECURITY.md, issue 35 finding 6).
// Here each line of gRPC's source (file and line) is one kind: its first line of a 10 s window is
// logged, the rest counted into a summary, and all of them share the throttle's total cap.
// Leaves out: the server's own lines (server.cpp's refusal throttle).
#pragma once
#include <string>
#include <vector>

namespace spes::sync {

// Sends gRPC's log lines through the throttle from now on (the whole process; call it before
// the gRPC server starts; calling it again changes nothing).
void route_grpc_logs();
// The summaries of gRPC lines held back in windows that have passed; the caller logs them.
std::vector<std::string> flush_grpc_logs();

}  // namespace spes::sync
