// File: store/store_host.h
//
// Where a store lives, for code that picks its own listen address next to it (the
// resolver in base/net.h prefers the interface that reaches the store's host).
// Internal (ferry::internal).
#pragma once

#include <string>

#include "store/store.h"
#include "store/tcp_store.h"

namespace ferry::internal {

// The TCPStore under `store` (through PrefixStores), or null for other stores. Points
// into `store`, which must outlive it.
const TCPStore* tcp_store_of(const Store& store);

// The store's host as the other ranks reach it (the host of a TCPStore, also under
// PrefixStores); empty for other stores.
std::string store_host_of(const Store& store);

}  // namespace ferry::internal
