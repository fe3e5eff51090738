// Accepting, admitting and relaying connections on one epoll thread (see guarded_listener.h).
#include "spes/common/guarded_listener.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>
#include <utility>

#include "spes/common/connection_guard.h"
#include "spes/common/error.h"

namespace spes {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kBufferCap = 256 << 10;  // bytes waiting in one direction before reads pause
constexpr size_t kReadChunk = 64 << 10;
constexpr uint64_t kListenKey = 0;         // epoll keys: 0 listen, 1 wake, else id*2 + side
constexpr uint64_t kWakeKey = 1;
constexpr size_t kMostKnown = 4096;        // known addresses remembered
constexpr auto kSummaryEvery = std::chrono::seconds(10);
constexpr auto kAcceptPause = std::chrono::milliseconds(100);

double seconds_since(Clock::time_point t, Clock::time_point now) {
  return std::chrono::duration<double>(now - t).count();
}

// "ipv4:1.2.3.4:5678" / "ipv6:[::1]:5678", as gRPC names a peer.
std::string peer_name(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return "unknown";
  char buf[INET6_ADDRSTRLEN] = {0};
  if (a.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<sockaddr_in*>(&a);
    ::inet_ntop(AF_INET, &in->sin_addr, buf, sizeof(buf));
    return std::string("ipv4:") + buf + ":" + std::to_string(ntohs(in->sin_port));
  }
  if (a.ss_family == AF_INET6) {
    const auto* in = reinterpret_cast<sockaddr_in6*>(&a);
    ::inet_ntop(AF_INET6, &in->sin6_addr, buf, sizeof(buf));
    return std::string("ipv6:[") + buf + "]:" + std::to_string(ntohs(in->sin6_port));
  }
  return "local";
}

// Sends what it can of `buf` (removing it); false when the socket failed.
bool send_some(int fd, std::string& buf) {
  size_t sent = 0;
  while (sent < buf.size()) {
    const ssize_t n = ::send(fd, buf.data() + sent, buf.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return false;
      break;
    }
  }
  buf.erase(0, sent);
  return true;
}

enum class ReadResult { Some, None, Closed };

// Reads what is there into `buf`, up to `cap` bytes waiting in all.
ReadResult recv_some(int fd, std::string& buf, size_t cap) {
  bool got = false;
  while (buf.size() < cap) {
    char chunk[kReadChunk];
    const ssize_t n = ::recv(fd, chunk, std::min(sizeof(chunk), cap - buf.size()), 0);
    if (n > 0) {
      buf.append(chunk, static_cast<size_t>(n));
      got = true;
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      break;
    } else {
      return ReadResult::Closed;  // end of stream or an error
    }
  }
  return got ? ReadResult::Some : ReadResult::None;
}

}  // namespace

std::string fd_peer_name(int fd) { return "fd:" + std::to_string(fd); }

struct GuardedListener::Impl {
  // One connection: the client's socket (`outer`) and, once its preface came, our end of the
  // socketpair whose other end belongs to the server, or our connection to the server's own
  // listener (`inner`); `inner_name` is how the server names that peer.
  struct Conn {
    int outer = -1, inner = -1;
    std::string inner_name;
    std::string address, peer;
    std::unique_ptr<ConnectionGuard::Ticket> ticket;
    std::string to_inner, to_outer;
    uint32_t outer_mask = 0, inner_mask = 0;
    Clock::time_point opened, active;
  };
  struct Handed {
    uint64_t id;
    std::string peer, address;
  };

  GuardSettings s;
  std::function<void(int)> hand_over;
  ConnectionGuard guard;
  int listen_fd = -1, ep = -1, wake = -1, port = 0;
  std::atomic<bool> stopping{false};
  std::thread loop;
  std::unordered_map<uint64_t, Conn> conns;  // the loop thread's
  uint64_t next_id = 1;
  bool listening = true;
  Clock::time_point accept_again{}, last_sweep{}, last_summary = Clock::now();
  mutable std::mutex mu;  // guards by_handed and known (read by the server's threads)
  std::unordered_map<std::string, Handed> by_handed;  // by the server's name of the peer
  std::set<std::string> known;
  std::atomic<int64_t> refused{0}, timed_out{0}, out_of_fds{0};
  int64_t refused_logged = 0, timed_out_logged = 0, out_of_fds_logged = 0;
  std::string last_refusal;

  Impl(GuardSettings settings, std::function<void(int)> h)
      : s(std::move(settings)), hand_over(std::move(h)),
        guard(ConnectionLimits{s.max_connections, s.per_address, s.reserved_for_known}) {}

  void run();
  void accept_some();
  void admit(int fd);
  bool step(uint64_t id, Conn& c, bool inner_side, uint32_t events);
  bool take_preface(uint64_t id, Conn& c);
  int open_inner(std::string* name);
  void update_masks(uint64_t id, Conn& c);
  void close_conn(uint64_t id);
  void sweep(Clock::time_point now);
  void summarise(Clock::time_point now);
  void set_listening(bool on);
};

void GuardedListener::Impl::run() {
  epoll_event ev[64];
  while (!stopping) {
    const int n = ::epoll_wait(ep, ev, 64, 100);
    for (int i = 0; i < n; ++i) {
      const uint64_t key = ev[i].data.u64;
      if (key == kListenKey) {
        accept_some();
      } else if (key != kWakeKey) {
        const auto it = conns.find(key >> 1);
        if (it != conns.end() && !step(it->first, it->second, key & 1, ev[i].events))
          close_conn(it->first);
      }
    }
    const auto now = Clock::now();
    if (!listening && now >= accept_again) set_listening(true);
    if (now - last_sweep >= std::chrono::milliseconds(250)) sweep(now);
    if (now - last_summary >= kSummaryEvery) summarise(now);
  }
}

void GuardedListener::Impl::set_listening(bool on) {
  epoll_event e{};
  e.events = on ? EPOLLIN : 0;
  e.data.u64 = kListenKey;
  ::epoll_ctl(ep, EPOLL_CTL_MOD, listen_fd, &e);
  listening = on;
}

void GuardedListener::Impl::accept_some() {
  for (int i = 0; i < 64; ++i) {
    const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      admit(fd);
      continue;
    }
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      // Out of descriptors: the pending connection stays queued; accept again shortly
      // (gRPC 1.51's own loop could stop here for good, CVE-2023-4785).
      ++out_of_fds;
      set_listening(false);
      accept_again = Clock::now() + kAcceptPause;
    }
    return;  // nothing more to accept now, or a connection that went away
  }
}

void GuardedListener::Impl::admit(int fd) {
  const std::string address = peer_address(fd);
  bool is_known;
  {
    std::lock_guard<std::mutex> lk(mu);
    is_known = known.count(address) > 0;
  }
  std::string why;
  auto ticket = guard.admit(address, &why, is_known);
  if (!ticket) {
    ::close(fd);
    ++refused;
    last_refusal = why;
    return;
  }
  int yes = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof(yes));
  const uint64_t id = next_id++;
  Conn& c = conns[id];
  c.outer = fd;
  c.address = address;
  c.peer = peer_name(fd);
  c.ticket = std::move(ticket);
  c.opened = c.active = Clock::now();
  epoll_event e{};
  e.events = c.outer_mask = EPOLLIN;
  e.data.u64 = id << 1;
  ::epoll_ctl(ep, EPOLL_CTL_ADD, fd, &e);
}

// Moves bytes for one readiness event of connection `c`; false when it is over.
bool GuardedListener::Impl::step(uint64_t id, Conn& c, bool inner_side, uint32_t events) {
  const bool gone = events & (EPOLLHUP | EPOLLERR);
  if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
    const ReadResult r = inner_side ? recv_some(c.inner, c.to_outer, kBufferCap)
                                    : recv_some(c.outer, c.to_inner, kBufferCap);
    if (r == ReadResult::Some) c.active = Clock::now();
    if (r == ReadResult::Closed || gone) {
      // One side ended: pass on what it sent, then end both.
      if (inner_side) send_some(c.outer, c.to_outer);
      else if (c.inner >= 0) send_some(c.inner, c.to_inner);
      return false;
    }
    if (!inner_side && c.inner < 0 && !take_preface(id, c)) return false;
  }
  if (c.inner >= 0 && !send_some(c.inner, c.to_inner)) return false;
  if (!send_some(c.outer, c.to_outer)) return false;
  update_masks(id, c);
  return true;
}

// Before the hand-over: the bytes so far must begin the preface; once it is whole, the server
// gets its end of a new socketpair. False when the connection is to be closed.
bool GuardedListener::Impl::take_preface(uint64_t id, Conn& c) {
  const size_t n = std::min(c.to_inner.size(), s.preface.size());
  if (c.to_inner.compare(0, n, s.preface, 0, n) != 0) return false;  // not this protocol
  if (c.to_inner.size() < s.preface.size()) return true;
  int handed = -1;
  if (s.forward_port > 0) {
    c.inner = open_inner(&c.inner_name);
  } else {
    int sp[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sp) == 0) {
      c.inner = sp[0];
      handed = sp[1];
      c.inner_name = fd_peer_name(handed);
    }
  }
  if (c.inner < 0) {
    ++out_of_fds;
    return false;
  }
  {
    std::lock_guard<std::mutex> lk(mu);
    by_handed[c.inner_name] = Handed{id, c.peer, c.address};
  }
  epoll_event e{};
  e.events = c.inner_mask = EPOLLIN;
  e.data.u64 = (id << 1) | 1;
  ::epoll_ctl(ep, EPOLL_CTL_ADD, c.inner, &e);
  if (handed >= 0) hand_over(handed);
  return true;
}

// A connection to the server's own listener on 127.0.0.1:forward_port (non-blocking once
// connected; a loopback connect completes without waiting for the server to accept); -1 on
// failure. *name: how the server names it, "ipv4:127.0.0.1:<our port>".
int GuardedListener::Impl::open_inner(std::string* name) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(s.forward_port));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  sockaddr_in mine{};
  socklen_t len = sizeof(mine);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &len) != 0) {
    ::close(fd);
    return -1;
  }
  int yes = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof(yes));
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  *name = "ipv4:127.0.0.1:" + std::to_string(ntohs(mine.sin_port));
  return fd;
}

void GuardedListener::Impl::update_masks(uint64_t id, Conn& c) {
  auto set = [&](int fd, uint32_t want, uint32_t& have, uint64_t key) {
    if (fd < 0 || want == have) return;
    epoll_event e{};
    e.events = want;
    e.data.u64 = key;
    ::epoll_ctl(ep, EPOLL_CTL_MOD, fd, &e);
    have = want;
  };
  set(c.outer, (c.to_inner.size() < kBufferCap ? EPOLLIN : 0u) | (c.to_outer.empty() ? 0u : EPOLLOUT),
      c.outer_mask, id << 1);
  set(c.inner, (c.to_outer.size() < kBufferCap ? EPOLLIN : 0u) | (c.to_inner.empty() ? 0u : EPOLLOUT),
      c.inner_mask, (id << 1) | 1);
}

void GuardedListener::Impl::close_conn(uint64_t id) {
  const auto it = conns.find(id);
  if (it == conns.end()) return;
  Conn& c = it->second;
  if (!c.inner_name.empty()) {
    std::lock_guard<std::mutex> lk(mu);
    const auto h = by_handed.find(c.inner_name);  // the name may already be a newer one's
    if (h != by_handed.end() && h->second.id == id) by_handed.erase(h);
  }
  ::close(c.outer);
  if (c.inner >= 0) ::close(c.inner);
  conns.erase(it);  // gives the guard's slot back
}

void GuardedListener::Impl::sweep(Clock::time_point now) {
  last_sweep = now;
  std::vector<uint64_t> over;
  for (const auto& [id, c] : conns) {
    const bool half_open = c.inner < 0 && seconds_since(c.opened, now) > s.first_bytes_timeout_s;
    const bool idle = seconds_since(c.active, now) > s.idle_timeout_s;
    if (half_open || idle) over.push_back(id);
  }
  for (uint64_t id : over) {
    ++timed_out;
    close_conn(id);
  }
}

// One line every 10 s at most about what the guard turned away.
void GuardedListener::Impl::summarise(Clock::time_point now) {
  last_summary = now;
  const int64_t r = refused - refused_logged, t = timed_out - timed_out_logged,
                f = out_of_fds - out_of_fds_logged;
  if (r == 0 && t == 0 && f == 0) return;
  spdlog::warn("connection guard, last {} s: {} connections refused{}{}, {} closed for no "
               "preface within {:g} s or no traffic for {:g} s, {} times out of descriptors "
               "(accepting again after {} ms); {} open",
               std::chrono::duration_cast<std::chrono::seconds>(kSummaryEvery).count(), r,
               r ? " (the last: " : "", r ? last_refusal + ")" : "", t, s.first_bytes_timeout_s,
               s.idle_timeout_s, f, kAcceptPause.count(), guard.open());
  refused_logged += r;
  timed_out_logged += t;
  out_of_fds_logged += f;
}

GuardedListener::GuardedListener(const std::string& host_port, GuardSettings settings,
                                 std::function<void(int fd)> hand_over)
    : impl_(std::make_unique<Impl>(std::move(settings), std::move(hand_over))) {
  const size_t colon = host_port.rfind(':');
  SPES_CHECK(colon != std::string::npos, "listen address '{}' is not host:port", host_port);
  std::string host = host_port.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  int port = -1;
  try {
    port = std::stoi(host_port.substr(colon + 1));
  } catch (const std::exception&) {
  }
  SPES_CHECK(port >= 0 && port <= 65535, "listen address '{}': the port is not a number in "
             "0..65535", host_port);
  Impl& m = *impl_;
  m.listen_fd = listen_tcp(host, port, 1024, &m.port);
  SPES_CHECK(m.listen_fd >= 0, "cannot listen on '{}' (address in use or invalid?)", host_port);
  ::fcntl(m.listen_fd, F_SETFL, ::fcntl(m.listen_fd, F_GETFL) | O_NONBLOCK);
  m.ep = ::epoll_create1(EPOLL_CLOEXEC);
  m.wake = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  SPES_CHECK(m.ep >= 0 && m.wake >= 0, "connection guard: cannot create its epoll set");
  epoll_event e{};
  e.events = EPOLLIN;
  e.data.u64 = kListenKey;
  ::epoll_ctl(m.ep, EPOLL_CTL_ADD, m.listen_fd, &e);
  e.data.u64 = kWakeKey;
  ::epoll_ctl(m.ep, EPOLL_CTL_ADD, m.wake, &e);
  m.loop = std::thread([&m] { m.run(); });
}

GuardedListener::~GuardedListener() {
  Impl& m = *impl_;
  m.stopping = true;
  const uint64_t one = 1;
  if (::write(m.wake, &one, sizeof(one)) < 0) {
  }
  if (m.loop.joinable()) m.loop.join();
  std::vector<uint64_t> ids;
  for (const auto& kv : m.conns) ids.push_back(kv.first);
  for (uint64_t id : ids) m.close_conn(id);
  ::close(m.listen_fd);
  ::close(m.ep);
  ::close(m.wake);
}

int GuardedListener::port() const { return impl_->port; }

std::string GuardedListener::client_of(const std::string& inner_peer) const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  const auto it = impl_->by_handed.find(inner_peer);
  return it == impl_->by_handed.end() ? inner_peer : it->second.peer;
}

void GuardedListener::mark_known(const std::string& inner_peer) {
  std::lock_guard<std::mutex> lk(impl_->mu);
  const auto it = impl_->by_handed.find(inner_peer);
  if (it != impl_->by_handed.end() && impl_->known.size() < kMostKnown)
    impl_->known.insert(it->second.address);
}

GuardCounts GuardedListener::counts() const {
  return GuardCounts{impl_->guard.open(), impl_->refused, impl_->timed_out, impl_->out_of_fds};
}

}  // namespace spes
