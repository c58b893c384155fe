#include "data/file_bytes.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "core/fd.hpp"

namespace cohort::data {
namespace {

constexpr size_t kMaxZlibChunk = size_t{1} << 30;  // zlib counts in 32-bit uInt

class Inflater {
 public:
  Inflater() = default;
  ~Inflater() {
    if (live_) inflateEnd(&stream_);
  }
  z_stream* init(const std::string& name) {
    // 16 + MAX_WBITS: a gzip wrapper (header and CRC-32 trailer), nothing else.
    int rc = inflateInit2(&stream_, 16 + MAX_WBITS);
    if (rc != Z_OK) throw IoError(fmt::format("{}: cannot start gunzip (zlib error {})", name, rc));
    live_ = true;
    return &stream_;
  }

 private:
  z_stream stream_{};
  bool live_ = false;
};

bool all_zero(std::span<const uint8_t> bytes) {
  return std::all_of(bytes.begin(), bytes.end(), [](uint8_t b) { return b == 0; });
}

}  // namespace

std::vector<uint8_t> read_file_bytes(const std::string& path) {
  core::Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw IoError(fmt::format("cannot open {}: {}", path, std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw IoError(fmt::format("cannot stat {}: {}", path, std::strerror(errno)));
  if (S_ISDIR(st.st_mode)) throw IoError(fmt::format("cannot read {}: it is a directory, not a file", path));

  // Sized from fstat; a file that is longer by now (or not a regular file) is
  // found by a small probe read once the buffer is full, and only then grows.
  std::vector<uint8_t> bytes(static_cast<size_t>(std::max<off_t>(st.st_size, 0)));
  size_t got = 0;
  uint8_t probe[4096];
  for (;;) {
    const bool full = got == bytes.size();
    uint8_t* dst = full ? probe : bytes.data() + got;
    ssize_t n = ::read(fd.get(), dst, full ? sizeof probe : bytes.size() - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw IoError(fmt::format("cannot read {} (after {} bytes): {}", path, got, std::strerror(errno)));
    }
    if (n == 0) break;
    if (full) bytes.insert(bytes.end(), probe, probe + n);
    got += static_cast<size_t>(n);
  }
  bytes.resize(got);
  return bytes;
}

std::vector<uint8_t> gunzip(std::span<const uint8_t> in, const std::string& name, size_t limit, bool* cut) {
  if (cut != nullptr) *cut = false;
  Inflater inflater;
  z_stream* s = inflater.init(name);

  // A gzip member ends with its size mod 2^32 (little-endian): the exact size
  // for the usual single member, a first guess otherwise (the buffer doubles).
  // One byte more, so that inflate can report the end without asking for room.
  size_t guess = in.size() * 4;
  if (in.size() >= 18) {
    const uint8_t* t = in.data() + in.size() - 4;
    guess = (uint32_t{t[0]} | uint32_t{t[1]} << 8 | uint32_t{t[2]} << 16 | uint32_t{t[3]} << 24) + size_t{1};
    guess = std::min(guess, in.size() * 1032);  // deflate's best ratio: a damaged trailer cannot ask for 4 GiB
  }
  std::vector<uint8_t> out(std::min(std::max<size_t>(guess, 4096), limit));
  size_t in_pos = 0, produced = 0;

  for (;;) {
    if (s->avail_in == 0) {
      size_t chunk = std::min(in.size() - in_pos, kMaxZlibChunk);
      s->next_in = const_cast<Bytef*>(in.data() + in_pos);  // zlib's API is not const-correct; it never writes input
      s->avail_in = static_cast<uInt>(chunk);
      in_pos += chunk;
    }
    if (produced == limit) {  // the caller asked for no more
      if (cut != nullptr) *cut = true;
      break;
    }
    if (produced == out.size()) out.resize(std::min(out.size() * 2, limit));
    s->next_out = out.data() + produced;
    s->avail_out = static_cast<uInt>(std::min(out.size() - produced, kMaxZlibChunk));
    const uInt room = s->avail_out;
    const int rc = inflate(s, Z_NO_FLUSH);
    produced += room - s->avail_out;

    if (rc == Z_OK) continue;
    if (rc == Z_STREAM_END) {
      const size_t consumed = in_pos - s->avail_in;
      std::span<const uint8_t> rest = in.subspan(consumed);
      if (all_zero(rest)) break;
      if (!is_gzip(rest))
        throw IoError(fmt::format(
            "{}: {} bytes that are not gzip data follow the gzip stream (at byte {}); the file is damaged: "
            "download or reinstall it",
            name, rest.size(), consumed));
      inflateReset(s);  // another member, as `cat a.gz b.gz` makes; keep the unread input
      continue;
    }
    if (rc == Z_BUF_ERROR) {  // no progress: output full (grow), input empty (refill), or no input left
      if (s->avail_out == 0 || (s->avail_in == 0 && in_pos < in.size())) continue;
      throw IoError(fmt::format(
          "{}: the gzip stream ends early, after {} compressed and {} decompressed bytes (the file is truncated or "
          "damaged); download or reinstall it",
          name, in.size(), produced));
    }
    if (rc == Z_DATA_ERROR || rc == Z_NEED_DICT)
      throw IoError(fmt::format("{}: gzip data is corrupt ({}) at about compressed byte {}; the file is damaged: "
                                "download or reinstall it",
                                name, s->msg != nullptr ? s->msg : "bad data", in_pos - s->avail_in));
    throw IoError(fmt::format("{}: gunzip failed (zlib error {}{}{})", name, rc, s->msg ? ": " : "", s->msg ? s->msg : ""));
  }
  out.resize(produced);
  return out;
}

}  // namespace cohort::data
