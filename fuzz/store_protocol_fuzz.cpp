// libFuzzer target: the store's wire format as the server and the client see
// it from an untrusted peer. The first byte picks the decoder; the rest is the
// input. Every decoder must reject or accept without crashing, reading out of
// bounds or allocating more than the input can justify (ASan + UBSan build).
#include <cstddef>
#include <cstdint>

#include "store/tcp_protocol.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cohort::store;
  if (size == 0) return 0;
  const uint8_t which = data[0];
  const uint8_t* p = data + 1;
  const size_t n = size - 1;
  std::string why;
  switch (which % 4) {
    case 0: {
      Request req;
      if (decode_request(p, n, &req, &why)) {
        // What decodes must encode back to a frame whose body decodes to the same request.
        cohort::Bytes frame = encode_request(req);
        Request again;
        if (frame.size() < 4 || !decode_request(frame.data() + 4, frame.size() - 4, &again, &why)) __builtin_trap();
        if (again.op != req.op || again.keys != req.keys || again.value != req.value) __builtin_trap();
      }
      break;
    }
    case 1: {
      Response resp;
      decode_response(static_cast<Op>(1 + (which / 4) % 9), p, n, &resp, &why);
      break;
    }
    case 2: {
      Nonce nonce{};
      for (size_t i = 0; i < nonce.size() && i < n; ++i) nonce[i] = p[i];
      HelloCheck h = check_hello(p, n, "fuzz-secret", nonce);
      if (h.verdict == HelloVerdict::Ok && h.used > n) __builtin_trap();
      break;
    }
    default: {
      Nonce nonce{};
      uint16_t version = 0;
      decode_challenge(p, n, &nonce, &version);
      break;
    }
  }
  return 0;
}
