// COHORT_TCP_CONGESTION: the congestion control of rank-to-rank sockets
// (src/transport/tcp/tcp_congestion.hpp), on real sockets.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/fd.hpp"
#include "transport/tcp/tcp_congestion.hpp"

namespace {

using cohort::transport::apply_congestion;

cohort::core::Fd tcp_socket() {
  cohort::core::Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  EXPECT_TRUE(fd.valid());
  return fd;
}

TEST(TcpCongestion, SystemAndAutoLeaveANonPacingAlgorithmAlone) {
  auto fd = tcp_socket();
  auto reno = apply_congestion(fd.get(), "reno");  // reno is always allowed
  if (reno.now.empty()) GTEST_SKIP() << "the kernel does not report TCP_CONGESTION";
  ASSERT_EQ(reno.problem, "");
  ASSERT_EQ(reno.now, "reno");
  EXPECT_EQ(apply_congestion(fd.get(), "system").now, "reno");
  EXPECT_EQ(apply_congestion(fd.get(), "").now, "reno");
  const auto a = apply_congestion(fd.get(), "auto");
  EXPECT_EQ(a.now, "reno");
  EXPECT_EQ(a.problem, "");
}

TEST(TcpCongestion, AutoReplacesBbr) {
  auto fd = tcp_socket();
  const auto bbr = apply_congestion(fd.get(), "bbr");
  if (!bbr.problem.empty() || bbr.now != "bbr") GTEST_SKIP() << "bbr is not available here: " << bbr.problem;
  const auto a = apply_congestion(fd.get(), "auto");
  if (a.problem.empty()) {
    EXPECT_EQ(a.now, "cubic");
  } else {  // cubic neither allowed to everyone nor this process privileged: bbr stays, and the problem says how to fix it
    EXPECT_EQ(a.now, "bbr");
    EXPECT_NE(a.problem.find("cannot set TCP congestion control cubic"), std::string::npos) << a.problem;
    EXPECT_NE(a.problem.find("HINT"), std::string::npos) << a.problem;
  }
}

TEST(TcpCongestion, AnUnknownAlgorithmIsNamedWithTheFix) {
  auto fd = tcp_socket();
  const auto before = apply_congestion(fd.get(), "system").now;
  const auto c = apply_congestion(fd.get(), "no-such-cc");
  EXPECT_EQ(c.now, before);
  EXPECT_NE(c.problem.find("cannot set TCP congestion control no-such-cc"), std::string::npos) << c.problem;
  EXPECT_NE(c.problem.find("HINT"), std::string::npos) << c.problem;
}

}  // namespace
