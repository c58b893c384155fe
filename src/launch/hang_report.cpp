#include "launch/hang_report.hpp"

#include <fmt/format.h>

#include "core/log.hpp"

namespace cohort::launch {

std::string hang_verdict_key(int attempt) {
  return fmt::format("cohort/{}/hang_verdict", attempt);
}

std::optional<std::string> fetch_hang_verdict(const std::shared_ptr<Store>& store, int port, int attempt) {
  try {
    std::shared_ptr<Store> s = store;
    if (!s) {
      if (port <= 0) return std::nullopt;
      TcpStoreOptions o;
      o.host = "127.0.0.1";
      o.port = static_cast<uint16_t>(port);
      o.timeout = std::chrono::seconds(5);
      o.connect_timeout = std::chrono::seconds(2);
      s = std::make_shared<TcpStore>(o);
    }
    const std::string key = hang_verdict_key(attempt);
    if (!s->check({key})) return std::nullopt;
    Bytes b = s->get(key, std::chrono::seconds(2));
    if (b.empty()) return std::nullopt;
    return std::string(b.begin(), b.end());
  } catch (const std::exception& e) {
    COHORT_INFO(kLaunch, "could not look for a hang verdict in the store: {}", e.what());
    return std::nullopt;
  }
}

}  // namespace cohort::launch
