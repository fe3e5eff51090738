// A listening socket whose connections pass a guard before the server behind it sees a byte
// (issue 35, finding 2: gRPC 1.51 has no cap on connections and its accept loop can stop when
// descriptors run out, CVE-2023-4785). The listener owns the socket and its accept loop, admits
// each connection through a ConnectionGuard (in total, per source address, room reserved for
// known addresses), waits for the connection's first bytes (`preface`: HTTP/2's for gRPC) within
// a timeout, and only then hands the server one end of a socketpair, relaying bytes between it
// and the client; or (`forward_port`, for TLS, whose handshake gRPC does) relays it to the
// server's own listener on loopback. A connection with no byte either way for `idle_timeout_s`
// is closed. Out of descriptors, the loop waits 100 ms and accepts again. One thread (epoll)
// does all of this. Leaves out: what the bytes mean (the server's), TLS itself.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace spes {

struct GuardSettings {
  int64_t max_connections = 1024;     // open at once, in total
  int64_t per_address = 32;           // from one source address (known addresses: exempt)
  int64_t reserved_for_known = 128;   // of max_connections, kept for known addresses
  double first_bytes_timeout_s = 10;  // the preface must have arrived within this
  double idle_timeout_s = 600;        // no byte either way for this long: closed
  std::string preface;                // what every connection must start with ("": anything)
  int forward_port = 0;  // > 0: relay to 127.0.0.1:forward_port (a TLS listener) instead of a
                         // socketpair handed over
};

struct GuardCounts {
  int64_t open = 0;          // connections open now (handed over or not)
  int64_t refused = 0;       // refused at a limit since the start
  int64_t timed_out = 0;     // closed for a missing preface or for idleness
  int64_t out_of_fds = 0;    // times accepting ran out of descriptors
};

class GuardedListener {
 public:
  // Binds `host_port` ("host:port", IPv6 as "[::1]:port"; port 0: any free port). `hand_over`
  // receives the server's end of each admitted connection (non-blocking, close-on-exec) and
  // owns it from then on. Throws when the address cannot be bound.
  GuardedListener(const std::string& host_port, GuardSettings settings,
                  std::function<void(int fd)> hand_over);
  ~GuardedListener();  // closes the listening socket and every connection
  int port() const;
  // The client ("ipv4:1.2.3.4:5678") behind `inner_peer`, the peer name the server gives a
  // handed-over descriptor ("fd:N") or a relayed connection ("ipv4:127.0.0.1:P");
  // `inner_peer` itself when it names none of them.
  std::string client_of(const std::string& inner_peer) const;
  // The client behind `inner_peer` proved it belongs (a node's valid credentials): its address
  // may use the reserved room and is not held to the per-address limit from now on.
  void mark_known(const std::string& inner_peer);
  GuardCounts counts() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The peer name gRPC gives a descriptor handed to it (grpc::AddInsecureChannelFromFd): "fd:N".
std::string fd_peer_name(int fd);

}  // namespace spes
