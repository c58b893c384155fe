#include "launch/output.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "cohort/error.hpp"

namespace cohort::launch {

LinePrefixer::LinePrefixer(std::string prefix, size_t max_line) : prefix_(std::move(prefix)), max_line_(max_line) {}

void LinePrefixer::feed(std::string_view data, std::string& out) {
  while (!data.empty()) {
    size_t nl = data.find('\n');
    if (nl == std::string_view::npos) {
      size_t room = max_line_ - pending_.size();
      if (data.size() < room) {
        pending_.append(data);
        return;
      }
      // Over-long line: emit a max_line piece so memory stays bounded.
      pending_.append(data.substr(0, room));
      data.remove_prefix(room);
      out.append(prefix_).append(pending_).push_back('\n');
      pending_.clear();
      continue;
    }
    out.append(prefix_).append(pending_).append(data.substr(0, nl + 1));
    pending_.clear();
    data.remove_prefix(nl + 1);
  }
}

void LinePrefixer::finish(std::string& out) {
  if (pending_.empty()) return;
  out.append(prefix_).append(pending_).push_back('\n');
  pending_.clear();
}

bool write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {  // a non-blocking stdout that is full: wait, never drop
        pollfd p{fd, POLLOUT, 0};
        ::poll(&p, 1, 100);
        continue;
      }
      return false;
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

struct ConsoleWriter::State {
  int fd;
  size_t limit;
  std::mutex mu;
  std::condition_variable wake;     // something to write, or closed
  std::condition_variable written;  // the queue became empty
  std::deque<std::string> queue;
  size_t queued = 0;                // bytes queued, the chunk being written included
  bool failed = false;
  bool closed = false;

  void run() {
    // Every signal goes to the launcher's main thread (its SignalChannel);
    // blocked here, a SIGPIPE from a vanished reader stays pending, unseen,
    // and the write returns EPIPE.
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, nullptr);
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      wake.wait(lk, [&] { return !queue.empty() || closed; });
      if (queue.empty()) return;  // closed and nothing left
      std::string chunk = std::move(queue.front());
      queue.pop_front();
      lk.unlock();
      const bool ok = write_all(fd, chunk);
      lk.lock();
      queued -= chunk.size();
      if (!ok) {
        failed = true;
        queue.clear();
        queued = 0;
      }
      if (queue.empty()) written.notify_all();
    }
  }

  void push(std::string data, size_t drop_above) {
    if (data.empty()) return;
    std::lock_guard<std::mutex> lk(mu);
    if (failed || queued > drop_above) return;
    queued += data.size();
    queue.push_back(std::move(data));
    wake.notify_one();
  }
};

ConsoleWriter::ConsoleWriter(int fd, size_t limit) : state_(std::make_shared<State>()) {
  state_->fd = fd;
  state_->limit = limit;
  std::thread([st = state_] { st->run(); }).detach();
}

ConsoleWriter::~ConsoleWriter() {
  std::lock_guard<std::mutex> lk(state_->mu);
  state_->closed = true;
  state_->wake.notify_all();
}

namespace {

// What may wait for a console before the workers' pipes are left unread.
constexpr size_t kConsoleLimit = 4u << 20;
// How long a console may keep the launcher from returning once the job was told to stop.
constexpr std::chrono::milliseconds kConsoleAfterStop{1000};
std::mutex g_consoles_mu;
ConsoleWriter* g_consoles[3] = {nullptr, nullptr, nullptr};

bool same_file(int a, int b) {
  struct stat sa, sb;
  return ::fstat(a, &sa) == 0 && ::fstat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

// The writer slot of `fd`: stderr shares stdout's when both are the same file.
int slot_of(int fd) { return fd == STDERR_FILENO && same_file(STDOUT_FILENO, STDERR_FILENO) ? STDOUT_FILENO : fd; }

}  // namespace

ConsoleWriter& ConsoleWriter::of(int fd) {
  if (fd != STDOUT_FILENO && fd != STDERR_FILENO)
    throw InvalidArgument(fmt::format("ConsoleWriter::of: fd {} is not the console (1 or 2)", fd));
  std::lock_guard<std::mutex> lk(g_consoles_mu);
  ConsoleWriter*& w = g_consoles[fd];
  if (w == nullptr) {
    const int slot = slot_of(fd);
    if (g_consoles[slot] == nullptr) g_consoles[slot] = new ConsoleWriter(slot, kConsoleLimit);  // never freed, see above
    w = g_consoles[slot];
  }
  return *w;
}

ConsoleWriter* ConsoleWriter::existing(int fd) {
  if (fd != STDOUT_FILENO && fd != STDERR_FILENO) return nullptr;
  std::lock_guard<std::mutex> lk(g_consoles_mu);
  return g_consoles[fd] != nullptr ? g_consoles[fd] : g_consoles[slot_of(fd)];
}

void ConsoleWriter::write(std::string data) { state_->push(std::move(data), SIZE_MAX); }

void ConsoleWriter::write_or_drop(std::string data) { state_->push(std::move(data), 4 * state_->limit); }

bool ConsoleWriter::congested() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->queued > state_->limit;
}

bool ConsoleWriter::drain(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(state_->mu);
  return state_->written.wait_for(lk, timeout, [&] { return state_->queued == 0; });
}

void launcher_say(std::string line) {
  line.push_back('\n');
  ConsoleWriter::of(STDERR_FILENO).write(std::move(line));
}

namespace {

// Waits for every console writer, up to `timeout` in all. True when all are done.
bool drain_all(std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  for (int fd : {STDOUT_FILENO, STDERR_FILENO}) {
    ConsoleWriter* w = ConsoleWriter::existing(fd);
    if (w == nullptr) continue;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (!w->drain(std::max(left, std::chrono::milliseconds(0)))) return false;
  }
  return true;
}

}  // namespace

int finish_console(SignalChannel& signals, int code, bool stopped) {
  if (stopped || (code > 128 && is_stop_signal(code - 128))) {
    drain_all(kConsoleAfterStop);
    return code;
  }
  while (!drain_all(std::chrono::milliseconds(100))) {
    if (int sig = signals.wait_stop_signal(0)) {
      drain_all(kConsoleAfterStop);
      return 128 + sig;
    }
  }
  return code;
}

void finish_console(std::optional<std::chrono::milliseconds> at_most) {
  if (at_most) {
    drain_all(*at_most);
    return;
  }
  while (!drain_all(std::chrono::hours(1))) {
  }
}

StreamSink::StreamSink(int console_fd, std::string prefix, const std::string& log_path)
    : console_fd_(console_fd), log_path_(log_path), prefixer_(std::move(prefix)) {
  if (console_fd_ >= 0) console_ = &ConsoleWriter::of(console_fd_);
  if (log_path.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(log_path).parent_path(), ec);
  if (ec)
    throw IoError(fmt::format("cohort run: cannot create log directory for {}: {}; check --log-dir", log_path,
                              ec.message()));
  file_fd_.reset(::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!file_fd_.valid())
    throw IoError(fmt::format("cohort run: cannot create {}: {}; check --log-dir", log_path, std::strerror(errno)));
}

void StreamSink::write(std::string_view data) {
  if (file_fd_.valid() && !write_all(file_fd_.get(), data))
    file_fd_.reset();  // disk full or similar: keep the job running, lose the log
  if (console_ == nullptr) return;
  std::string lines;
  prefixer_.feed(data, lines);
  console_->write(std::move(lines));
}

void StreamSink::finish() {
  if (console_ != nullptr) {
    std::string rest;
    prefixer_.finish(rest);
    console_->write(std::move(rest));
  }
  file_fd_.reset();
}

StreamRoute route_streams(const LaunchOptions& opts, int local_rank) {
  const int redirect = opts.redirects.for_rank(local_rank);
  const int tee = opts.tee.for_rank(local_rank);
  const bool all_files = !opts.log_dir.empty();
  StreamRoute r;
  r.console_out = !(redirect & kStdOut) || (tee & kStdOut);
  r.console_err = !(redirect & kStdErr) || (tee & kStdErr);
  r.file_out = all_files || ((redirect | tee) & kStdOut);
  r.file_err = all_files || ((redirect | tee) & kStdErr);
  return r;
}

std::string worker_log_dir(const std::string& log_root, const std::string& run_id, int attempt, int global_rank) {
  return fmt::format("{}/{}/attempt_{}/{}", log_root, run_id, attempt, global_rank);
}

}  // namespace cohort::launch
