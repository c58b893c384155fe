// libFuzzer target: the TCP transport's handshake (tcp_hello.hpp) as an
// acceptor and a connector see it from an untrusted peer. A forged Hello must
// never pass: only one made with the secret and this nonce may.
#include <cstddef>
#include <cstdint>

#include "transport/tcp/tcp_hello.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace th = cohort::transport::tcp_hello;
  th::Nonce nonce{};
  for (size_t i = 0; i < nonce.size(); ++i) nonce[i] = static_cast<uint8_t>(i * 7 + 1);
  th::HelloFields f;
  th::Verdict v = th::check_hello(data, size, "fuzz-secret", nonce, &f);
  if (v == th::Verdict::Ok) {
    // Accepted: it must be exactly the Hello the secret produces for those fields.
    auto want = th::encode_hello("fuzz-secret", nonce, f);
    if (size != want.size()) __builtin_trap();
    for (size_t i = 0; i < size; ++i)
      if (data[i] != want[i]) __builtin_trap();
  }
  th::Nonce got{};
  th::check_challenge(data, size, &got);
  return 0;
}
