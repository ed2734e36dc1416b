#include "store/store_host.h"

#include "store/prefix_store.h"

namespace ferry::internal {

const TCPStore* tcp_store_of(const Store& store) {
  const Store* s = &store;
  while (const auto* prefixed = dynamic_cast<const PrefixStore*>(s)) s = prefixed->base().get();
  return dynamic_cast<const TCPStore*>(s);
}

std::string store_host_of(const Store& store) {
  const TCPStore* tcp = tcp_store_of(store);
  return tcp == nullptr ? "" : tcp->host();
}

}  // namespace ferry::internal
