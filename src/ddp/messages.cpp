#include "ddp/messages.hpp"

#include <fmt/format.h>

namespace cohort::ddp::msg {
namespace {
constexpr size_t kMaxNames = 20;
constexpr const char* kPriorIteration = "Expected to have finished reduction in the prior iteration before starting a new one";
}  // namespace

std::string param_list(const std::vector<ParamSpec>& params, const std::vector<size_t>& which) {
  std::string s;
  for (size_t k = 0; k < which.size() && k < kMaxNames; ++k) {
    if (k > 0) s += ", ";
    const std::string& name = params[which[k]].name;
    s += name.empty() ? fmt::format("#{}", which[k]) : fmt::format("'{}'", name);
  }
  if (which.size() > kMaxNames) s += fmt::format(" and {} more", which.size() - kMaxNames);
  return s;
}

std::string prior_iteration(int rank, uint64_t iteration, const std::vector<ParamSpec>& params,
                            const std::vector<size_t>& unready) {
  if (unready.empty())
    return fmt::format(
        "rank {}: {}. Iteration {} marked all {} parameters ready but finalize() was not called. HINT: call "
        "Reducer::finalize() after every backward pass (the DistributedDataParallel adapter calls it before the "
        "optimizer step); to run several backward passes before one reduction, run all but the last under no_sync()",
        rank, kPriorIteration, iteration, params.size());
  return fmt::format(
      "rank {}: {}. Iteration {} marked {} of {} parameters ready and was not finalized; these received no gradient: "
      "{}. This usually means the model has parameters that did not take part in producing the loss. HINT: call "
      "finalize() after every backward pass; if some parameters go unused in some iterations, construct the Reducer "
      "with find_unused_parameters = true, and make sure every forward output takes part in the loss",
      rank, kPriorIteration, iteration, params.size() - unready.size(), params.size(), param_list(params, unready));
}

std::string marked_twice(int rank, uint64_t iteration, const std::vector<ParamSpec>& params, size_t param) {
  return fmt::format(
      "rank {}: parameter {} (index {}) was marked ready twice in iteration {}. Expected to mark a parameter ready "
      "only once per backward pass. Causes: the parameter is shared and its hook fires more than once (reentrant "
      "backward, activation checkpointing), or a new backward pass began before the previous one was finalized. HINT: "
      "call finalize() after every backward pass (and prepare_for_backward() in forward, so that a new pass is "
      "reported as such); use no_sync() to accumulate gradients over several backward passes",
      rank, param_list(params, {param}), param, iteration);
}

std::string unready_at_finalize(int rank, uint64_t iteration, const std::vector<ParamSpec>& params,
                                const std::vector<size_t>& unready) {
  return fmt::format(
      "rank {}: finalize(): {} of {} parameters received no gradient in iteration {}: {}. Expected every parameter to "
      "be marked ready before finalize(): the model has parameters that did not take part in producing the loss on "
      "this rank. HINT: construct the Reducer with find_unused_parameters = true (a parameter without a gradient then "
      "counts as its registered gradient, or zero), or make every forward output take part in the loss. The buckets "
      "holding these parameters were never reduced, so this reducer cannot be used again",
      rank, unready.size(), params.size(), iteration, param_list(params, unready));
}

std::string no_sync_mid_backward(int rank, uint64_t iteration, size_t marked, size_t total) {
  return fmt::format(
      "rank {}: no_sync() entered while synced iteration {} is in progress ({} of {} parameters already marked "
      "ready). HINT: enter no_sync() before the forward pass, leave it after backward, and call finalize() after "
      "every synced backward pass",
      rank, iteration, marked, total);
}

std::string params_differ(int rank, int other, const int64_t mine[4], const int64_t theirs[4]) {
  std::string what;
  if (mine[0] != theirs[0] || mine[1] != theirs[1])
    what = fmt::format("rank {} registered {} parameters ({} elements) while this rank registered {} ({} elements)",
                       other, theirs[0], theirs[1], mine[0], mine[1]);
  else if (mine[2] != theirs[2])
    what = fmt::format("rank {} registered parameters with other sizes, dtypes or order than this rank", other);
  else
    what = fmt::format("rank {} planned other buckets than this rank (bucket_cap_mb or first_bucket_mb differ)", other);
  return fmt::format(
      "rank {}: Reducer: {}. HINT: every rank must build the same model, register the same parameters (same "
      "counts, dtypes and order) and use the same bucket_cap_mb and first_bucket_mb",
      rank, what);
}

}  // namespace cohort::ddp::msg
