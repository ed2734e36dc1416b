// File: rendezvous/builtin.h (not installed)
//
// The built-in rendezvous handlers, listed in builtin.cc. Each registry adds its
// built-ins when it is first used, so no registry includes their implementations.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "rendezvous/elastic.h"
#include "rendezvous/rendezvous.h"

namespace ferry::internal {

// file://, tcp:// and env:// (for rendezvous()).
std::vector<std::pair<std::string, UrlRendezvousHandler>> builtin_url_handlers();

// The store-based dynamic backend, "store" (for rendezvous_handler_registry()).
std::vector<std::pair<std::string, RendezvousHandlerCreator>> builtin_elastic_handlers();

}  // namespace ferry::internal
