// The launcher agent for `cohort run --rdzv-backend c10d`: the dynamic,
// elastic counterpart of agent.hpp. Every launcher runs the same command; the
// one on the --rdzv-endpoint host hosts the store, the others connect. Each
// round of the elastic rendezvous (elastic_rendezvous.hpp) assigns node and
// global ranks; the workers of round k run with TORCHELASTIC_RESTART_COUNT=k.
// While they run, the agent watches, every half second, for: a failure
// published by another node, the end of the job, a launcher whose heartbeat
// stopped (liveness.hpp: killed, host down, link cut), and nodes waiting to
// join. Any of them stops the local workers; then, while restarts are left and
// at least --nnodes MIN nodes remain, every node joins the next round.
//
// Exit codes as agent.hpp: 0 all workers of the last round succeeded; 1 a
// failure with no restarts left, too few nodes left, another launcher stopped
// the job, this node lost the store, or the job could not start; 128+N this
// launcher was stopped by signal N (the other nodes stop too).
#pragma once

#include "launch/options.hpp"

namespace cohort::launch {

// Runs the job (validated options, is_elastic(opts)) and returns the exit code.
// Main thread, before any other thread starts.
int run_elastic_job(const LaunchOptions& opts);

}  // namespace cohort::launch
