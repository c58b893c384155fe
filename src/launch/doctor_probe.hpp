// `cohort doctor` phase 1 on one rank (doctor.hpp): the environment checks and
// the TCP probes between ranks. Internal to src/launch/doctor*.cpp.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cohort/store.hpp"
#include "group/launch_env.hpp"
#include "launch/doctor.hpp"
#include "store/net.hpp"

namespace cohort::launch::doctor {

// Hostname, and hostname + boot id + network namespace (what group set-up
// uses to decide that two ranks share /dev/shm and a network stack).
std::string hostname();
std::string host_identity();

// Fills everything of a RankReport but `peers`.
RankReport check_environment(const group::LaunchEnv& le, const group::EnvMap& env);

// A listener on `address`:0 that answers every connection's 8-byte request
// with this host's wall clock (ns since the epoch). Its own thread; stop() or
// the destructor ends it. With `closed` (the COHORT_DOCTOR_FAULT test knob) it
// binds the port but never listens, so that connecting to it is refused for
// real.
class ProbeListener {
 public:
  ProbeListener(const std::string& address, bool closed);
  ~ProbeListener();
  const std::string& advertised() const { return advertised_; }  // "addr:port"
  void stop();

 private:
  void loop();
  store::net::Fd fd_;
  std::string advertised_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// True when COHORT_DOCTOR_FAULT asks this rank to advertise a closed port.
bool fault_closed_port(int rank);

// Probes every peer whose "addr/<p>" appears in `store` (waiting for it until
// `deadline`), each connect bounded by COHORT_DOCTOR_CONNECT_TIMEOUT.
std::vector<PeerProbe> probe_peers(Store& store, int me, int world_size, core::Deadline deadline);

}  // namespace cohort::launch::doctor
