// posix_filesystem(): the Filesystem seam over open/pwrite/pread/fsync/rename.
// Every failure is an IoError naming the operation, the path and errno, with a
// hint for the errors a user can fix (space, permissions, read-only mounts).
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <set>
#include <utility>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "cohort/filesystem.hpp"
#include "core/fd.hpp"
#include "core/log.hpp"

namespace cohort {
namespace {

std::string hint_for(int err) {
  switch (err) {
    case ENOSPC: case EDQUOT: return "; HINT: the disk (or your quota) is full: free space or save elsewhere";
    case EACCES: case EPERM: return "; HINT: check the permissions of the directory";
    case EROFS: return "; HINT: the file system is mounted read-only";
    case ENOENT: return "; HINT: does the directory exist?";
    case EMFILE: case ENFILE: return "; HINT: too many open files: raise `ulimit -n`";
    default: return "";
  }
}

[[noreturn]] void fail(const char* what, const std::string& path, int err) {
  throw IoError(fmt::format("cannot {} '{}': {} (errno {}){}", what, path, std::strerror(err), err, hint_for(err)));
}

class PosixWritableFile final : public WritableFile {
 public:
  PosixWritableFile(core::Fd fd, std::string path) : fd_(std::move(fd)), path_(std::move(path)) {}

  void append(const void* data, size_t n) override {
    const auto* p = static_cast<const char*>(data);
    while (n > 0) {
      ssize_t w = ::write(fd_.get(), p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        fail("write to", path_, errno);
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
  }

  void sync() override {
    while (::fsync(fd_.get()) != 0) {
      if (errno != EINTR) fail("fsync", path_, errno);
    }
  }

  // Closed here rather than by core::Fd, because close(2) may report a
  // deferred write error (NFS) that a save must see; EINTR leaves the fd
  // closed on Linux.
  void close() override {
    const int fd = fd_.release();
    if (fd >= 0 && ::close(fd) != 0 && errno != EINTR) fail("close", path_, errno);
  }

 private:
  core::Fd fd_;
  std::string path_;
};

class PosixReadableFile final : public ReadableFile {
 public:
  PosixReadableFile(core::Fd fd, std::string path) : fd_(std::move(fd)), path_(std::move(path)) {}

  uint64_t size() override {
    struct stat st;
    if (::fstat(fd_.get(), &st) != 0) fail("stat", path_, errno);
    return static_cast<uint64_t>(st.st_size);
  }

  void read_at(uint64_t offset, void* out, size_t n) override {
    auto* p = static_cast<char*>(out);
    while (n > 0) {
      ssize_t r = ::pread(fd_.get(), p, n, static_cast<off_t>(offset));
      if (r < 0) {
        if (errno == EINTR) continue;
        fail("read", path_, errno);
      }
      if (r == 0)
        throw IoError(fmt::format("cannot read '{}': the file ends at byte {} but {} more bytes were expected there",
                                  path_, offset, n));
      p += r;
      n -= static_cast<size_t>(r);
      offset += static_cast<uint64_t>(r);
    }
  }

 private:
  core::Fd fd_;
  std::string path_;
};

// The file beside the step directories that a save holds flock'ed; it stays
// (empty of meaning once released) and names the last holder.
constexpr const char* kLockName = ".cohort-save.lock";

// The lock files (device, inode) this process holds now, so that a refused
// save can tell "this process" from "another one" without trusting the
// recorded holder (a holder that opened the file read-only cannot update it).
std::mutex g_held_mu;
std::set<std::pair<dev_t, ino_t>> g_held;

class PosixDirLock final : public DirLock {
 public:
  PosixDirLock(core::Fd fd, std::pair<dev_t, ino_t> id) : fd_(std::move(fd)), id_(id) {
    std::lock_guard<std::mutex> lk(g_held_mu);
    g_held.insert(id_);
  }
  ~PosixDirLock() override {
    {
      std::lock_guard<std::mutex> lk(g_held_mu);
      g_held.erase(id_);
    }
    // fd_ closes after this: closing the last descriptor releases the flock.
  }

 private:
  core::Fd fd_;
  std::pair<dev_t, ino_t> id_;
};

std::string host_name() {
  char h[256] = {};
  if (::gethostname(h, sizeof(h) - 1) != 0) return "?";
  return h;
}

class PosixFilesystem final : public Filesystem {
 public:
  std::unique_ptr<WritableFile> create_file(const std::string& path) override {
    core::Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd.valid()) fail("create file", path, errno);
    return std::make_unique<PosixWritableFile>(std::move(fd), path);
  }

  std::unique_ptr<ReadableFile> open_file(const std::string& path) override {
    core::Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) fail("open", path, errno);
    return std::make_unique<PosixReadableFile>(std::move(fd), path);
  }

  void create_dir(const std::string& path) override {
    if (::mkdir(path.c_str(), 0755) != 0) fail("create directory", path, errno);
  }

  void sync_dir(const std::string& path) override {
    const core::Fd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!fd.valid()) fail("open directory", path, errno);
    int rc;
    while ((rc = ::fsync(fd.get())) != 0 && errno == EINTR) {
    }
    int err = errno;
    // Some file systems cannot fsync a directory (EINVAL): their renames are as durable as they get.
    if (rc != 0 && err != EINVAL) fail("fsync directory", path, err);
  }

  void rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) fail("rename", from + "' to '" + to, errno);
  }

  void remove_file(const std::string& path) override {
    if (::unlink(path.c_str()) != 0) fail("remove file", path, errno);
  }

  void remove_dir(const std::string& path) override {
    if (::rmdir(path.c_str()) != 0) fail("remove directory", path, errno);
  }

  std::vector<DirEntry> list_dir(const std::string& path) override {
    DIR* d = ::opendir(path.c_str());
    if (d == nullptr) fail("list directory", path, errno);
    std::vector<DirEntry> out;
    errno = 0;
    while (struct dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      // Symbolic links are not directories here (lstat semantics), so remove_all never follows one.
      bool dir = e->d_type == DT_DIR;
      struct stat st;
      if (e->d_type == DT_UNKNOWN) dir = ::lstat((path + "/" + name).c_str(), &st) == 0 && S_ISDIR(st.st_mode);
      out.push_back({std::move(name), dir});
      errno = 0;
    }
    int err = errno;
    ::closedir(d);
    if (err != 0) fail("list directory", path, err);
    return out;
  }

  bool exists(const std::string& path) override {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0;
  }

  bool is_dir(const std::string& path) override {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
  }

  bool is_symlink(const std::string& path) override {
    struct stat st;
    return ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
  }

  std::unique_ptr<DirLock> lock_dir(const std::string& dir) override {
    const std::string path = dir + "/" + kLockName;
    bool writable = true;
    core::Fd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644));
    if (!fd.valid() && errno == EACCES) {
      // Another user's lock file in a shared directory: a local flock needs no
      // write access. (There is none to fall back on when the file does not
      // exist: the directory itself is not writable, and that is the error.)
      writable = false;
      fd.reset(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
      if (!fd.valid()) fail("open the lock file", path, errno == ENOENT ? EACCES : errno);
    }
    if (!fd.valid()) fail("open the lock file", path, errno);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) fail("stat the lock file", path, errno);
    const std::pair<dev_t, ino_t> id{st.st_dev, st.st_ino};
    int rc;
    while ((rc = ::flock(fd.get(), LOCK_EX | LOCK_NB)) != 0 && errno == EINTR) {
    }
    if (rc != 0) {
      const int err = errno;
      if (err == EWOULDBLOCK) {
        char who[200] = {};
        const ssize_t n = ::pread(fd.get(), who, sizeof(who) - 1, 0);
        fd.reset();
        std::string holder = n > 0 ? std::string(who, static_cast<size_t>(n)) : std::string();
        while (!holder.empty() && (holder.back() == '\n' || holder.back() == '\0')) holder.pop_back();
        bool mine = false;
        {
          std::lock_guard<std::mutex> lk(g_held_mu);
          mine = g_held.count(id) != 0;
        }
        if (mine)
          throw IoError(fmt::format(
              "cannot save into '{}': this process holds its lock '{}' already (another thread of it is saving "
              "there); HINT: save from one thread at a time",
              dir, path));
        throw IoError(fmt::format(
            "cannot save into '{}': another save into it is in progress (last recorded holder of '{}': {}); HINT: "
            "save from one process only (rank 0 of a job), give each job its own checkpoint directory, and do not "
            "fork while saving (a child keeps the lock open)",
            dir, path, holder.empty() ? "unknown" : holder));
      }
      fd.reset();
      // NFS without a lock manager, some FUSE mounts, an NFS lock asked for
      // through a read-only open: save as before, unguarded (said once per process).
      static std::atomic<bool> warned{false};
      if (!warned.exchange(true))
        COHORT_WARN(kInit, "checkpoint: cannot lock '{}'{} ({}); saving without the guard against a second writer",
                    path, writable ? "" : " (opened read-only: another user created it)", std::strerror(err));
      return nullptr;
    }
    // Who holds it, for the message a second writer gets (informational: not fsync'ed).
    const std::string me = fmt::format("pid {} on {}\n", ::getpid(), host_name());
    if (writable && (::ftruncate(fd.get(), 0) != 0 || ::pwrite(fd.get(), me.data(), me.size(), 0) < 0)) {
      // The lock holds all the same; only the message would lack the holder.
    }
    return std::make_unique<PosixDirLock>(std::move(fd), id);
  }
};

}  // namespace

Filesystem& posix_filesystem() {
  static PosixFilesystem fs;
  return fs;
}

void remove_all(Filesystem& fs, const std::string& path) {
  if (fs.is_symlink(path)) {  // a link to a directory: the link goes, what it points to stays
    fs.remove_file(path);
    return;
  }
  if (!fs.exists(path)) return;
  if (!fs.is_dir(path)) {
    fs.remove_file(path);
    return;
  }
  for (const DirEntry& e : fs.list_dir(path)) {
    std::string child = path + "/" + e.name;
    if (e.is_dir)
      remove_all(fs, child);
    else
      fs.remove_file(child);
  }
  fs.remove_dir(path);
}

}  // namespace cohort
