// The launcher agent behind `cohort run`: one per node. It hosts the store
// (node 0), meets the other nodes (rendezvous.hpp), runs attempts of its local
// workers (monitor.hpp), restarts them up to --max-restarts times, and turns
// the outcome into one line on stderr and an exit code:
//   0        every worker of every node exited 0
//   1        a worker failed (after the restarts), or the job could not start
//            (bad program, port taken, rendezvous timeout, ...)
//   128+sig  the launcher was stopped by SIGINT/SIGTERM/SIGHUP/SIGQUIT
// Call from the main thread of a process that runs no other threads yet.
#pragma once

#include "launch/options.hpp"

namespace cohort::launch {

// Runs the job and returns the process exit code. Prints its own messages
// ("cohort run: ..."); throws cohort::Error only for problems found before any
// worker started (bad flags, program not found, store port taken,
// rendezvous failures), whose messages say the fix.
int run_job(const LaunchOptions& opts);

}  // namespace cohort::launch
