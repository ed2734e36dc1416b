// File: store/file_store.h
//
// FileStore: a Store kept in one file that every process of a job on one host (or on a
// shared file system with working flock) opens. Operations are records appended to the
// file under flock(2); each process replays the records it has not seen yet, so
// concurrent processes never lose an update.
//
//   FERRY_ASSIGN_OR_RETURN(std::shared_ptr<ferry::Store> store,
//                          ferry::FileStore::create("/tmp/job42.store", {.world_size = 4}));
//   FERRY_ASSIGN_OR_RETURN(int64_t arrived, store->add("arrived", 1));
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "store/store.h"

namespace ferry {

struct FileStoreOptions {
  // Default timeout of blocking operations.
  std::chrono::milliseconds timeout = Store::kDefaultTimeout;
  // When set, the file is removed once this many FileStore objects (usually one per
  // rank) have been destroyed, so a path can be reused by the next job.
  std::optional<int> world_size;
};

// Thread-safe: every method may be called from any thread at once, and any number of
// processes may open the same path. Owns its file descriptor. Blocking calls poll the
// file with back-off (1 ms doubling to 50 ms), so a wait costs no thread but up to
// 50 ms of latency. The log is never compacted: meant for rendezvous-sized traffic.
class FileStore final : public Store {
 public:
  // Opens (creating if needed) the store file at `path`.
  static absl::StatusOr<std::unique_ptr<FileStore>> create(std::string path, FileStoreOptions options = {});
  ~FileStore() override;

  using Store::get;
  using Store::multi_get;
  using Store::wait;

  absl::Status set(std::string_view key, const Bytes& value) override;
  absl::StatusOr<Bytes> get(std::string_view key, std::optional<std::chrono::milliseconds> timeout) override;
  absl::StatusOr<int64_t> add(std::string_view key, int64_t delta) override;
  absl::StatusOr<Bytes> compare_set(std::string_view key, const Bytes& expected, const Bytes& desired) override;
  absl::StatusOr<bool> check(const std::vector<std::string>& keys) override;
  absl::Status wait(const std::vector<std::string>& keys, std::optional<std::chrono::milliseconds> timeout) override;
  absl::StatusOr<bool> delete_key(std::string_view key) override;
  absl::StatusOr<int64_t> num_keys() override;
  absl::StatusOr<std::vector<Bytes>> multi_get(const std::vector<std::string>& keys,
                                               std::optional<std::chrono::milliseconds> timeout) override;
  absl::Status multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) override;

  const std::string& path() const { return path_; }

 private:
  class FileLock;
  enum class Op : uint8_t;

  FileStore(std::string path, int fd, FileStoreOptions options);

  // Writes or checks the file's header.
  absl::Status init_file();
  // Reads and applies the records appended since the last refresh. Needs the file lock.
  absl::Status refresh() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Appends one record and applies it. Needs the exclusive file lock and a fresh view.
  absl::Status append(Op op, std::string_view key, const Bytes& value) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Polls until every key exists, then returns their values.
  absl::StatusOr<std::vector<Bytes>> await_keys(std::string_view op, const std::vector<std::string>& keys,
                                                std::chrono::milliseconds timeout);
  absl::Status io_error(std::string_view what, int err) const;

  const std::string path_;
  const int fd_;
  const FileStoreOptions options_;

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Bytes> map_ ABSL_GUARDED_BY(mu_);
  // Bytes of the file already replayed into map_.
  uint64_t offset_ ABSL_GUARDED_BY(mu_) = 0;
  // How many FileStore objects have closed the file (see FileStoreOptions::world_size).
  int64_t closed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ferry
