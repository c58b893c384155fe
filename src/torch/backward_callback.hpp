// What DistributedDataParallel and FSDP need to know of recompute()
// (recompute.cpp): its backward runs a nested backward pass, and a callback
// queued from inside that one with Engine::queue_callback would run when the
// nested pass ends, before the rest of the model's gradients exist.
#pragma once

#include <functional>

namespace cohort::torch::detail {

// Runs `callback` when the current backward pass ends: the outermost one,
// also when called from inside a recompute()'s nested backward.
void queue_backward_callback(std::function<void()> callback);

// Whether this thread is running the function of a recompute() that will
// be recomputed: its first run (under no-grad) or its run in backward.
bool in_recompute();

}  // namespace cohort::torch::detail
