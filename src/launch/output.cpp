#include "launch/output.hpp"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

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

StreamSink::StreamSink(int console_fd, std::string prefix, const std::string& log_path)
    : console_fd_(console_fd), log_path_(log_path), prefixer_(std::move(prefix)) {
  if (log_path.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(log_path).parent_path(), ec);
  if (ec)
    throw IoError(fmt::format("cohort run: cannot create log directory for {}: {}; check --log-dir", log_path,
                              ec.message()));
  file_fd_ = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (file_fd_ < 0)
    throw IoError(fmt::format("cohort run: cannot create {}: {}; check --log-dir", log_path, std::strerror(errno)));
}

StreamSink::~StreamSink() {
  if (file_fd_ >= 0) ::close(file_fd_);
}

void StreamSink::write(std::string_view data) {
  if (file_fd_ >= 0 && !write_all(file_fd_, data)) {
    ::close(file_fd_);  // disk full or similar: keep the job running, lose the log
    file_fd_ = -1;
  }
  if (console_fd_ < 0) return;
  scratch_.clear();
  prefixer_.feed(data, scratch_);
  if (!scratch_.empty() && !write_all(console_fd_, scratch_)) console_fd_ = -1;
}

void StreamSink::finish() {
  if (console_fd_ >= 0) {
    scratch_.clear();
    prefixer_.finish(scratch_);
    if (!scratch_.empty() && !write_all(console_fd_, scratch_)) console_fd_ = -1;
  }
  if (file_fd_ >= 0) {
    ::close(file_fd_);
    file_fd_ = -1;
  }
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
