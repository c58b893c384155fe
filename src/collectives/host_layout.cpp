#include "collectives/host_layout.hpp"

#include <algorithm>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace cohort::collectives {

HostLayout host_layout(const std::vector<std::string>& host_of, int me) {
  HostLayout l;
  // Hosts in the order of their lowest rank; each host's ranks in rank order.
  std::vector<std::vector<int>> members;
  std::map<std::string, int> index;
  for (int r = 0; r < static_cast<int>(host_of.size()); ++r) {
    auto [it, fresh] = index.emplace(host_of[r], static_cast<int>(members.size()));
    if (fresh) members.emplace_back();
    members[it->second].push_back(r);
  }
  l.hosts = static_cast<int>(members.size());
  l.host_index = index.at(host_of[me]);
  l.local = members[l.host_index];
  l.local_index = static_cast<int>(std::find(l.local.begin(), l.local.end(), me) - l.local.begin());
  const size_t per = members.front().size();
  const bool uniform = std::all_of(members.begin(), members.end(), [&](const auto& m) { return m.size() == per; });
  l.ranks_per_host = uniform ? static_cast<int>(per) : 0;
  if (uniform) {
    for (const auto& m : members) l.cross.push_back(m[l.local_index]);
    l.members = members;
  }
  return l;
}

std::string hierarchical_unavailable(const HostLayout& l) {
  if (l.hosts < 2) return "every rank of the group is on one host";
  if (l.ranks_per_host == 0)
    return fmt::format("the {} hosts do not have the same number of ranks (this host has {})", l.hosts,
                       l.local.size());
  if (l.ranks_per_host < 2) return "there is one rank per host: the flat algorithms are already node-aware";
  return "";
}

}  // namespace cohort::collectives
