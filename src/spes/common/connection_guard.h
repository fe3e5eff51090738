// Admission of incoming connections by count, decided once per connection when it is accepted:
// at most `total` open at once and at most `per_address` from one source address, so that one
// stranger holding idle or slow connections cannot take every slot (issue 35, findings 2 and 5).
// admit() hands out a ticket that gives the slot back when destroyed. `reserved` of the total
// are kept for known addresses (ones that proved they belong, e.g. a node's valid credentials),
// which are also exempt from the per-address limit. Thread-safe. Leaves out: timeouts (the
// server holding the connection ends it) and the sockets themselves (but: listen_tcp, the
// listening socket such a server starts from).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace spes {

struct ConnectionLimits {
  int64_t total = 64;
  int64_t per_address = 8;
  int64_t reserved = 0;  // of `total`, slots only known addresses may take
};

class ConnectionGuard {
 public:
  explicit ConnectionGuard(ConnectionLimits limits) : limits_(limits) {}

  class Ticket {
   public:
    ~Ticket();
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;

   private:
    friend class ConnectionGuard;
    Ticket(ConnectionGuard& g, std::string address) : guard_(g), address_(std::move(address)) {}
    ConnectionGuard& guard_;
    std::string address_;
  };

  // A slot for a connection from `address`, or nullptr (with `why` set) when it would pass a
  // limit. A `known` address may take the reserved slots and is not held to `per_address`.
  std::unique_ptr<Ticket> admit(const std::string& address, std::string* why,
                                bool known = false);
  int64_t open() const;
  int64_t open_from(const std::string& address) const;

 private:
  void release(const std::string& address);

  const ConnectionLimits limits_;
  mutable std::mutex mu_;
  int64_t open_ = 0;
  std::map<std::string, int64_t> per_address_;
};

// The address (without port) of the peer of a connected socket ("?" when unknown).
std::string peer_address(int fd);

// Raises this process's limit of open descriptors (RLIMIT_NOFILE) to the most the system
// allows it (the hard limit; 1,048,576 when that is unlimited) and returns the limit now in
// force: a server flooded with connections then runs out of descriptors far later (issue 35,
// finding 2; the default soft limit is often 1024).
uint64_t raise_descriptor_limit();

// A listening TCP socket (close-on-exec) on host:port with `backlog` (port 0: any free port,
// written to *bound_port); -1 when it cannot be bound (address in use, unknown host).
int listen_tcp(const std::string& host, int port, int backlog, int* bound_port);

}  // namespace spes
