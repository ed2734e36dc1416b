// File: process_group/internal/gloo_errors.h
//
// Gloo reports failures by throwing (IoException, EnforceNotMet, std::exception);
// ferry's errors are values. catch_gloo is where a Gloo exception becomes an
// absl::Status, so that none leaves a process-group call or a worker thread:
//
//   absl::Status s = catch_gloo("all_reduce", "rank 0 of 2", [&] { ...; return absl::OkStatus(); });
//
// Internal: includes Gloo, never installed.
#pragma once

#include <exception>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "gloo/common/error.h"
#include "gloo/common/logging.h"

namespace ferry::internal::pg {

// `text` without the "[file:line] " (and "[enforce fail at file:line] ") prefixes Gloo
// puts on its messages: those belong in logs, not in users' errors.
std::string strip_location(std::string_view text);

// Whether Gloo's message `text` reports a timeout.
bool looks_like_timeout(std::string_view text);

// The status for an exception thrown by Gloo (or the store adapter) during `what`:
// kDeadlineExceeded for a timeout, kUnavailable for another I/O error (a peer lost),
// kInternal otherwise. Logs Gloo's full text.
absl::Status status_from_exception(std::string_view what, std::string_view context, std::string_view raw,
                                   bool io_error);

// Runs `fn`, turning whatever Gloo throws into a status; no exception leaves here.
template <typename Fn>
inline absl::Status catch_gloo(std::string_view what, std::string_view context, Fn&& fn) {
  try {
    return fn();
  } catch (const gloo::IoException& e) {
    return status_from_exception(what, context, e.what(), /*io_error=*/true);
  } catch (const gloo::EnforceNotMet& e) {
    return status_from_exception(what, context, e.what(), /*io_error=*/false);
  } catch (const std::exception& e) {
    return status_from_exception(what, context, e.what(), /*io_error=*/false);
  } catch (...) {
    return absl::InternalError(absl::StrCat(internal::av(what), " (", internal::av(context),
                                            "): unknown exception from Gloo"));
  }
}

}  // namespace ferry::internal::pg
