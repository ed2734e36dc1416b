// File: store/file_store.h
//
// FileStore: a Store kept in one file that every process of a job on one host (or on a
// shared file system with working flock) opens. Operations are records appended to the
// file under flock(2); each process replays the records it has not seen yet, so
// concurrent processes never lose an update.
//
// Crash safety: every record carries a checksum, and a record that is cut short,
// zero-filled (a file extended by a crash before its data reached the disk) or
// otherwise fails its checksum ends the log: readers stop before it and the next
// writer cuts it away. A multi_set is one record, so it lands whole or not at all.
// With `fsync`, each write reaches the disk before the call returns.
//
// Runs: the file's header names the run that wrote it. A store given a run_id that
// differs from the file's, or (with world_size) opening a file that world_size stores
// of one run have joined already, starts a fresh file in its place (atomically, by
// rename): a path reused after a crash, or by the next run while the last one's
// stragglers are still closing, never mixes the runs' keys or counts the last run's
// closes.
//
// Privacy: the file is created 0600 and opened without following a symbolic link; a
// file owned by another user, or writable by its group or by everyone, is refused
// (kPermissionDenied): whoever can write it can forge every key of the job.
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
  // Names this run (at most 255 bytes): a file written by a run of another name is
  // replaced. Unset: the file's run is joined, or a fresh file gets a random name.
  std::optional<std::string> run_id = std::nullopt;
  // fdatasync(2) every write before the call returns (slower; survives power loss).
  bool fsync = false;
  // The number of FileStore objects of one run (usually one per rank). When set, the
  // file is removed once that many have been destroyed, and a file that many have
  // joined already belongs to an earlier run (see above).
  std::optional<int> world_size = std::nullopt;
};

// Thread-safe: every method may be called from any thread at once, and any number of
// processes may open the same path. Owns its file descriptor. Blocking calls poll the
// file with back-off (1 ms doubling to 50 ms), so a wait costs no thread but up to
// 50 ms of latency. The file lock is taken without blocking, with the same back-off,
// until the operation's timeout (the store's timeout() for non-waiting operations):
// a process that hangs holding it fails the others with kDeadlineExceeded, never
// blocks them. The log is never compacted: meant for rendezvous-sized traffic.
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
  // The run this store's file belongs to (FileStoreOptions::run_id, or the name a
  // fresh file was given).
  const std::string& run_id() const { return run_id_; }

 private:
  class FileLock;
  enum class Op : uint8_t;

  FileStore(std::string path, FileStoreOptions options);

  // Opens the path, joining its run or starting a fresh file, and records the join.
  absl::Status open_file();
  // kPermissionDenied unless `fd` is a regular file of this user that nobody else may
  // write.
  absl::Status check_private(int fd) const;
  // Replaces the file at path_ (locked through fd_) by a fresh one for this run; fd_
  // then names the new file, locked.
  absl::Status start_fresh_file(FileLock& lock) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the file lock, polling until `timeout` passes.
  absl::Status lock(FileLock& lock, bool exclusive, std::chrono::milliseconds timeout);
  // Reads and applies the records appended since the last refresh. Needs the file lock.
  absl::Status refresh() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Appends one record and applies it. Needs the exclusive file lock and a fresh view.
  absl::Status append(Op op, std::string_view key, const Bytes& value) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status write_at(const Bytes& data, uint64_t offset);
  // Polls until every key exists, then returns their values.
  absl::StatusOr<std::vector<Bytes>> await_keys(std::string_view op, const std::vector<std::string>& keys,
                                                std::chrono::milliseconds timeout);
  absl::Status io_error(std::string_view what, int err) const;

  const std::string path_;
  const FileStoreOptions options_;
  int fd_ = -1;  // set by open_file(), then fixed
  std::string run_id_;

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Bytes> map_ ABSL_GUARDED_BY(mu_);
  // Bytes of the file already replayed into map_.
  uint64_t offset_ ABSL_GUARDED_BY(mu_) = 0;
  // How many FileStore objects have joined and closed the file (see
  // FileStoreOptions::world_size).
  int64_t joined_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t closed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ferry
