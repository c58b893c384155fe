// Forwarding a worker's stdout / stderr: to the launcher's console with a
// torchrun-style "[rank3]: " prefix on every line, and/or raw to a per-rank log
// file (--log-dir, --redirects, --tee). StreamSink is used from the launcher's
// main thread only; ConsoleWriter from any thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "core/fd.hpp"
#include "launch/options.hpp"
#include "launch/process.hpp"

namespace cohort::launch {

// Splits a byte stream into lines and prefixes each. A line is emitted only when
// complete, so a worker's partial write is never split across two prefixes. A
// partial line that grows to max_line bytes is emitted as a line of its own, so
// memory stays bounded when a worker never writes a newline.
class LinePrefixer {
 public:
  explicit LinePrefixer(std::string prefix, size_t max_line = 1 << 20);
  // Appends every completed line (prefix + line + '\n') to out; keeps the rest.
  void feed(std::string_view data, std::string& out);
  // At end of stream: the pending partial line, prefixed, with a '\n' added.
  void finish(std::string& out);

 private:
  std::string prefix_;
  std::string pending_;
  size_t max_line_;
};

// Writes all of data to fd (retrying short writes and EINTR). Returns false
// when the descriptor is gone (EPIPE etc.): the caller stops writing to it.
bool write_all(int fd, std::string_view data);

// The launcher's console (its stdout or its stderr), written by a thread of
// its own: the launcher only queues, so a reader that stops reading (a paused
// pager, a full pipe, a hung terminal) blocks that thread, never the loop that
// reaps workers and answers signals. When more than `limit` bytes wait,
// congested() is true and the monitor stops reading the worker pipes that lead
// here: the workers then block on their own output, as they would writing to
// that console directly. A descriptor that fails (EPIPE: the reader is gone)
// drops everything from then on, as the launcher did before. Thread-safe (the
// launcher's store and heartbeat threads log through it too).
class ConsoleWriter {
 public:
  // The process's writer for fd 1 or 2, created on first use and never
  // destroyed (at exit its thread may still be blocked in write()). When fd 1
  // and fd 2 are the same file (`2>&1`, one terminal) both get one writer, so
  // their lines keep the order they were queued in and never mix mid-line.
  static ConsoleWriter& of(int fd);
  // The writer serving `fd` if one was made for it (of(fd), or of() of the
  // other stream when both are the same file), else nullptr.
  static ConsoleWriter* existing(int fd);

  // `fd` must stay open until drain() returned true (or for good).
  ConsoleWriter(int fd, size_t limit);
  ~ConsoleWriter();  // does not wait: what is queued is still written
  ConsoleWriter(const ConsoleWriter&) = delete;
  ConsoleWriter& operator=(const ConsoleWriter&) = delete;

  void write(std::string data);  // never blocks
  // The launcher's own log lines: dropped once far more than `limit` waits,
  // so verbose logging onto a stuck console cannot grow without bound.
  void write_or_drop(std::string data);
  bool congested() const;
  // Waits until everything queued is written (or dropped), up to `timeout`. True when done.
  bool drain(std::chrono::milliseconds timeout);

 private:
  struct State;
  std::shared_ptr<State> state_;  // shared with the writing thread, which may outlive this object
};

// One line of the launcher's own ("cohort run: ..." and the like) to its
// stderr, in order with the workers' output that went there before it.
void launcher_say(std::string line);

// Before the launcher returns `code`: writes out what is still queued for the
// console, as long as that takes, while `signals` keeps the stop signals
// blocked. If the job was stopped by a signal (code 128 + SIGTERM, ...) or a
// stop signal arrives meanwhile, the console gets one more second at most
// (its reader may be gone for good), then the rest is dropped. `stopped`
// says the job was stopped though `code` does not show it. Returns the
// launcher's exit code: `code`, or 128 + the stop signal that arrived meanwhile.
int finish_console(SignalChannel& signals, int code, bool stopped = false);
// The same without a signal channel (none exists, or it is gone and SIGTERM
// ends the process the default way): as long as it takes, or `at_most`.
void finish_console(std::optional<std::chrono::milliseconds> at_most = std::nullopt);

// Where one stream of one worker goes. Owns file_fd.
class StreamSink {
 public:
  // console_fd: 1 or 2, or -1 for none. log_path: empty for no file. The file is
  // created (with its directories) here; IoError names the path when it cannot be.
  StreamSink(int console_fd, std::string prefix, const std::string& log_path);
  ~StreamSink() = default;
  StreamSink(const StreamSink&) = delete;
  StreamSink& operator=(const StreamSink&) = delete;

  void write(std::string_view data);
  void finish();  // end of stream: flush a partial line, close the file
  const std::string& log_path() const { return log_path_; }
  bool to_console() const { return console_fd_ >= 0; }
  // Its console has more queued than it can take now: do not read more for it.
  bool congested() const { return console_ != nullptr && console_->congested(); }
  // From now on the console part is thrown away (the log file still gets everything).
  void drop_console() { console_ = nullptr; }

 private:
  int console_fd_;
  ConsoleWriter* console_ = nullptr;  // ConsoleWriter::of(console_fd_)
  core::Fd file_fd_;  // the log file; closed at finish() or when a write fails
  std::string log_path_;
  LinePrefixer prefixer_;
};

// Routing of one worker's two streams, from the flags:
//   console: unless the stream is in --redirects and not in --tee;
//   file:    when --log-dir is given (both streams), or for the streams named
//            in --redirects / --tee (then in a temporary log directory).
struct StreamRoute {
  bool console_out = true, console_err = true;
  bool file_out = false, file_err = false;
};
StreamRoute route_streams(const LaunchOptions& opts, int local_rank);

// DIR/<run_id>/attempt_<k>/<global rank>/{stdout,stderr}.log without the file
// name. The global rank, not the local one: with several nodes on a shared
// file system their launchers write into the same DIR/<run_id>.
std::string worker_log_dir(const std::string& log_root, const std::string& run_id, int attempt, int global_rank);

}  // namespace cohort::launch
