// safetensors files through the Filesystem seam: streaming writer and reader
// (computing size and CRC32C on the way), in-memory encode/decode over the same
// code, and the public write_safetensors / read_safetensors.
#include <unistd.h>

#include <cstring>

#include <fmt/format.h>

#include "checkpoint/safetensors.hpp"
#include "cohort/checkpoint.hpp"
#include "cohort/error.hpp"

namespace cohort::ckpt {
namespace {

// WritableFile / ReadableFile over memory, so encode/decode share the streaming code.
class VectorWriter final : public WritableFile {
 public:
  explicit VectorWriter(std::vector<uint8_t>* out) : out_(out) {}
  void append(const void* data, size_t n) override {
    const auto* p = static_cast<const uint8_t*>(data);
    out_->insert(out_->end(), p, p + n);
  }
  void sync() override {}
  void close() override {}

 private:
  std::vector<uint8_t>* out_;
};

class SpanReader final : public ReadableFile {
 public:
  explicit SpanReader(std::span<const uint8_t> data) : data_(data) {}
  uint64_t size() override { return data_.size(); }
  void read_at(uint64_t offset, void* out, size_t n) override {
    if (offset > data_.size() || n > data_.size() - offset)
      throw IoError(fmt::format("read past the end of a {}-byte buffer", data_.size()));
    if (n > 0) std::memcpy(out, data_.data() + offset, n);
  }

 private:
  std::span<const uint8_t> data_;
};

std::string parent_dir(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

StreamStats write_body(WritableFile& out, const EncodedHeader& header, const std::vector<NamedTensor>& tensors) {
  StreamStats s;
  out.append(header.bytes.data(), header.bytes.size());
  s.crc32c = crc32c(header.bytes.data(), header.bytes.size());
  s.size = header.bytes.size();
  for (size_t i : header.order) {
    const std::vector<uint8_t>& b = tensors[i].bytes;
    if (b.empty()) continue;
    out.append(b.data(), b.size());
    s.crc32c = crc32c(b.data(), b.size(), s.crc32c);
    s.size += b.size();
  }
  return s;
}

ReadResult read_body(ReadableFile& in, const std::string& name, bool compute_crc) {
  ReadResult r;
  uint64_t file_size = in.size();
  uint8_t prefix[8] = {};
  if (file_size >= 8) in.read_at(0, prefix, 8);
  uint64_t n = parse_header_length(prefix, file_size, name);  // bounds n before we allocate it
  std::string text(n, '\0');
  in.read_at(8, text.data(), n);
  uint64_t data_start = 8 + n;
  ParsedHeader header = parse_header(text, file_size - data_start, name);
  if (compute_crc) r.stats.crc32c = crc32c(text.data(), n, crc32c(prefix, 8));
  r.file.metadata = std::move(header.metadata);
  r.file.tensors.reserve(header.entries.size());
  // Entries tile the data exactly (parse_header checked), so reading them in
  // order covers every byte of the file once and the CRC is the whole file's.
  for (TensorEntry& e : header.entries) {
    NamedTensor t{std::move(e.name), e.dtype, std::move(e.shape), {}};
    t.bytes.resize(e.end - e.begin);
    if (!t.bytes.empty()) in.read_at(data_start + e.begin, t.bytes.data(), t.bytes.size());
    if (compute_crc) r.stats.crc32c = crc32c(t.bytes.data(), t.bytes.size(), r.stats.crc32c);
    r.file.tensors.push_back(std::move(t));
  }
  r.stats.size = file_size;
  return r;
}

}  // namespace cohort::ckpt

namespace cohort {

uint64_t NamedTensor::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(d), &n))
      throw InvalidArgument(fmt::format("tensor \"{}\": shape [{}] has a negative dimension or overflows 64 bits", name,
                                        fmt::join(shape, ", ")));
  }
  return n;
}

std::vector<uint8_t> encode_safetensors(const std::vector<NamedTensor>& tensors,
                                        const std::map<std::string, std::string>& metadata) {
  ckpt::EncodedHeader header = ckpt::encode_header(tensors, metadata);
  std::vector<uint8_t> out;
  out.reserve(header.bytes.size() + header.data_bytes);
  ckpt::VectorWriter w(&out);
  ckpt::write_body(w, header, tensors);
  return out;
}

SafetensorsFile decode_safetensors(std::span<const uint8_t> file, const std::string& name) {
  ckpt::SpanReader r(file);
  return ckpt::read_body(r, name, /*compute_crc=*/false).file;
}

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const SafetensorsWriteOptions& options) {
  Filesystem& fs = options.fs ? *options.fs : posix_filesystem();
  ckpt::EncodedHeader header = ckpt::encode_header(tensors, options.metadata);  // validates before any write
  std::string tmp = fmt::format("{}.tmp-{}", path, ::getpid());
  try {
    auto f = fs.create_file(tmp);
    ckpt::write_body(*f, header, tensors);
    f->sync();
    f->close();
    fs.rename(tmp, path);
    fs.sync_dir(ckpt::parent_dir(path));
  } catch (...) {
    try {
      if (fs.exists(tmp)) fs.remove_file(tmp);
    } catch (...) {
      // Best effort: the original error is the one to report.
    }
    throw;
  }
}

SafetensorsFile read_safetensors(const std::string& path, Filesystem* fs) {
  auto f = (fs ? *fs : posix_filesystem()).open_file(path);
  return ckpt::read_body(*f, path, /*compute_crc=*/false).file;
}

}  // namespace cohort
