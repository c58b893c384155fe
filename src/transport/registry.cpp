#include "transport/registry.hpp"

#include <array>

namespace cohort::transport {

// Defined by each transport beside its code (shm/shm_entry.cpp, tcp/tcp_entry.cpp).
// Declared here rather than in their headers, so that this table, the only
// place that lists them, includes none of them.
extern const TransportEntry kShmEntry;
extern const TransportEntry kTcpEntry;

namespace {
const std::array<const TransportEntry*, 2> kTable{&kShmEntry, &kTcpEntry};
}  // namespace

std::span<const TransportEntry* const> transports() { return kTable; }

const TransportEntry* find_transport(const std::string& name) {
  for (const TransportEntry* e : kTable)
    if (name == e->name) return e;
  return nullptr;
}

std::string transport_names() {
  std::string out;
  for (const TransportEntry* e : kTable) out += (out.empty() ? "" : ", ") + std::string(e->name);
  return out;
}

}  // namespace cohort::transport
