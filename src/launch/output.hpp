// Forwarding a worker's stdout / stderr: to the launcher's console with a
// torchrun-style "[rank3]: " prefix on every line, and/or raw to a per-rank log
// file (--log-dir, --redirects, --tee). Used only from the launcher's main thread.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "launch/options.hpp"

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

// Where one stream of one worker goes. Owns file_fd.
class StreamSink {
 public:
  // console_fd: 1 or 2, or -1 for none. log_path: empty for no file. The file is
  // created (with its directories) here; IoError names the path when it cannot be.
  StreamSink(int console_fd, std::string prefix, const std::string& log_path);
  ~StreamSink();
  StreamSink(const StreamSink&) = delete;
  StreamSink& operator=(const StreamSink&) = delete;

  void write(std::string_view data);
  void finish();  // end of stream: flush a partial line, close the file
  const std::string& log_path() const { return log_path_; }
  bool to_console() const { return console_fd_ >= 0; }

 private:
  int console_fd_;
  int file_fd_ = -1;
  std::string log_path_;
  LinePrefixer prefixer_;
  std::string scratch_;
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
