// save_checkpoint_sharded: one checkpoint written by every rank of a group.
//
// The protocol, over the group's collectives (each step ends with every rank
// knowing whether any rank failed in it, so all ranks throw or go on together):
//   1. Every rank checks its own arguments and file names, and the names of
//      all ranks are compared: a bad argument or a name two ranks pass throws
//      InvalidArgument on every rank before anything is written.
//   2. Rank 0 runs save_checkpoint's step 2 (the directory, its writer lock,
//      the leftovers of crashed saves) and creates the temporary directory;
//      its path goes to every rank.
//   3. Every rank writes its files into it, each fsync'ed, and sends rank 0
//      their sizes and CRC32C.
//   4. Rank 0 writes the manifest listing every rank's files and commits
//      (save_checkpoint's steps 4 to 6).
// A rank that dies anywhere before 4's rename leaves the previous checkpoints
// untouched: the others fail in the next collective (PeerError or
// TimeoutError), and the temporary directory is removed by rank 0 then, or
// by the next save if rank 0 died too. The loader reads only committed
// directories, whose manifest lists every rank's file with its checksum.
#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "checkpoint/agree.hpp"
#include "checkpoint/layout.hpp"
#include "checkpoint/manifest.hpp"
#include "checkpoint/save_steps.hpp"
#include "cohort/checkpoint.hpp"
#include "cohort/process_group.hpp"

namespace cohort {
namespace {

using namespace ckpt;

template <class E>
void throw_if_any(ProcessGroup& group, const std::string& mine) {
  const auto [rank, error] = first_error(group, mine);
  if (rank < 0) return;
  throw E(rank == group.rank() ? error : fmt::format("save_checkpoint_sharded: rank {} failed: {}", rank, error));
}

std::string names_line(const std::map<std::string, std::vector<NamedTensor>>& files) {
  std::string line;
  for (const auto& [name, tensors] : files) line += name + "\n";
  return line;
}

}  // namespace

std::string save_checkpoint_sharded(ProcessGroup& world, const std::string& dir_arg, int64_t step,
                                    const std::map<std::string, std::vector<NamedTensor>>& files,
                                    const Manifest& manifest, const SaveOptions& options) {
  constexpr const char* kWho = "save_checkpoint_sharded";
  ProcessGroup& group = world.host_group();  // the ranks agree over host memory (nccl: its native twin)
  const bool lead = group.rank() == 0;
  // 1. Arguments, on every rank, and the names across ranks.
  std::string dir, error;
  std::map<std::string, EncodedHeader> headers;
  try {
    dir = checked_dir(dir_arg, step, options.keep_last, kWho);
    if (lead) check_manifest(manifest);
    headers = checked_headers(files, kWho);
  } catch (const std::exception& e) {  // anything (bad_alloc too): every rank must hear of it, or they would wait
    error = e.what();
  }
  throw_if_any<InvalidArgument>(group, error);
  const std::vector<std::string> names = allgather_strings(group, names_line(files));
  std::map<std::string, int> owner;
  for (size_t r = 0; r < names.size() && error.empty(); ++r)
    for (size_t at = 0, end; (end = names[r].find('\n', at)) != std::string::npos; at = end + 1) {
      const std::string name = names[r].substr(at, end - at);
      if (auto [it, fresh] = owner.emplace(name, static_cast<int>(r)); !fresh)
        error = fmt::format("{}: ranks {} and {} both pass a file named \"{}\"; each rank's files need names of "
                            "their own (e.g. \"{}.rank{}\")",
                            kWho, it->second, r, name, name, r);
    }
  if (!error.empty()) throw InvalidArgument(error);  // every rank found the same one

  // 2. Rank 0: the lock and the temporary directory, whose path every rank gets.
  Filesystem& fs = options.fs ? *options.fs : posix_filesystem();
  std::unique_ptr<SaveInProgress> save;
  if (lead) {
    try {
      save = std::make_unique<SaveInProgress>(fs, dir, step);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  throw_if_any<IoError>(group, error);
  const std::string tmp_dir = allgather_strings(group, lead ? save->tmp_dir() : std::string()).at(0);

  // 3. Every rank's files, and their sizes and checksums to rank 0.
  std::string report;
  try {
    for (const auto& [name, tensors] : files) {
      const FileInfo info = write_tensor_file(fs, tmp_dir, name, headers.at(name), tensors);
      report += fmt::format("{}\t{}\t{}\n", name, info.size, info.crc32c);
    }
  } catch (const std::exception& e) {
    error = fmt::format("writing its files into '{}': {}", tmp_dir, e.what());
  }
  throw_if_any<IoError>(group, error);  // rank 0's `save` removes the temporary directory as it unwinds
  const std::vector<std::string> reports = allgather_strings(group, report);

  // 4. Rank 0: the manifest of every rank's files, and the commit.
  std::string final_dir;
  if (lead) {
    try {
      std::map<std::string, FileInfo> infos;
      for (const std::string& r : reports)
        for (size_t at = 0, end; (end = r.find('\n', at)) != std::string::npos; at = end + 1) {
          const std::string line = r.substr(at, end - at);
          const size_t t1 = line.find('\t'), t2 = line.find('\t', t1 + 1);
          infos[line.substr(0, t1)] =
              FileInfo{std::stoull(line.substr(t1 + 1, t2 - t1 - 1)), static_cast<uint32_t>(std::stoul(line.substr(t2 + 1)))};
        }
      final_dir = save->commit(manifest, infos, options);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  throw_if_any<IoError>(group, error);
  return allgather_strings(group, final_dir).at(0);
}

}  // namespace cohort
