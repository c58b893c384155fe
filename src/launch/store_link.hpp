// The launcher's side of the rendezvous store: node 0 hosts it, every launcher
// of a multi-node job connects to it. The only launch file that needs the
// store's TCP implementation (the rest sees the abstract Store).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "cohort/store.hpp"
#include "launch/process.hpp"

namespace cohort::launch {

// Starts a TcpStoreServer on bind:port (port 0: a free one). Throws IoError
// saying which flag moves it when the port is taken.
std::unique_ptr<TcpStoreServer> host_store(const std::string& bind, int port);

// Connects to host:port, retrying until `timeout` passes (node 0 may start
// later) or a stop signal arrives (throws Interrupted). TimeoutError says what
// to check. op_timeout bounds every later call (a store that does not answer
// within it counts as gone).
std::shared_ptr<Store> connect_store(const std::string& host, int port, std::chrono::milliseconds timeout,
                                     SignalChannel& signals,
                                     std::chrono::milliseconds op_timeout = std::chrono::seconds(15));

// A TCP port that was free on `host` a moment ago (bind to port 0, read it,
// close). Like torchrun's --standalone, another process may take it before the
// program binds it; the window is small.
int pick_free_port(const std::string& host);

}  // namespace cohort::launch
