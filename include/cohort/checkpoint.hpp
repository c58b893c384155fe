// cohort/checkpoint.hpp: named tensors in safetensors files, and atomic training checkpoints.
//
// Two layers (docs/checkpoint-format.md has the exact formats):
//   - safetensors files: write_safetensors / read_safetensors. Files open in
//     Python's `safetensors` library, or in a dozen lines of plain Python.
//   - checkpoint directories: save_checkpoint writes ckpt_dir/step_000001234/
//     with one .safetensors file per name plus manifest.json (training state,
//     sizes and CRC32C checksums), atomically: a crash at any point leaves the
//     previous checkpoints loadable. load_latest_valid finds the newest
//     checkpoint that verifies, skipping (and reporting) newer broken ones.
//
// This layer knows nothing about LibTorch: a framework adapter turns parameters,
// buffers and optimizer state into NamedTensors and back.
//
// Threads: every function may be called from any thread; they share no state.
// One process at a time saves into a given checkpoint directory: a save holds
// the directory's writer lock (flock on .cohort-save.lock) and a second process
// saving there meanwhile gets an IoError naming the holder.
//
// Errors: bad arguments are InvalidArgument (nothing was written); the OS
// refusing is IoError; a file that is truncated, corrupted or not in the format
// is FormatError (an IoError, cohort/error.hpp). Every message names the file
// and the problem.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cohort/error.hpp"
#include "cohort/filesystem.hpp"
#include "cohort/types.hpp"
#include "cohort/export.hpp"

namespace cohort {

class ProcessGroup;

// One tensor: contiguous, row-major ("C" order), little-endian element bytes.
struct COHORT_API NamedTensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;  // {} is a 0-d scalar (1 element); a 0 anywhere is an empty tensor
  std::vector<uint8_t> bytes;  // exactly numel() * dtype_size(dtype) bytes

  // Product of shape (1 for a scalar); throws InvalidArgument for a negative or overflowing shape.
  uint64_t numel() const;
};

// Builds a NamedTensor from typed values: float, double, int8_t, uint8_t,
// int32_t, int64_t (F16/BF16 tensors are built from their raw bytes).
template <class T>
NamedTensor make_tensor(std::string name, std::vector<int64_t> shape, const std::vector<T>& values) {
  NamedTensor t{std::move(name), dtype_of<T>(), std::move(shape), {}};
  const auto* p = reinterpret_cast<const uint8_t*>(values.data());
  t.bytes.assign(p, p + values.size() * sizeof(T));
  return t;
}

// ---- safetensors ----------------------------------------------------------

struct COHORT_API SafetensorsFile {
  std::vector<NamedTensor> tensors;            // in file (data offset) order
  std::map<std::string, std::string> metadata;  // the header's "__metadata__" (may be empty)
};

struct COHORT_API SafetensorsWriteOptions {
  // Written as "__metadata__". {"format": "pt"} tells Hugging Face loaders the
  // tensors use PyTorch's layout (they refuse files without it); safe to keep.
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  Filesystem* fs = nullptr;  // nullptr: posix_filesystem()
};

// The whole file in memory. Tensors are laid out by element size, largest first,
// then by name, so each tensor's data is aligned to its element size. Throws
// InvalidArgument for an empty or duplicate name, "__metadata__" as a name, or a
// byte count that does not match dtype x shape.
COHORT_API std::vector<uint8_t> encode_safetensors(const std::vector<NamedTensor>& tensors,
                                        const std::map<std::string, std::string>& metadata = {{"format", "pt"}});
// Parses and validates a whole file held in memory; `name` is used in errors.
// Throws FormatError.
COHORT_API SafetensorsFile decode_safetensors(std::span<const uint8_t> file, const std::string& name = "<memory>");

// Durable write: path.tmp-<pid>, fsync, rename over `path`, fsync the directory.
COHORT_API void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const SafetensorsWriteOptions& options = {});
// Reads and validates `path`: header length within the file (and at most 100 MiB),
// JSON valid without duplicate keys, dtypes known, every offset range in bounds,
// of size numel x itemsize, the ranges neither overlapping nor leaving holes.
// Memory use is bounded by the file's size. Throws FormatError or IoError.
COHORT_API SafetensorsFile read_safetensors(const std::string& path, Filesystem* fs = nullptr);

// ---- checkpoints ----------------------------------------------------------

// The training state stored beside the tensors (manifest.json).
struct COHORT_API Manifest {
  int64_t epoch = 0;
  // Where the DistributedSampler resumes inside `epoch` (samples already consumed).
  int64_t sampler_position = 0;
  int world_size = 1;
  // Opaque generator states by name ("torch_cpu", "cuda:0", ...): any bytes, stored as base64.
  std::map<std::string, std::string> rng_states;
  // The learning-rate schedule's state: any JSON value, as text.
  std::string lr_schedule = "{}";
  // The run's configuration: a JSON object, as text.
  std::string config = "{}";
};

struct COHORT_API SaveOptions {
  // After a successful save, keep only this many checkpoints with a step at or
  // below the new one (the new one included) and delete the older ones.
  // 0 keeps everything. Checkpoints with a higher step than the new one are left alone.
  int keep_last = 0;
  // Which checkpoints keep_last counts and deletes: those whose manifest this
  // returns true for (say, those whose config names this run), so that a run
  // saving beside another run's checkpoints neither deletes them nor lets them
  // take its own places. Unset: every checkpoint in the directory. When set,
  // the others, and those whose manifest cannot be read, are left alone (an
  // accepted one whose files are damaged is not counted, and is deleted once
  // older than the oldest kept, as without a predicate).
  std::function<bool(const Manifest&)> keep_last_among;
  Filesystem* fs = nullptr;  // nullptr: posix_filesystem()
};

struct COHORT_API LoadOptions {
  bool verify_checksums = true;  // false skips the CRC32C pass (sizes are still checked)
  Filesystem* fs = nullptr;      // nullptr: posix_filesystem()
  // Files (names without ".safetensors") a checkpoint must have: one without
  // them is a FormatError, so load_latest_valid falls back past it.
  std::vector<std::string> required_files;
  // Read only these files (names without ".safetensors"; a sharded
  // checkpoint's rank reads its own): the others are checked to exist with
  // the size the manifest lists, not read or checksummed. Empty: every file.
  // A name the manifest does not list is a FormatError.
  std::vector<std::string> only_files;
};

struct COHORT_API FileInfo {
  uint64_t size = 0;
  uint32_t crc32c = 0;
};

struct COHORT_API LoadedCheckpoint {
  std::string path;  // the step directory
  int64_t step = 0;
  int format_version = 0;
  Manifest manifest;
  // By file name without ".safetensors" ("model", "optimizer", ...), tensors in file order.
  std::map<std::string, std::vector<NamedTensor>> files;
  std::map<std::string, FileInfo> file_info;  // by file name without ".safetensors"
  // load_latest_valid: the newer checkpoints it skipped, each "step_X: why".
  std::vector<std::string> skipped;
};

// Writes dir/step_<step, 9 digits>/ holding <name>.safetensors for each entry of
// `files` and manifest.json, and returns that directory's path. Creates `dir` if
// needed. Atomic: everything goes into step_X.tmp-<pid>/, each file fsync'ed,
// manifest.json last, the directory fsync'ed, then renamed into place and the
// parent fsync'ed. Holds `dir`'s writer lock meanwhile (IoError if another
// process is saving there); leftover *.tmp-* directories from crashed saves
// are removed first. An existing checkpoint of
// the same step is replaced. File names: letters, digits, '_', '-', '.'; not "manifest".
// Throws InvalidArgument (bad names, tensors, manifest JSON) before writing
// anything, IoError if the OS refuses (the temporary directory is then removed).
COHORT_API std::string save_checkpoint(const std::string& dir, int64_t step,
                            const std::map<std::string, std::vector<NamedTensor>>& files,
                            const Manifest& manifest, const SaveOptions& options = {});

// The same checkpoint written by every rank of `group` (a collective; a host
// group: native or mpi): each rank passes its own files, whose names must
// differ from every other rank's (e.g. "optimizer.rank3"), and rank 0 the
// manifest (the others' is ignored). Rank 0 takes `dir`'s writer lock and
// creates the temporary directory; every rank writes its files into it, so
// `dir` must be a file system every rank sees (one host, or a shared mount);
// rank 0 writes the manifest listing every rank's files with their sizes and
// CRC32C, and commits as save_checkpoint does. Returns the step directory on
// every rank. The guarantees of save_checkpoint hold for the whole: bad input
// on any rank (or a name two ranks pass) throws InvalidArgument on every rank
// before anything is written; a rank that fails or dies before the commit
// leaves the previous checkpoints untouched, and the others throw (IoError
// naming the rank, or the group's PeerError/TimeoutError). Load it with
// load_checkpoint (LoadOptions::only_files for one rank's part). The ranks
// agree over host memory: on nccl through group.host_group().
COHORT_API std::string save_checkpoint_sharded(ProcessGroup& group, const std::string& dir, int64_t step,
                                               const std::map<std::string, std::vector<NamedTensor>>& files,
                                               const Manifest& manifest, const SaveOptions& options = {});

// Loads one checkpoint directory, verifying every file's size and CRC32C against
// the manifest. Throws FormatError naming the file and what is wrong, IoError.
COHORT_API LoadedCheckpoint load_checkpoint(const std::string& path, const LoadOptions& options = {});

// The newest step_* directory of `dir` that loads and verifies. Newer ones that
// fail are skipped, listed in `skipped` and logged (COHORT_WARN, INIT). No valid
// checkpoint, or no `dir` at all: std::nullopt. Never throws for a broken
// checkpoint; may throw IoError if `dir` itself cannot be listed.
COHORT_API std::optional<LoadedCheckpoint> load_latest_valid(const std::string& dir, const LoadOptions& options = {});

// load_latest_valid for the ranks of a job that resume together, without
// any rank reading the whole checkpoint: a collective over `group` (on nccl
// through its host_group(); `dir` visible to every rank). It takes the newest step_* directory
// of `dir`, as rank 0 lists it, whose manifest reads (with
// LoadOptions::required_files), and whose files all exist with their sizes
// and CRC32C; each rank checks its share only (the manifest's k-th file on
// rank k mod size, its checksum streamed through a 4 MiB buffer), so a
// sharded checkpoint is verified in parallel and no rank holds more than a
// few MiB of it. `refuse`, if given, sees each checkpoint that verified on
// this rank and may skip it with a reason (written by another run, say); it
// must answer alike on every rank (they see the same manifest), and it must
// not throw. Every rank returns the same: the checkpoint with path, step,
// manifest and file_info, `files` left empty (each rank then reads its part
// with load_checkpoint(path, {.only_files = ...})), and `skipped` naming the
// newer ones passed over ("step_X: why"); or std::nullopt. Never throws for a
// broken checkpoint; IoError on every rank if rank 0 cannot list `dir`.
COHORT_API std::optional<LoadedCheckpoint> find_latest_valid(
    ProcessGroup& group, const std::string& dir,
    const std::function<std::string(const LoadedCheckpoint&)>& refuse = {}, const LoadOptions& options = {});

// The steps of the step_* directories in `dir`, ascending (valid or not; *.tmp-* excluded).
COHORT_API std::vector<int64_t> list_checkpoint_steps(const std::string& dir, Filesystem* fs = nullptr);

// CRC32C (Castagnoli, reflected polynomial 0x82F63B78, init and final xor
// 0xFFFFFFFF): the checksum in manifests. Pass the previous result as `crc` to
// continue over more bytes. crc32c("123456789") == 0xE3069283.
COHORT_API uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

}  // namespace cohort
