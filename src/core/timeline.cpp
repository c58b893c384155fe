// Per-rank timeline buffer and writer (timeline.hpp).
#include "core/timeline.hpp"

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <vector>

#include "core/env.hpp"
#include "core/log.hpp"

namespace cohort::core::timeline {
namespace detail {
std::atomic<bool> g_on{false};
}
namespace {

const Knob kTimeline{"COHORT_TIMELINE", "",
                     "directory for a Chrome trace per rank (rank<R>.json; open in Perfetto, join with `cohort trace "
                     "merge DIR -o job.json`): spans for every collective and DDP phase; empty: off"};

constexpr size_t kFlushEvents = 8192;

struct Event {
  char ph;               // X complete, i instant, b/e async begin/end
  bool is_coll = false;  // name, args from `coll` and `group`
  int tid = 0;
  uint64_t id = 0;
  int64_t ts_ns = 0, dur_ns = 0;
  std::string name, cat, args, group;
  CollArgs coll;
};

struct State {
  std::mutex mu;
  std::string dir;
  int rank = -1;
  int64_t offset_ns = 0, error_ns = 0;
  std::string clock_method = "local", host;
  std::map<std::string, int, std::less<>> tracks;  // name -> tid
  std::vector<Event> buf;
  std::vector<bool> named;  // tids whose thread_name is in the file
  fmt::memory_buffer out;   // the text of one flush
  std::FILE* file = nullptr;
  bool closed = false;
  bool failed = false;
};

State& st() {
  static State* s = new State;  // never destroyed: close() runs from atexit while other statics die
  return *s;
}

int tid_locked(State& s, std::string_view track) {
  auto it = s.tracks.find(track);
  if (it != s.tracks.end()) return it->second;
  int tid = static_cast<int>(s.tracks.size()) + 1;
  s.tracks.emplace(std::string(track), tid);
  return tid;
}

void add(char ph, std::string_view track, std::string_view name, std::string_view cat, uint64_t id, int64_t ts,
         int64_t dur, std::string_view args);

std::string us(int64_t ns) {
  return fmt::format("{}.{:03d}", ns / 1000, static_cast<int>(ns % 1000));
}

void write_event(fmt::memory_buffer& out, int pid, const Event& e) {
  auto it = fmt::appender(out);
  if (e.is_coll) {
    const CollArgs& a = e.coll;
    fmt::format_to(it, R"({{"ph":"{}","pid":{},"tid":{},"ts":{},"name":"{}{}","cat":"{}")", e.ph, pid, e.tid,
                   us(e.ts_ns), a.op, e.ph == 'X' ? "" : " queued", e.ph == 'X' ? "coll" : "queue");
    if (e.ph == 'X')
      fmt::format_to(it,
                     R"(,"dur":{},"args":{{"op":"{}","seq":{},"bytes":{},"algo":"{}","group":"{}","rank":{},)"
                     R"("dtype":"{}","count":{},"queued":{}{}}})",
                     us(e.dur_ns), a.op, a.seq, a.bytes, a.algo, json_escape(e.group), a.rank, a.dtype, a.count,
                     a.queued ? "true" : "false", a.failed ? R"(,"failed":true)" : "");
    else
      fmt::format_to(it, R"(,"id":"0x{:x}","args":{{"seq":{}}})", e.id, a.seq);
    fmt::format_to(it, "}},\n");
    return;
  }
  fmt::format_to(it, R"({{"ph":"{}","pid":{},"tid":{},"ts":{},"name":"{}","cat":"{}")", e.ph, pid, e.tid, us(e.ts_ns),
                 json_escape(e.name), json_escape(e.cat));
  if (e.ph == 'X') fmt::format_to(it, R"(,"dur":{})", us(e.dur_ns));
  if (e.ph == 'b' || e.ph == 'e') fmt::format_to(it, R"(,"id":"0x{:x}")", e.id);
  if (e.ph == 'i') fmt::format_to(it, R"(,"s":"t")");
  if (!e.args.empty()) fmt::format_to(it, R"(,"args":{})", e.args);
  fmt::format_to(it, "}},\n");
}

// Opens the file on first use; metadata (process name, clock) goes first.
bool open_locked(State& s) {
  if (s.file) return true;
  if (s.failed) return false;
  ::mkdir(s.dir.c_str(), 0777);  // one level; an existing directory is fine
  std::string path = s.rank >= 0 ? fmt::format("{}/rank{}.json", s.dir, s.rank)
                                 : fmt::format("{}/pid{}.json", s.dir, static_cast<int>(::getpid()));
  s.file = std::fopen(path.c_str(), "w");
  if (!s.file) {
    s.failed = true;
    COHORT_WARN(kInit, "COHORT_TIMELINE: cannot write {}: {}; HINT: the directory must exist or its parent be writable",
                path, std::strerror(errno));
    return false;
  }
  const int pid = s.rank >= 0 ? s.rank : 0;
  std::fputs("[\n", s.file);
  std::fputs(fmt::format(R"({{"ph":"M","pid":{},"tid":0,"name":"process_name","args":{{"name":"rank {}"}}}},)"
                         "\n",
                         pid, pid)
                 .c_str(),
             s.file);
  std::fputs(fmt::format(R"({{"ph":"M","pid":{},"tid":0,"name":"process_sort_index","args":{{"sort_index":{}}}}},)"
                         "\n",
                         pid, pid)
                 .c_str(),
             s.file);
  std::fputs(fmt::format(
                 R"({{"ph":"M","pid":{},"tid":0,"name":"cohort_clock","args":{{"rank":{},"offset_ns":{},"error_ns":{},)"
                 R"("method":"{}","host":"{}"}}}},)"
                 "\n",
                 pid, s.rank, s.offset_ns, s.error_ns, json_escape(s.clock_method), json_escape(s.host))
                 .c_str(),
             s.file);
  return true;
}

void flush_locked(State& s) {
  if (s.closed || s.dir.empty()) return;
  if (s.buf.empty()) return;  // nothing recorded: no file (the launcher sees COHORT_TIMELINE too)
  if (!open_locked(s)) {
    s.buf.clear();
    return;
  }
  const int pid = s.rank >= 0 ? s.rank : 0;
  // Track names for tids first seen since the last flush: the viewer's row labels.
  for (const auto& [name, tid] : s.tracks) {
    if (static_cast<size_t>(tid) < s.named.size() && s.named[tid]) continue;
    if (s.named.size() <= static_cast<size_t>(tid)) s.named.resize(tid + 1, false);
    s.named[tid] = true;
    std::fputs(fmt::format(R"({{"ph":"M","pid":{},"tid":{},"name":"thread_name","args":{{"name":"{}"}}}},)"
                           "\n",
                           pid, tid, json_escape(name))
                   .c_str(),
               s.file);
    std::fputs(fmt::format(R"({{"ph":"M","pid":{},"tid":{},"name":"thread_sort_index","args":{{"sort_index":{}}}}},)"
                           "\n",
                           pid, tid, tid)
                   .c_str(),
               s.file);
  }
  fmt::memory_buffer& out = s.out;  // kept between flushes: no regrowth, no fresh pages
  out.clear();
  for (const auto& e : s.buf) write_event(out, pid, e);
  std::fwrite(out.data(), 1, out.size(), s.file);
  s.buf.clear();
  std::fflush(s.file);
}

void add(char ph, std::string_view track, std::string_view name, std::string_view cat, uint64_t id, int64_t ts,
         int64_t dur, std::string_view args) {
  State& s = st();
  std::lock_guard<std::mutex> lk(s.mu);
  if (s.closed) return;
  Event& e = s.buf.emplace_back();
  e.ph = ph;
  e.tid = tid_locked(s, track);
  e.id = id;
  e.ts_ns = ts;
  e.dur_ns = dur;
  e.name = name;
  e.cat = cat;
  e.args = args;
  if (s.buf.size() >= kFlushEvents && s.rank >= 0) flush_locked(s);
}

struct AutoStart {
  AutoStart() {
    std::string dir = kTimeline.str();
    if (!dir.empty()) enable(dir);
  }
} g_auto_start;

}  // namespace

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void span(std::string_view track, std::string_view name, std::string_view cat, int64_t start_ns, int64_t end_ns,
          std::string_view args_json) {
  if (!enabled()) return;
  add('X', track, name, cat, 0, start_ns, end_ns - start_ns, args_json);
}

void instant(std::string_view track, std::string_view name, std::string_view cat, int64_t at_ns,
             std::string_view args_json) {
  if (!enabled()) return;
  add('i', track, name, cat, 0, at_ns, 0, args_json);
}

void async_span(std::string_view track, std::string_view name, std::string_view cat, uint64_t id, int64_t start_ns,
                int64_t end_ns, std::string_view args_json) {
  if (!enabled()) return;
  add('b', track, name, cat, id, start_ns, 0, args_json);
  add('e', track, name, cat, id, end_ns, 0, {});
}

int track(std::string_view name) {
  State& s = st();
  std::lock_guard<std::mutex> lk(s.mu);
  return tid_locked(s, name);
}

void coll(int tid, int queue_tid, std::string_view group, const CollArgs& a, int64_t queued_ns, int64_t start_ns,
          int64_t end_ns) {
  if (!enabled()) return;
  State& s = st();
  std::lock_guard<std::mutex> lk(s.mu);
  if (s.closed) return;
  auto push = [&](char ph, int t, int64_t ts, int64_t dur) {
    Event& e = s.buf.emplace_back();
    e.ph = ph;
    e.is_coll = true;
    e.tid = t;
    e.id = a.seq;
    e.ts_ns = ts;
    e.dur_ns = dur;
    e.group = group;
    e.coll = a;
  };
  if (queued_ns != 0) {
    push('b', queue_tid, queued_ns, 0);
    push('e', queue_tid, start_ns, 0);
  }
  push('X', tid, start_ns, end_ns - start_ns);
  if (s.buf.size() >= kFlushEvents && s.rank >= 0) flush_locked(s);
}

void set_rank(int rank) {
  State& s = st();
  std::lock_guard<std::mutex> lk(s.mu);
  if (!s.file) s.rank = rank;  // a file already open keeps its name (events before init are rare)
}

void set_clock(int64_t offset_ns, int64_t error_ns, std::string_view method, std::string_view host) {
  State& s = st();
  std::lock_guard<std::mutex> lk(s.mu);
  s.offset_ns = offset_ns;
  s.error_ns = error_ns;
  s.clock_method = std::string(method);
  s.host = std::string(host);
}

void flush() {
  if (!enabled()) return;
  State& s = st();
  std::lock_guard<std::mutex> lk(s.mu);
  flush_locked(s);
}

void close() {
  if (!enabled()) return;
  State& s = st();
  std::lock_guard<std::mutex> lk(s.mu);
  if (s.closed) return;
  flush_locked(s);
  if (s.file) {
    // A last metadata event without the trailing comma, so the array is valid JSON.
    std::fputs(fmt::format(R"({{"ph":"M","pid":{},"tid":0,"name":"cohort_end","args":{{}}}})"
                           "\n]\n",
                           s.rank >= 0 ? s.rank : 0)
                   .c_str(),
               s.file);
    std::fclose(s.file);
    s.file = nullptr;
  }
  s.closed = true;
}

void enable(const std::string& dir) {
  State& s = st();
  {
    std::lock_guard<std::mutex> lk(s.mu);
    s.dir = dir;
    s.buf.reserve(kFlushEvents + 4);
  }
  static bool registered = false;
  if (!registered) {
    registered = true;
    std::atexit([] { close(); });
  }
  detail::g_on.store(true, std::memory_order_relaxed);
}

std::string json_escape(std::string_view in) {
  std::string out;
  out.reserve(in.size());
  for (char c : in) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20)
          out += fmt::format("\\u{:04x}", static_cast<int>(c));
        else
          out += c;
    }
  }
  return out;
}

}  // namespace cohort::core::timeline
