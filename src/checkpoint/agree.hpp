// Small agreements between the ranks of a group, for the checkpoint calls
// that every rank makes together (save_checkpoint_sharded,
// find_latest_valid): each is a collective, and every rank gets the same answer.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "cohort/process_group.hpp"

namespace cohort::ckpt {

// Every rank's string, by rank.
std::vector<std::string> allgather_strings(ProcessGroup& group, const std::string& mine);

// `root`'s string, on every rank.
std::string broadcast_string(ProcessGroup& group, const std::string& mine, int root);

// The lowest rank with a non-empty string and that string; {-1, ""} when every rank's is empty.
std::pair<int, std::string> first_error(ProcessGroup& group, const std::string& mine);

}  // namespace cohort::ckpt
