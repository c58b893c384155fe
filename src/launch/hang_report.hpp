// The launcher's side of the hang verdict (src/group/hang_verdict.hpp): after
// a worker failed, read the verdict the ranks recorded in the store, so that
// `cohort run` prints it once for the job instead of once per rank.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "cohort/store.hpp"

namespace cohort::launch {

// The store key the ranks of attempt `attempt` write their verdict to (their
// world store is prefixed "cohort/<TORCHELASTIC_RESTART_COUNT>").
std::string hang_verdict_key(int attempt);

// Reads the verdict of attempt `attempt` from `store` if there is one; when
// `store` is null, connects to the launcher's own store at 127.0.0.1:port.
// Never throws (the store may be gone): nullopt when there is nothing to say.
std::optional<std::string> fetch_hang_verdict(const std::shared_ptr<Store>& store, int port, int attempt);

}  // namespace cohort::launch
