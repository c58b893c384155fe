// Helpers for tests that run a group's ranks as threads of one process.
#pragma once

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cohort/cohort.hpp"

namespace cohort::testing {

// Runs fn(group) on `n` threads, each one rank of a fresh world group over a
// shared MemoryStore. Rethrows the first exception any rank threw.
inline void run_ranks(int n, const std::string& transport, const std::function<void(ProcessGroup&)>& fn,
                      Millis timeout = Millis(60000)) {
  auto store = std::make_shared<MemoryStore>();
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        InitOptions o;
        o.rank = r;
        o.world_size = n;
        o.store = store;
        o.transport = transport;
        o.timeout = timeout;
        auto pg = init_process_group(o);
        fn(*pg);
        pg->shutdown();
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace cohort::testing
