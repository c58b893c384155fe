// The reducer's user-facing error messages, in c10d's spirit: what happened,
// why it usually happens, and the fix. Pure functions, so tests can read them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cohort/ddp.hpp"

namespace cohort::ddp::msg {

// "'fc.weight', 'fc.bias'" (at most 20 names, then "and N more"); unnamed
// parameters appear as "#index".
std::string param_list(const std::vector<ParamSpec>& params, const std::vector<size_t>& which);

// A new iteration (prepare_for_backward or mark_ready) found the previous one
// open: `unready` lists the parameters it never marked (empty: all were marked).
std::string prior_iteration(int rank, uint64_t iteration, const std::vector<ParamSpec>& params,
                            const std::vector<size_t>& unready);

std::string marked_twice(int rank, uint64_t iteration, const std::vector<ParamSpec>& params, size_t param);

// finalize() without find_unused_parameters found parameters never marked ready.
std::string unready_at_finalize(int rank, uint64_t iteration, const std::vector<ParamSpec>& params,
                                const std::vector<size_t>& unready);

std::string no_sync_mid_backward(int rank, uint64_t iteration, size_t marked, size_t total);

// The registered parameters or bucket plan differ between this rank and `other`.
std::string params_differ(int rank, int other, const int64_t mine[4], const int64_t theirs[4]);

}  // namespace cohort::ddp::msg
