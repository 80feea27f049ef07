// The torchrun-style bootstrap (white-box, plain sockets on the loopback
// address): rank 0 hands a blob to every rank, also to ranks that start
// before it listens; a rank that never connects, a rank 0 that never starts,
// an address that does not resolve, a bad port, ranks that disagree on the
// world size or claim one rank twice, and a client that speaks another
// protocol: each fails within its timeout with a sentence naming what is
// missing, or is ignored, never a hang.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "comm/tcp_exchange.h"

using fsdp::comm::tcp_exchange_blob;
using fsdp::comm::TcpExchange;
using Clock = std::chrono::steady_clock;

namespace {

// A port that nothing listens on now (the system's pick for a socket bound to
// port 0, closed again).
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

struct Outcome {
  fsdp_status_t status = FSDP_OK;
  std::string text;  // the blob, or the error's message
  double seconds = 0;
};

Outcome run_exchange(const TcpExchange& x, const std::string& blob) {
  Outcome o;
  auto t0 = Clock::now();
  try {
    o.text = tcp_exchange_blob(x, blob);
  } catch (const fsdp::Error& e) {
    o.status = e.status();
    o.text = e.what();
  }
  o.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return o;
}

// Runs run_exchange() for each of `ranks` (rank, world) on its own thread, rank 0's
// `root_delay` late; returns the outcomes in the same order.
std::vector<Outcome> run(int port, const std::vector<std::pair<int, int>>& ranks, double timeout_s,
                         std::chrono::milliseconds root_delay = std::chrono::milliseconds(0)) {
  std::vector<Outcome> out(ranks.size());
  std::vector<std::thread> threads;
  const std::string blob(128, '\x5a');
  for (size_t i = 0; i < ranks.size(); ++i) {
    threads.emplace_back([&, i] {
      TcpExchange x{"127.0.0.1", port, ranks[i].first, ranks[i].second, timeout_s};
      if (x.rank == 0) std::this_thread::sleep_for(root_delay);
      out[i] = run_exchange(x, x.rank == 0 ? blob : std::string());
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST(TcpExchange, EveryRankGetsRankZerosBlobAlsoWhenItStartsFirst) {
  const int port = free_port();
  auto out = run(port, {{0, 4}, {1, 4}, {2, 4}, {3, 4}}, 20, std::chrono::milliseconds(300));
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i].status, FSDP_OK) << "rank " << i << ": " << out[i].text;
    EXPECT_EQ(out[i].text, std::string(128, '\x5a')) << "rank " << i;
  }
  // A world of one needs no socket at all.
  EXPECT_EQ(run_exchange({"127.0.0.1", port, 0, 1, 1}, "alone").text, "alone");
}

TEST(TcpExchange, ARankThatNeverConnectsFailsRankZeroWithinTheTimeoutNamingIt) {
  auto out = run(free_port(), {{0, 3}, {1, 3}}, 1.0);
  EXPECT_EQ(out[1].status, FSDP_OK) << out[1].text;
  EXPECT_EQ(out[0].status, FSDP_ERR_TIMEOUT) << out[0].text;
  EXPECT_TRUE(has(out[0].text, "rank 2 did not connect")) << out[0].text;
  EXPECT_LT(out[0].seconds, 10.0);
}

TEST(TcpExchange, ARankZeroThatNeverStartsFailsTheOthersWithinTheTimeoutNamingTheAddress) {
  const int port = free_port();
  auto out = run(port, {{1, 2}}, 0.5);
  EXPECT_EQ(out[0].status, FSDP_ERR_TIMEOUT) << out[0].text;
  EXPECT_TRUE(has(out[0].text, "127.0.0.1:" + std::to_string(port))) << out[0].text;
  EXPECT_GE(out[0].seconds, 0.4);
  EXPECT_LT(out[0].seconds, 10.0);
}

TEST(TcpExchange, BadAddressesPortsAndRanksAreRefusedAtOnce) {
  Outcome o = run_exchange({"no-such-host.invalid", 29500, 1, 2, 5}, "");
  EXPECT_EQ(o.status, FSDP_ERR_INVALID_ARGUMENT) << o.text;
  EXPECT_TRUE(has(o.text, "MASTER_ADDR 'no-such-host.invalid' does not resolve")) << o.text;
  for (int port : {0, -1, 65536}) {
    o = run_exchange({"127.0.0.1", port, 1, 2, 5}, "");
    EXPECT_EQ(o.status, FSDP_ERR_INVALID_ARGUMENT) << o.text;
    EXPECT_TRUE(has(o.text, "MASTER_PORT " + std::to_string(port))) << o.text;
  }
  for (auto [rank, world] : std::vector<std::pair<int, int>>{{2, 2}, {-1, 2}, {0, 0}}) {
    o = run_exchange({"127.0.0.1", 29500, rank, world, 5}, "");
    EXPECT_EQ(o.status, FSDP_ERR_INVALID_ARGUMENT) << o.text;
  }
  EXPECT_EQ(run_exchange({"", 29500, 1, 2, 5}, "").status, FSDP_ERR_INVALID_ARGUMENT);
}

TEST(TcpExchange, RanksThatDisagreeOnTheWorldOrShareARankFailNamingIt) {
  auto out = run(free_port(), {{0, 3}, {1, 4}}, 5);
  EXPECT_EQ(out[0].status, FSDP_ERR_MISMATCH) << out[0].text;
  EXPECT_EQ(out[1].status, FSDP_ERR_MISMATCH) << out[1].text;
  EXPECT_TRUE(has(out[1].text, "WORLD_SIZE=4 but rank 0 has 3")) << out[1].text;
  // Two processes with RANK=1: the second one to connect is refused (the
  // other got the blob), and so is rank 0.
  out = run(free_port(), {{0, 3}, {1, 3}, {1, 3}}, 5);
  EXPECT_EQ(out[0].status, FSDP_ERR_MISMATCH) << out[0].text;
  EXPECT_TRUE(has(out[0].text, "two processes have RANK=1")) << out[0].text;
  int refused = (out[1].status == FSDP_ERR_MISMATCH) + (out[2].status == FSDP_ERR_MISMATCH);
  EXPECT_EQ(refused, 1) << out[1].text << " / " << out[2].text;
}

TEST(TcpExchange, AClientThatSpeaksAnotherProtocolIsClosedAndTheRanksStillMeet) {
  const int port = free_port();
  const std::string blob(128, '\x5a');
  Outcome root, peer;
  bool stray_closed = false;
  std::thread root_thread([&] { root = run_exchange({"127.0.0.1", port, 0, 2, 20}, blob); });
  std::thread stray([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // rank 0 listens by now
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
      const char junk[] = "GET / HTTP/1.0\r\n\r\n";
      ::send(fd, junk, sizeof junk - 1, MSG_NOSIGNAL);
      char c;
      // Rank 0 closes it without a word (a reset, as the junk was not read).
      stray_closed = ::recv(fd, &c, 1, 0) <= 0;
    }
    ::close(fd);
  });
  std::thread peer_thread([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(400));  // after the stray
    peer = run_exchange({"127.0.0.1", port, 1, 2, 20}, "");
  });
  for (std::thread* t : {&root_thread, &stray, &peer_thread}) t->join();
  EXPECT_TRUE(stray_closed);
  EXPECT_EQ(root.status, FSDP_OK) << root.text;
  EXPECT_EQ(peer.status, FSDP_OK) << peer.text;
  EXPECT_EQ(peer.text, blob);
  EXPECT_LT(peer.seconds, 4.0) << "the stray did not hold the rank up";
}
