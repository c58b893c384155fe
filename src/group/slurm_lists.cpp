// Slurm's compressed lists (declared in launch_env.hpp).
//
// A host list is a comma list of names; a name is literal text with bracket
// groups, each a comma list of numbers or ranges lo-hi: "node[01-04,07],gpu5".
// Commas inside brackets do not split names. A range's numbers keep the width
// of its first bound ("[08-10]" -> 08 09 10, "[8-10]" -> 8 9 10), as Slurm's
// hostlist does. A tasks-per-node list is a comma list of counts, each
// optionally repeated: "2(x3),1" -> 2 2 2 1.
#include <charconv>
#include <string_view>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "group/launch_env.hpp"

namespace cohort::group {
namespace {

// Lists bigger than this are a typo or an attack, not a cluster.
constexpr size_t kMaxEntries = 1'000'000;

struct Range {
  long long lo = 0, hi = 0;
  size_t width = 0;  // digits of the first bound: the zero padding
};
// Literal text, then (unless it ends the name) one bracket group.
struct Piece {
  std::string text;
  std::vector<Range> ranges;  // empty: no bracket group
};
using Name = std::vector<Piece>;

[[noreturn]] void bad_hostlist(const std::string& what, const std::string& list, const std::string& why) {
  throw InvalidArgument(fmt::format("{}='{}' is not a host list ({}); expected names like node[01-04,07],gpu5. "
                                    "Set MASTER_ADDR to rank 0's host to bypass it",
                                    what, list, why));
}

long long parse_bound(std::string_view s, const std::string& what, const std::string& list) {
  long long v = 0;
  if (s.empty() || s.size() > 15) bad_hostlist(what, list, fmt::format("bad number '{}' in brackets", s));
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || v < 0)
    bad_hostlist(what, list, fmt::format("bad number '{}' in brackets", s));
  return v;
}

std::vector<Range> parse_brackets(std::string_view body, const std::string& what, const std::string& list) {
  std::vector<Range> out;
  size_t start = 0;
  while (start <= body.size()) {
    size_t comma = body.find(',', start);
    std::string_view item = body.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    size_t dash = item.find('-');
    Range r;
    std::string_view lo = item.substr(0, dash);
    r.lo = parse_bound(lo, what, list);
    r.hi = dash == std::string_view::npos ? r.lo : parse_bound(item.substr(dash + 1), what, list);
    r.width = lo.size();
    if (r.hi < r.lo) bad_hostlist(what, list, fmt::format("range '{}' runs backwards", item));
    out.push_back(r);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

std::vector<Name> parse_hostlist(const std::string& list, const std::string& what) {
  std::vector<Name> names;
  Name name;
  Piece piece;
  size_t i = 0;
  auto end_name = [&] {
    if (!piece.text.empty() || !piece.ranges.empty()) name.push_back(std::move(piece));
    piece = Piece{};
    if (name.empty()) bad_hostlist(what, list, "empty name");
    names.push_back(std::move(name));
    name.clear();
  };
  while (i < list.size()) {
    char c = list[i];
    if (c == ',') {
      end_name();
      ++i;
    } else if (c == '[') {
      size_t close = list.find(']', i);
      if (close == std::string::npos) bad_hostlist(what, list, "'[' without ']'");
      std::string_view body(list.data() + i + 1, close - i - 1);
      if (body.find('[') != std::string_view::npos) bad_hostlist(what, list, "nested '['");
      piece.ranges = parse_brackets(body, what, list);
      name.push_back(std::move(piece));
      piece = Piece{};
      i = close + 1;
    } else if (c == ']' || c == ' ' || c == '\t' || c == '\n') {
      bad_hostlist(what, list, fmt::format("unexpected '{}'", c == ']' ? "]" : "whitespace"));
    } else {
      piece.text += c;
      ++i;
    }
  }
  end_name();
  return names;
}

std::string number(long long v, size_t width) { return fmt::format("{:0{}}", v, width); }

}  // namespace

std::vector<std::string> expand_hostlist(const std::string& list, const std::string& what) {
  std::vector<std::string> out;
  for (const Name& name : parse_hostlist(list, what)) {
    std::vector<std::string> partial{""};
    for (const Piece& p : name) {
      for (auto& s : partial) s += p.text;
      if (p.ranges.empty()) continue;
      std::vector<std::string> next;
      for (const auto& s : partial)
        for (const Range& r : p.ranges)
          for (long long v = r.lo; v <= r.hi; ++v) {
            if (out.size() + next.size() >= kMaxEntries)
              bad_hostlist(what, list, fmt::format("more than {} hosts", kMaxEntries));
            next.push_back(s + number(v, r.width));
          }
      partial = std::move(next);
    }
    for (auto& s : partial) out.push_back(std::move(s));
  }
  return out;
}

std::string first_host(const std::string& list, const std::string& what) {
  const std::vector<Name> names = parse_hostlist(list, what);  // never empty: an empty list throws
  std::string host;
  for (const Piece& p : names.front()) {
    host += p.text;
    if (!p.ranges.empty()) host += number(p.ranges.front().lo, p.ranges.front().width);
  }
  return host;
}

std::vector<int> expand_tasks_per_node(const std::string& list, const std::string& what) {
  auto bad = [&](const std::string& why) -> InvalidArgument {
    return InvalidArgument(fmt::format("{}='{}' is not a tasks-per-node list ({}); expected counts like 2(x3),1", what,
                                       list, why));
  };
  auto count = [&](std::string_view s) {
    int v = 0;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (s.empty() || ec != std::errc() || end != s.data() + s.size() || v < 1)
      throw bad(fmt::format("'{}' is not a positive count", s));
    return v;
  };
  std::vector<int> out;
  std::string_view rest(list);
  while (true) {
    size_t comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    int tasks = 0, times = 1;
    size_t paren = item.find('(');
    if (paren == std::string_view::npos) {
      tasks = count(item);
    } else {
      if (item.size() < paren + 4 || item.substr(paren, 2) != "(x" || item.back() != ')')
        throw bad(fmt::format("'{}' is not N or N(xM)", item));
      tasks = count(item.substr(0, paren));
      times = count(item.substr(paren + 2, item.size() - paren - 3));
    }
    if (out.size() + static_cast<size_t>(times) > kMaxEntries) throw bad(fmt::format("more than {} nodes", kMaxEntries));
    out.insert(out.end(), static_cast<size_t>(times), tasks);
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  return out;
}

}  // namespace cohort::group
