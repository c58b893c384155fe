// cohort/filesystem.hpp: the file-system seam under checkpoints (LevelDB's Env idea).
//
// Everything durable that cohort writes goes through a Filesystem, so tests can
// replace it: one that fails the k-th operation, one that "crashes" there (every
// later operation fails too, as if the process had died), or an in-memory one
// that drops whatever was not fsync'ed. posix_filesystem() is the real one.
//
// Every operation throws IoError naming the path and the system error on
// failure. Implementations must be safe to use from one thread at a time per
// object; posix_filesystem() is stateless and safe from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include "cohort/export.hpp"

namespace cohort {

// A file opened for writing by Filesystem::create_file.
class COHORT_API WritableFile {
 public:
  virtual ~WritableFile() = default;
  // Writes all of [data, data + n) at the end of the file (retries short writes).
  virtual void append(const void* data, size_t n) = 0;
  // fsync: the bytes appended so far survive a power loss once this returns.
  virtual void sync() = 0;
  // Closes the file; destroying an unclosed file closes it and ignores errors.
  virtual void close() = 0;
};

// A file opened for reading by Filesystem::open_file.
class COHORT_API ReadableFile {
 public:
  virtual ~ReadableFile() = default;
  virtual uint64_t size() = 0;
  // Reads exactly n bytes at `offset`; a file shorter than offset + n is an IoError.
  virtual void read_at(uint64_t offset, void* out, size_t n) = 0;
};

struct COHORT_API DirEntry {
  std::string name;  // no directory part; never "." or ".."
  bool is_dir = false;  // a real directory: a symbolic link to one is not
};

// An exclusive hold on a directory (Filesystem::lock_dir); released when destroyed.
class COHORT_API DirLock {
 public:
  virtual ~DirLock() = default;
};

class COHORT_API Filesystem {
 public:
  virtual ~Filesystem() = default;

  // Creates (or truncates) a regular file for writing.
  virtual std::unique_ptr<WritableFile> create_file(const std::string& path) = 0;
  virtual std::unique_ptr<ReadableFile> open_file(const std::string& path) = 0;
  // Creates one directory; its parent must exist. Fails if `path` exists.
  virtual void create_dir(const std::string& path) = 0;
  // fsync on a directory: entries created, renamed or removed in it so far are durable.
  virtual void sync_dir(const std::string& path) = 0;
  // rename(2): atomic; replaces `to` if it is a file or an empty directory.
  virtual void rename(const std::string& from, const std::string& to) = 0;
  virtual void remove_file(const std::string& path) = 0;
  // Removes an empty directory.
  virtual void remove_dir(const std::string& path) = 0;
  // The entries of a directory, in no particular order.
  virtual std::vector<DirEntry> list_dir(const std::string& path) = 0;
  // True if `path` names an existing file or directory; never throws for a missing path.
  virtual bool exists(const std::string& path) = 0;
  virtual bool is_dir(const std::string& path) = 0;
  // True if `path` itself is a symbolic link (lstat). File systems without links keep the default.
  virtual bool is_symlink(const std::string& /*path*/) { return false; }
  // Takes the directory's writer lock without waiting: save_checkpoint holds it
  // while it saves, so two processes never save into one directory at once.
  // Held elsewhere (another process, or another open of the lock file):
  // IoError naming the last recorded holder.
  // nullptr: this file system has no locks (the default; the posix one falls
  // back to it, with a warning, where the kernel refuses flock).
  virtual std::unique_ptr<DirLock> lock_dir(const std::string& /*dir*/) { return nullptr; }
};

// The operating system's file system (open/pwrite/pread/fsync/rename/unlink/rmdir).
COHORT_API Filesystem& posix_filesystem();

// Removes `path` and, if it is a directory, everything below it, through `fs`
// (so each removal is one operation a test can fail). Missing path: no-op.
// Symbolic links are removed, never followed: `path` itself included.
COHORT_API void remove_all(Filesystem& fs, const std::string& path);

}  // namespace cohort
