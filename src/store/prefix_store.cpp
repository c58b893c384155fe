// PrefixStore: every key becomes "prefix/key" on the base store. Blocking and
// errors are the base store's (its TimeoutError names the prefixed keys, which
// is what one finds when looking at the base store from elsewhere).
#include <utility>

#include "cohort/error.hpp"
#include "cohort/store.hpp"

namespace cohort {

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> base)
    : prefix_(std::move(prefix)), base_(std::move(base)) {
  if (!base_) throw InvalidArgument("PrefixStore(\"" + prefix_ + "\", base): base is null; HINT: pass the store to wrap");
  timeout_ = base_->timeout();
}

std::vector<std::string> PrefixStore::k(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& key : keys) out.push_back(k(key));
  return out;
}

void PrefixStore::set(const std::string& key, const Bytes& value) { base_->set(k(key), value); }
Bytes PrefixStore::get(const std::string& key, Millis timeout) { return base_->get(k(key), timeout); }
int64_t PrefixStore::add(const std::string& key, int64_t delta) { return base_->add(k(key), delta); }
Bytes PrefixStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  return base_->compare_set(k(key), expected, desired);
}
void PrefixStore::wait(const std::vector<std::string>& keys, Millis timeout) { base_->wait(k(keys), timeout); }
bool PrefixStore::check(const std::vector<std::string>& keys) { return base_->check(k(keys)); }
bool PrefixStore::delete_key(const std::string& key) { return base_->delete_key(k(key)); }
int64_t PrefixStore::num_keys() { return base_->num_keys(); }

}  // namespace cohort
