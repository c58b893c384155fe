// The TCP transport's entry in the table of transports (transport/registry.hpp):
// any rank, on this host or another.
#include <fmt/format.h>

#include "transport/registry.hpp"
#include "transport/tcp/tcp_transport.hpp"

namespace cohort::transport {
namespace {

class TcpLinks final : public Links {
 public:
  TcpLinks(std::unique_ptr<TcpTransport> tcp, Store* store) : tcp_(std::move(tcp)), store_(store) {}
  std::unique_ptr<Connection> take(int peer) override { return tcp_->take(peer); }
  std::string single_copy_unavailable() const override {
    return "some peers are over tcp (on other hosts, or COHORT_TRANSPORT=tcp)";
  }
  std::string local_address() const override { return tcp_->local_address(); }
  // What the peer published when it listened (tcp_transport.hpp, "Set-up").
  std::string peer_address(int peer) const override {
    try {
      return store_->get_string(fmt::format("tcp/{}", peer), Millis(1000));
    } catch (const std::exception&) {
      return "";
    }
  }

 private:
  std::unique_ptr<TcpTransport> tcp_;
  Store* store_;  // the group's, which outlives its links
};

std::unique_ptr<Links> open_tcp(const OpenRequest& r) {
  TcpOptions to;
  to.my_rank = r.my_rank;
  to.size = r.size;
  for (int p : r.ranks)
    if (p != r.my_rank) to.peers.push_back(p);
  to.group_id = r.run_id + "/" + r.group_id;
  to.route_hint = r.route_hint;
  return std::make_unique<TcpLinks>(TcpTransport::open(to, *r.store, r.deadline), r.store);
}

}  // namespace

extern const TransportEntry kTcpEntry;
const TransportEntry kTcpEntry{"tcp", Reach::AnyHost, &open_tcp};

}  // namespace cohort::transport
