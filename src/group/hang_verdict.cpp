#include "group/hang_verdict.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <thread>

#include "collectives/tuner.hpp"
#include "core/log.hpp"
#include "group/op.hpp"

namespace cohort::group {
namespace {

// "rank 1" / "ranks 0,2"
std::string who(const std::vector<int>& ranks) {
  return fmt::format("{} {}", ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, ","));
}
const char* has(const std::vector<int>& ranks) {
  return ranks.size() == 1 ? "has" : "have";
}

// What a rank's published progress says it completed, and how old that is:
// the record is what the rank knew when it published it, not what it does now.
std::string describe_completed(const Progress& p, int64_t now_wall_ms) {
  std::string age;  // "3.5 s ago", or empty when the record does not say (an older cohort's)
  if (p.published_wall_ms > 0 && now_wall_ms >= p.published_wall_ms)
    age = fmt::format("{:.1f} s ago", static_cast<double>(now_wall_ms - p.published_wall_ms) / 1000.0);
  if (p.completed < 0)
    return fmt::format("none: it had completed no collective in this group when it last published its progress{}",
                       age.empty() ? "" : ", " + age);
  std::string what = describe_call(static_cast<uint64_t>(p.completed), p.completed_fp, p.completed_count);
  return age.empty() ? what : fmt::format("{} (as published {})", what, age);
}

}  // namespace

int64_t wall_ms_now() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

Bytes heartbeat_record(Progress p) {
  p.published_wall_ms = wall_ms_now();
  const std::string s = p.encode();
  return Bytes(s.begin(), s.end());
}

std::string heartbeat_key(int rank) {
  return fmt::format("fr/hb/{}", rank);
}

std::string describe_hung_call(const HungCall& c) {
  const auto coll = static_cast<collectives::Coll>(c.fingerprint & 0x1f);
  const auto dt = static_cast<DType>((c.fingerprint >> 5) & 0xf);
  std::string name = collectives::coll_name(coll);
  if (coll == collectives::Coll::Barrier) return fmt::format("{} #{} (group {})", name, c.seq, c.group_id);
  return fmt::format("{} #{} (group {}, {} elements, {})", name, c.seq, c.group_id, c.count,
                     dtype_is_valid(dt) ? std::string(dtype_name(dt)) : std::string("?"));
}

std::string form_hang_verdict(const HungCall& call, const std::vector<std::optional<Progress>>& ranks,
                              int64_t now_wall_ms) {
  const auto S = static_cast<int64_t>(call.seq);
  std::vector<int> never, waiting, behind, done, silent;
  double waited = call.waited_s;
  for (int r = 0; r < static_cast<int>(ranks.size()); ++r) {
    const auto& p = ranks[r];
    if (!p)
      silent.push_back(r);
    else if (p->called < S)
      never.push_back(r);
    else if (p->completed >= S)
      done.push_back(r);
    else if (p->completed + 1 < S)
      behind.push_back(r);
    else {
      waiting.push_back(r);
      if (p->called == S && p->called_wall_ms > 0 && now_wall_ms > p->called_wall_ms)
        waited = std::min(waited, static_cast<double>(now_wall_ms - p->called_wall_ms) / 1000.0);
    }
  }
  const std::string op = describe_hung_call(call);
  std::vector<std::string> parts;
  // Ranks whose last call is #S but a different one (op, dtype, count, root):
  // a desync that no message revealed (e.g. two ranks that both wait as root).
  std::vector<std::pair<std::string, std::vector<int>>> calls;  // description -> ranks
  for (int r = 0; r < static_cast<int>(ranks.size()); ++r) {
    if (!ranks[r] || ranks[r]->called != S) continue;
    std::string d = describe_call(call.seq, ranks[r]->called_fp, ranks[r]->called_count);
    auto it = std::find_if(calls.begin(), calls.end(), [&](const auto& c) { return c.first == d; });
    if (it == calls.end())
      calls.push_back({d, {r}});
    else
      it->second.push_back(r);
  }
  if (calls.size() > 1) {
    std::vector<std::string> who_called;
    for (const auto& [d, rs] : calls) who_called.push_back(fmt::format("{} called {}", who(rs), d));
    parts.push_back(fmt::format("desync at #{} of group {}: {}", call.seq, call.group_id, fmt::join(who_called, ", ")));
  }
  if (!never.empty()) parts.push_back(fmt::format("{} never entered {}", who(never), op));
  for (int r : behind)
    parts.push_back(
        fmt::format("rank {} is stuck in an earlier operation: it has not completed #{} (its last "
                    "completed operation was {})",
                    r, ranks[r]->completed + 1, describe_completed(*ranks[r], now_wall_ms)));
  if (!waiting.empty()) {
    if (never.empty() && behind.empty() && silent.empty())
      parts.push_back(
          fmt::format("every rank entered {} and none completed it; {} {} waited {:.1f} s in it: a rank is "
                      "stuck inside the operation (a stopped process, a blocked network) or it needs "
                      "more than COHORT_TIMEOUT",
                      op, who(waiting), has(waiting), waited));
    else
      parts.push_back(fmt::format("{} {} waited {:.1f} s in it", who(waiting), has(waiting), waited));
  }
  if (!done.empty()) parts.push_back(fmt::format("{} completed it", who(done)));
  if (!silent.empty())
    parts.push_back(
        fmt::format("{} published no progress (it never finished setting up the group, lost the store, or "
                    "runs with COHORT_FLIGHT_RECORDER_HEARTBEAT=0)",
                    who(silent)));
  for (int r : never)
    parts.push_back(
        fmt::format("rank {}'s last completed operation was {}", r, describe_completed(*ranks[r], now_wall_ms)));
  return fmt::format("hang verdict: {}", fmt::join(parts, "; "));
}

std::string diagnose_hang(const HangInputs& in, const HungCall& call) {
  try {
    in.group_store->set(heartbeat_key(in.rank), heartbeat_record(in.recorder->progress()));
  } catch (const std::exception& e) {
    COHORT_WARN(kColl, "hang verdict: could not publish this rank's progress: {}", e.what());
  }
  // The others' progress threads publish at most one heartbeat late; ranks
  // stuck in the same operation publish theirs when they time out too.
  std::this_thread::sleep_for(in.grace);
  std::vector<std::optional<Progress>> ranks(static_cast<size_t>(in.size));
  for (int r = 0; r < in.size; ++r) {
    try {
      const std::string key = heartbeat_key(r);
      if (!in.group_store->check({key})) continue;
      Bytes b = in.group_store->get(key, std::chrono::milliseconds(1000));
      ranks[r] = Progress::decode(std::string(b.begin(), b.end()));
    } catch (const std::exception& e) {
      COHORT_WARN(kColl, "hang verdict: could not read rank {}'s progress: {}", r, e.what());
    }
  }
  std::string verdict = form_hang_verdict(call, ranks, wall_ms_now());
  if (in.world_store == nullptr) return verdict;
  try {
    Bytes mine(verdict.begin(), verdict.end());
    Bytes first = in.world_store->compare_set(kHangVerdictKey, Bytes{}, mine);
    if (!first.empty()) return std::string(first.begin(), first.end());
  } catch (const std::exception& e) {
    COHORT_WARN(kColl, "hang verdict: could not record it in the store: {}", e.what());
  }
  return verdict;
}

}  // namespace cohort::group
