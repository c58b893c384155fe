// The steps of save_checkpoint (save.cpp), for the saves that write one
// checkpoint from several processes (save_sharded.cpp): the directory, its
// lock and the temporary directory are one process's; the tensor files may be
// written by any process into that temporary directory; the commit is the
// first process's again.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/safetensors.hpp"
#include "cohort/checkpoint.hpp"

namespace cohort::ckpt {

// `dir` without trailing slashes; InvalidArgument for an empty one, a
// negative step or keep_last. `who` starts the messages.
std::string checked_dir(const std::string& dir, int64_t step, int keep_last, const char* who);
// Every file's name checked and its header laid out: InvalidArgument naming the file.
std::map<std::string, EncodedHeader> checked_headers(const std::map<std::string, std::vector<NamedTensor>>& files,
                                                     const char* who);
// Step 3 for one file: dir/<name>.safetensors, fsync'ed and closed.
FileInfo write_tensor_file(Filesystem& fs, const std::string& dir, const std::string& name,
                           const EncodedHeader& header, const std::vector<NamedTensor>& tensors);

// One save under way (save.cpp's steps 2 to 6). The constructor takes the
// directory's writer lock, clears the leftovers of crashed saves and creates
// the temporary directory; commit() writes the manifest, renames the
// directory into place and applies retention. Destroyed without a commit,
// the temporary directory is removed (best effort).
class SaveInProgress {
 public:
  SaveInProgress(Filesystem& fs, std::string dir, int64_t step);
  ~SaveInProgress();
  SaveInProgress(const SaveInProgress&) = delete;
  SaveInProgress& operator=(const SaveInProgress&) = delete;

  const std::string& tmp_dir() const { return tmp_dir_; }
  // `files`: by name without ".safetensors", as written into tmp_dir(). Returns the step directory.
  std::string commit(const Manifest& manifest, const std::map<std::string, FileInfo>& files, const SaveOptions& options);

 private:
  Filesystem& fs_;
  std::string dir_;
  int64_t step_;
  std::unique_ptr<DirLock> lock_;
  std::string final_dir_, tmp_dir_, old_dir_;
  bool committed_ = false;
};

}  // namespace cohort::ckpt
