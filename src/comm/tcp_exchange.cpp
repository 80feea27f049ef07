// src/comm/tcp_exchange.cpp - see tcp_exchange.h.
#include "tcp_exchange.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <thread>

#include "../base/error.h"
#include "../base/log.h"
#include "../base/spin.h"
#include "../base/text.h"

namespace fsdp::comm {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kMagic[8] = {'F', 'S', 'D', 'P', 'B', 'O', 'O', 'T'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHelloBytes = sizeof kMagic + 3 * sizeof(uint32_t);
constexpr uint32_t kMaxPayload = 1u << 20;
// How long rank 0 gives one connection to say hello before it moves on (a
// stray client must not hold the others up).
constexpr std::chrono::seconds kHelloWait{5};
constexpr std::chrono::milliseconds kRetryEvery{50};

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  bool ok() const { return fd_ >= 0; }

 private:
  int fd_;
};

// Milliseconds left before `end` (0 once passed), for poll().
int ms_left(Clock::time_point end) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, 1 << 30));
}

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL, 0) | O_NONBLOCK); }

// Waits until `fd` is ready for `events` or `end` passes.
bool ready(int fd, short events, Clock::time_point end) {
  for (;;) {
    pollfd p{fd, events, 0};
    int n = ::poll(&p, 1, ms_left(end));
    if (n > 0) return true;
    if (n == 0 || errno != EINTR) return false;
  }
}

bool send_all(int fd, const void* data, size_t n, Clock::time_point end) {
  auto p = static_cast<const char*>(data);
  while (n > 0) {
    if (!ready(fd, POLLOUT, end)) return false;
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool recv_all(int fd, void* data, size_t n, Clock::time_point end) {
  auto p = static_cast<char*>(data);
  while (n > 0) {
    if (!ready(fd, POLLIN, end)) return false;
    ssize_t k = ::recv(fd, p, n, 0);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k <= 0) return false;  // closed, or an error
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

void put_u32(char* at, uint32_t v) {
  v = htonl(v);
  std::memcpy(at, &v, sizeof v);
}
uint32_t get_u32(const char* at) {
  uint32_t v;
  std::memcpy(&v, at, sizeof v);
  return ntohl(v);
}

// A reply: a status byte (0: the blob follows; 1: the refusal's reason follows)
// and the payload's length.
bool send_reply(int fd, bool ok, const std::string& payload, Clock::time_point end) {
  char head[5];
  head[0] = ok ? 0 : 1;
  put_u32(head + 1, static_cast<uint32_t>(payload.size()));
  return send_all(fd, head, sizeof head, end) && send_all(fd, payload.data(), payload.size(), end);
}

std::string endpoint(const TcpExchange& x) {
  bool v6 = x.host.find(':') != std::string::npos;
  return (v6 ? "[" + x.host + "]" : x.host) + ":" + std::to_string(x.port);
}

std::string seconds(double s) { return base::format_double(s) + " s"; }

void check_args(const TcpExchange& x) {
  if (x.world < 1 || x.rank < 0 || x.rank >= x.world) {
    fail(FSDP_ERR_INVALID_ARGUMENT, "bootstrap: rank " + std::to_string(x.rank) + " is not in a world of " +
                                        std::to_string(x.world) + " (RANK must be 0..WORLD_SIZE-1)");
  }
  if (x.port < 1 || x.port > 65535) {
    fail(FSDP_ERR_INVALID_ARGUMENT,
         "bootstrap: MASTER_PORT " + std::to_string(x.port) + " is not a TCP port (1..65535)");
  }
  if (x.host.empty()) fail(FSDP_ERR_INVALID_ARGUMENT, "bootstrap: MASTER_ADDR is empty");
}

// A listening socket on every address of this host at `port`: IPv6 with IPv4
// mapped where the host has IPv6, else IPv4.
Fd listen_on(int port) {
  for (int family : {AF_INET6, AF_INET}) {
    Fd fd(::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd.ok()) continue;
    int one = 1, zero = 0;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int rc;
    if (family == AF_INET6) {
      ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
      sockaddr_in6 a{};
      a.sin6_family = AF_INET6;
      a.sin6_addr = in6addr_any;
      a.sin6_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a);
    } else {
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_ANY);
      a.sin_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a);
    }
    if (rc != 0) {
      if (errno == EADDRINUSE || family == AF_INET) {
        fail(FSDP_ERR_COMM, "bootstrap: rank 0 cannot listen on port " + std::to_string(port) + ": " +
                                std::strerror(errno) + " (MASTER_PORT must be a free port on rank 0's host)");
      }
      continue;  // no IPv6 here: IPv4 then
    }
    if (::listen(fd.get(), 128) != 0) {
      fail(FSDP_ERR_COMM,
           "bootstrap: rank 0 cannot listen on port " + std::to_string(port) + ": " + std::strerror(errno));
    }
    set_nonblocking(fd.get());
    return fd;
  }
  fail(FSDP_ERR_COMM, "bootstrap: rank 0 cannot open a TCP socket: " + std::string(std::strerror(errno)));
}

std::string serve(const TcpExchange& x, const std::string& blob, Clock::time_point end) {
  if (blob.size() > kMaxPayload) fail(FSDP_ERR_INTERNAL, "bootstrap: the blob is too large");
  Fd server = listen_on(x.port);
  std::set<int> served;
  while (static_cast<int>(served.size()) < x.world - 1) {
    if (!ready(server.get(), POLLIN, end)) {
      std::string missing;
      int n_missing = 0;
      for (int r = 1; r < x.world; ++r) {
        if (served.count(r) == 0) missing += (n_missing++ ? ", " : "") + std::to_string(r);
      }
      fail(FSDP_ERR_TIMEOUT, "bootstrap: rank" + std::string(n_missing > 1 ? "s " : " ") + missing +
                                 " did not connect to rank 0 at port " + std::to_string(x.port) +
                                 " within timeout_s = " + seconds(x.timeout_s) + " (" + std::to_string(served.size()) +
                                 " of " + std::to_string(x.world - 1) +
                                 " did; check that every rank has the same MASTER_ADDR and MASTER_PORT and started)");
    }
    Fd peer(::accept4(server.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!peer.ok()) continue;  // the connection went away again
    auto hello_end = std::min(end, Clock::now() + kHelloWait);
    char hello[kHelloBytes];
    // The magic first: another protocol's client is closed at once.
    if (!recv_all(peer.get(), hello, sizeof kMagic, hello_end) || std::memcmp(hello, kMagic, sizeof kMagic) != 0 ||
        !recv_all(peer.get(), hello + sizeof kMagic, sizeof hello - sizeof kMagic, hello_end) ||
        get_u32(hello + 8) != kVersion) {
      base::log(FSDP_LOG_WARN, 0,
                "bootstrap: rank 0 closed a connection on port " + std::to_string(x.port) +
                    " that is not a libfsdp rank (no hello, or another protocol or version)");
      continue;
    }
    auto rank = static_cast<int>(get_u32(hello + 12));
    auto world = static_cast<int>(get_u32(hello + 16));
    std::string refusal;
    if (world != x.world) {
      refusal = "rank " + std::to_string(rank) + " has WORLD_SIZE=" + std::to_string(world) + " but rank 0 has " +
                std::to_string(x.world) + "; every rank must be started with the same WORLD_SIZE";
    } else if (rank < 1 || rank >= x.world) {
      refusal = "a rank " + std::to_string(rank) + " connected, but the ranks are 0.." + std::to_string(x.world - 1);
    } else if (served.count(rank) != 0) {
      refusal = "two processes have RANK=" + std::to_string(rank) + "; every rank must be started with its own RANK";
    }
    if (!refusal.empty()) {
      send_reply(peer.get(), false, refusal, hello_end);
      fail(FSDP_ERR_MISMATCH, "bootstrap: " + refusal);
    }
    if (send_reply(peer.get(), true, blob, hello_end)) served.insert(rank);
  }
  return blob;
}

std::string fetch(const TcpExchange& x, Clock::time_point end) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int rc = ::getaddrinfo(x.host.c_str(), std::to_string(x.port).c_str(), &hints, &found);
  if (rc != 0) {
    fail(FSDP_ERR_INVALID_ARGUMENT, "bootstrap: MASTER_ADDR " + base::quote(x.host) + " does not resolve (" +
                                        ::gai_strerror(rc) + "); it must name rank 0's host");
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> addrs(found, ::freeaddrinfo);
  std::string last_error = "nothing answered";
  for (;;) {
    for (addrinfo* a = addrs.get(); a != nullptr; a = a->ai_next) {
      Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
      if (!fd.ok()) continue;
      set_nonblocking(fd.get());
      if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
        last_error = std::strerror(errno);
        continue;
      }
      int err = 0;
      socklen_t len = sizeof err;
      if (!ready(fd.get(), POLLOUT, std::min(end, Clock::now() + std::chrono::seconds(1))) ||
          ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
        last_error = err != 0 ? std::strerror(err) : "no answer";
        continue;
      }
      char hello[kHelloBytes];
      std::memcpy(hello, kMagic, sizeof kMagic);
      put_u32(hello + 8, kVersion);
      put_u32(hello + 12, static_cast<uint32_t>(x.rank));
      put_u32(hello + 16, static_cast<uint32_t>(x.world));
      char head[5];
      if (!send_all(fd.get(), hello, sizeof hello, end) || !recv_all(fd.get(), head, sizeof head, end)) {
        last_error = "the connection closed before rank 0 answered";
        continue;
      }
      uint32_t n = get_u32(head + 1);
      if (n > kMaxPayload) fail(FSDP_ERR_COMM, "bootstrap: " + endpoint(x) + " answered with another protocol");
      std::string payload(n, '\0');
      if (!recv_all(fd.get(), payload.data(), n, end)) {
        fail(FSDP_ERR_COMM, "bootstrap: rank 0 at " + endpoint(x) + " closed the connection while sending the id");
      }
      if (head[0] != 0)
        fail(FSDP_ERR_MISMATCH, "bootstrap: rank 0 refused rank " + std::to_string(x.rank) + ": " + payload);
      return payload;
    }
    if (ms_left(end) == 0) {
      fail(FSDP_ERR_TIMEOUT, "bootstrap: rank " + std::to_string(x.rank) + " could not fetch the id from rank 0 at " +
                                 endpoint(x) + " within timeout_s = " + seconds(x.timeout_s) + " (last: " + last_error +
                                 "); rank 0 may not have started or may have failed, or MASTER_ADDR / MASTER_PORT "
                                 "differ between ranks");
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(kRetryEvery, end - Clock::now()));
  }
}

}  // namespace

std::string tcp_exchange_blob(const TcpExchange& x, const std::string& blob) {
  check_args(x);
  auto end = base::deadline_after(x.timeout_s);
  if (x.world == 1) return blob;
  return x.rank == 0 ? serve(x, blob, end) : fetch(x, end);
}

}  // namespace fsdp::comm
