// The shared-memory transport's entry in the table of transports
// (transport/registry.hpp): ranks on this host, one segment per group.
#include <fmt/format.h>

#include "transport/registry.hpp"
#include "transport/shm/shm_transport.hpp"

namespace cohort::transport {
namespace {

class ShmLinks final : public Links {
 public:
  explicit ShmLinks(std::unique_ptr<ShmTransport> shm) : shm_(std::move(shm)) {}
  std::unique_ptr<Connection> take(int peer) override { return shm_->connect(peer); }
  Waiter* waiter() override { return shm_.get(); }
  std::string single_copy_unavailable() const override { return shm_->single_copy_unavailable_reason(); }

 private:
  std::unique_ptr<ShmTransport> shm_;
};

std::unique_ptr<Links> open_shm(const OpenRequest& r) {
  ShmOptions so;
  // One segment per (job, group, host): the host's lowest rank names it.
  so.name = fmt::format("cohort-{}-g{}-r{}", r.run_id, r.group_id, r.world_ranks.at(r.ranks.front()));
  so.local_ranks = r.ranks;
  so.my_rank = r.my_rank;
  so.single_copy = r.allow_single_copy;
  return std::make_unique<ShmLinks>(ShmTransport::open(so, *r.store, r.deadline));
}

}  // namespace

extern const TransportEntry kShmEntry;
const TransportEntry kShmEntry{"shm", Reach::SameHost, &open_shm};

}  // namespace cohort::transport
