// The TCP congestion control of rank-to-rank sockets (COHORT_TCP_CONGESTION).
//
// Why: BBR, the system default on some distributions and clouds, paces each
// connection at the bandwidth it has estimated. A collective's traffic is
// bursts with idle gaps between them, and the pacing holds the bursts back:
// over a veth pair between two network namespaces (2026-11-29, Intel VM,
// `cohort bench allreduce` at 2 hosts x 1 rank) BBR took 0.64-0.73 ms at 1
// MiB against cubic's 0.30, 12.0 ms at 16 MiB against 4.7-5.4, 52 ms at 64
// MiB against 29-31; and a message above 64 KiB after a bulk transfer took
// 150-220 us against 20-55 (the "veth step" of docs/planning.md). Over a
// link held to 1 Gbit/s by tc both ran at the link's rate.
//
// So by default ("auto") a socket that the system gave BBR switches to cubic.
// Setting an algorithm outside net.ipv4.tcp_allowed_congestion_control needs
// CAP_NET_ADMIN; without it the socket keeps what it has, and the process
// says so once (INFO for auto, WARN for an algorithm named explicitly).
#pragma once

#include <string>

namespace cohort::transport {

struct CongestionChoice {
  std::string now;      // the socket's algorithm afterwards ("" when the kernel does not say)
  std::string problem;  // why the wish was not met, "" when it was (or there was nothing to do)
};

// Applies `spec` to TCP socket `fd`: "auto" (cubic in place of bbr, else
// nothing), "system" or "" (nothing), or an algorithm's name.
CongestionChoice apply_congestion(int fd, const std::string& spec);

// apply_congestion with COHORT_TCP_CONGESTION; a problem is logged once per process.
void tune_congestion(int fd);

}  // namespace cohort::transport
