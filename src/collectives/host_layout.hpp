// HostLayout: which ranks of a group share a host, as the node-aware
// collectives (allreduce_hierarchical) see it. A pure function of the host
// identities every rank published at set-up, so tests can call it directly.
#pragma once

#include <string>
#include <vector>

namespace cohort::collectives {

struct HostLayout {
  int hosts = 1;            // distinct hosts in the group
  int ranks_per_host = 0;   // the same number on every host, else 0
  std::vector<int> local;   // group ranks on this rank's host, in rank order
  std::vector<int> cross;   // on every host, its rank at this rank's local index (hosts ordered by lowest rank);
                            // empty unless ranks_per_host > 0
  std::vector<std::vector<int>> members;  // members[h][j]: the rank at local index j of host h (when
                                          // ranks_per_host > 0)
  int local_index = 0;      // this rank's index in local
  int host_index = 0;       // this rank's host among the hosts, ordered by lowest rank
};

// host_of[r] is rank r's host identity; `me` this rank.
HostLayout host_layout(const std::vector<std::string>& host_of, int me);

// Why the node-aware algorithms cannot run on this layout ("" when they can):
// they need at least 2 hosts with the same number (>= 2) of ranks on each.
std::string hierarchical_unavailable(const HostLayout& l);

}  // namespace cohort::collectives
