// The table of transports: how the group layer finds and opens them without
// naming any (NCCL keeps its transports the same way, as a list of entries
// each with a can-connect test).
//
// Each entry says which peers it can reach and how to open links to a set of
// them. The group asks the entries in table order and gives each peer to the
// first that reaches it (shared memory before TCP), or to the one that
// COHORT_TRANSPORT names. A new transport is a folder under src/transport/
// that defines its entry, and one line in registry.cpp: src/group/ does not
// change (docs/design.md, "Layers").
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cohort/store.hpp"
#include "core/clock.hpp"
#include "transport/transport.hpp"

namespace cohort::transport {

// Which peers an entry can reach. SameHost: ranks that share this host's
// memory and kernel (the group compares hostname, boot id and network
// namespace); AnyHost: every rank.
enum class Reach { SameHost, AnyHost };

// What one group asks of one transport (collective over `ranks`).
struct OpenRequest {
  int my_rank = 0;
  int size = 1;
  std::vector<int> ranks;        // group ranks this transport links, ascending; my_rank among them
  std::vector<int> world_ranks;  // world rank of each group rank (all `size` of them)
  std::string run_id;            // unique per job (names shared-memory segments)
  std::string group_id;          // "0" for the world, "0.1", ... (both ends of a link agree on it)
  std::string route_hint;        // host to route towards when choosing an interface (the store's host)
  bool allow_single_copy = true;  // false: this rank opts out of single copy (and so its peers)
  Store* store = nullptr;        // the group's store, already prefixed
  core::Deadline deadline;
};

// What a transport opened for one group: a connection to each of the
// requested peers, and what the group needs to know about them. Lives as long
// as the group (its connections may refer to it).
class Links {
 public:
  virtual ~Links() = default;
  // The connection to `peer` (one of the request's ranks, not my_rank). Call once per peer.
  virtual std::unique_ptr<Connection> take(int peer) = 0;
  // What the engine sleeps on for this transport's connections, or nullptr
  // when their descriptors are polled (Connection::poll_fds).
  virtual Waiter* waiter() { return nullptr; }
  // "" when every pair of these ranks may access each other's memory
  // (Connection::read_remote, map_remote); otherwise why not, for the log.
  virtual std::string single_copy_unavailable() const = 0;
  // This rank's address on the transport ("10.0.0.2:41234"), "" when it has none.
  virtual std::string local_address() const { return ""; }
  // The peer's address on the transport, "" when unknown or it has none (for the INFO log).
  virtual std::string peer_address(int /*peer*/) const { return ""; }
};

struct TransportEntry {
  const char* name;  // what COHORT_TRANSPORT and the logs call it
  Reach reach;
  std::unique_ptr<Links> (*open)(const OpenRequest& request);
};

// Every transport, in the order of preference.
std::span<const TransportEntry* const> transports();
// The entry named `name`, or nullptr.
const TransportEntry* find_transport(const std::string& name);
// "shm, tcp": the names, for messages that list the choices.
std::string transport_names();

}  // namespace cohort::transport
