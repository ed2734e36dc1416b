// The emulated runtime's CUDA IPC (tensor/emulated_cuda.h): a pool exported as a memfd
// and imported by another runtime (another process in one test, a second runtime of
// this process in the rest: the memfd is mapped twice either way), pointers opened at
// their exported offsets, inter-process events that order a stream after another
// runtime's, and the errors of a runtime that cannot import or of bad export data.
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "tensor/emulated_cuda.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

constexpr size_t kBytes = 64 << 10;

EmulatedCudaOptions options(std::chrono::microseconds delay = std::chrono::microseconds(0)) {
  EmulatedCudaOptions o;
  o.copy_delay = delay;
  o.abort_on_misuse = false;
  o.poison = true;
  o.pool_capacity = uint64_t{1} << 30;
  return o;
}

// A pool allocation of kBytes on cuda:0 filled with `value`, ready when this returns.
void* filled(EmulatedCudaRuntime& cuda, unsigned char value) {
  CudaStream s{0, nullptr};
  void* p = *cuda.allocate_async(0, kBytes, s);
  std::vector<unsigned char> host(kBytes, value);
  EXPECT_OK(cuda.copy_async(p, Device::cuda(0), host.data(), Device::cpu(), kBytes, s));
  EXPECT_OK(cuda.synchronize(s));
  return p;
}

std::vector<unsigned char> read_back(EmulatedCudaRuntime& cuda, const void* p, CudaStream s) {
  std::vector<unsigned char> out(kBytes, 0);
  EXPECT_OK(cuda.copy_async(out.data(), Device::cpu(), p, Device::cuda(0), kBytes, s));
  EXPECT_OK(cuda.synchronize(s));
  return out;
}

TEST(EmulatedIpc, AnImportedPointerIsTheExportersMemory) {
  EmulatedCudaRuntime exporter(1, options()), importer(1, options());
  void* p = filled(exporter, 7);
  int fd = *exporter.export_pool(0);
  CudaImportedPool pool = *importer.import_pool(fd);
  close(fd);
  void* q = *importer.import_pointer(pool, *exporter.export_pointer(p));
  EXPECT_NE(p, q);  // another mapping of the same bytes
  CudaStream s = *importer.create_stream(0);
  // The same allocation imported twice (two tensors in flight): each import is released.
  EXPECT_EQ(*importer.import_pointer(pool, *exporter.export_pointer(p)), q);
  ASSERT_OK(importer.release_imported_pointer(q, s));
  EXPECT_EQ(read_back(importer, q, s), std::vector<unsigned char>(kBytes, 7));
  // Writes through the import are the exporter's bytes too.
  std::vector<unsigned char> nines(kBytes, 9);
  ASSERT_OK(importer.copy_async(q, Device::cuda(0), nines.data(), Device::cpu(), kBytes, s));
  ASSERT_OK(importer.release_imported_pointer(q, s));
  ASSERT_OK(importer.synchronize(s));
  importer.release_imported_pool(pool);
  EXPECT_EQ(read_back(exporter, p, CudaStream{0, nullptr}), nines);
  exporter.deallocate_async(0, p, CudaStream{0, nullptr});
  ASSERT_OK(exporter.synchronize(CudaStream{0, nullptr}));
  importer.destroy_stream(s);
  EXPECT_EQ(exporter.pool_stats(0).exports, 1u);
  EXPECT_EQ(exporter.pool_stats(0).used_bytes, 0u);
  EXPECT_TRUE(exporter.misuses().empty());
  EXPECT_TRUE(importer.misuses().empty());
}

TEST(EmulatedIpc, UsedBytesFollowAllocationsAndFrees) {
  EmulatedCudaRuntime cuda(1, options());
  CudaStream s{0, nullptr};
  void* a = *cuda.allocate_async(0, 1000, s);
  void* b = *cuda.allocate_async(0, kBytes, s);
  EXPECT_EQ(cuda.pool_stats(0).used_bytes, 1024u + kBytes);
  cuda.deallocate_async(0, a, s);
  ASSERT_OK(cuda.synchronize(s));
  EXPECT_EQ(cuda.pool_stats(0).used_bytes, kBytes);
  cuda.deallocate_async(0, b, s);
  ASSERT_OK(cuda.synchronize(s));
  EXPECT_EQ(cuda.pool_stats(0).used_bytes, 0u);
}

// The exporter writes y three times on a delayed stream (the last write is x's bytes)
// and records an inter-process event; the importer copies y out on its own stream,
// after waiting on that event or not.
std::vector<unsigned char> copy_after_remote_writes(bool wait) {
  EmulatedCudaRuntime exporter(1, options(std::chrono::milliseconds(3))), importer(1, options());
  std::vector<CudaEvent> events = *exporter.create_ipc_events(0, 4);
  CudaIpcEvents shared = *exporter.export_ipc_events(events);
  std::vector<CudaEvent> opened = *importer.import_ipc_events(0, shared.fd, shared.handles);
  close(shared.fd);
  EXPECT_EQ(opened.size(), 4u);
  int fd = *exporter.export_pool(0);
  CudaImportedPool pool = *importer.import_pool(fd);
  close(fd);

  CudaStream one = *exporter.create_stream(0), two = *importer.create_stream(0);
  void* y = *exporter.allocate_async(0, kBytes, one);
  std::vector<unsigned char> garbage(kBytes, 1), x(kBytes, 5);
  for (const std::vector<unsigned char>* src : {&garbage, &garbage, &x}) {
    EXPECT_OK(exporter.copy_async(y, Device::cuda(0), src->data(), Device::cpu(), kBytes, one));
  }
  EXPECT_OK(exporter.record(events[2], one));
  void* q = *importer.import_pointer(pool, *exporter.export_pointer(y));
  if (wait) {
    EXPECT_OK(importer.wait(two, opened[2]));
  }
  std::vector<unsigned char> out = read_back(importer, q, two);
  EXPECT_OK(importer.release_imported_pointer(q, two));
  EXPECT_OK(exporter.synchronize(one));
  EXPECT_TRUE(*importer.query(opened[2]));
  for (CudaEvent e : opened) importer.destroy_event(e);
  for (CudaEvent e : events) exporter.destroy_event(e);
  EXPECT_OK(importer.synchronize(two));
  importer.release_imported_pool(pool);
  exporter.deallocate_async(0, y, one);
  EXPECT_OK(exporter.synchronize(one));
  exporter.destroy_stream(one);
  importer.destroy_stream(two);
  return out;
}

TEST(EmulatedIpc, AnInterProcessEventOrdersTheImportersStream) {
  EXPECT_EQ(copy_after_remote_writes(/*wait=*/true), std::vector<unsigned char>(kBytes, 5));
  // The check has teeth: without the wait the copy runs before the exporter's writes.
  EXPECT_NE(copy_after_remote_writes(/*wait=*/false), std::vector<unsigned char>(kBytes, 5));
}

// Sends `fd` with `data` over the Unix socket `sock` (SCM_RIGHTS).
void send_fd(int sock, int fd, const void* data, size_t size) {
  msghdr msg = {};
  iovec iov{const_cast<void*>(data), size};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  ASSERT_EQ(sendmsg(sock, &msg, 0), static_cast<ssize_t>(size));
}

int receive_fd(int sock, void* data, size_t size) {
  msghdr msg = {};
  iovec iov{data, size};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  if (recvmsg(sock, &msg, 0) != static_cast<ssize_t>(size)) return -1;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  if (c == nullptr || c->cmsg_type != SCM_RIGHTS) return -1;
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
  return fd;
}

// Another process imports the pool through a descriptor passed with SCM_RIGHTS,
// waits on the parent's inter-process event, checks the bytes and overwrites them.
TEST(EmulatedIpc, AnotherProcessImportsThePoolAndWaitsOnTheEvent) {
  int socks[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, socks), 0);
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(socks[0]);
    int code = 0;
    {
      EmulatedCudaRuntime cuda(1, options());
      CudaPointerExport x;
      char handles[256];
      int pool_fd = receive_fd(socks[1], &x, sizeof(x));
      ssize_t n = 0;
      int events_fd = -1;
      {
        msghdr msg = {};
        iovec iov{handles, sizeof(handles)};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
        msg.msg_control = control;
        msg.msg_controllen = sizeof(control);
        n = recvmsg(socks[1], &msg, 0);
        cmsghdr* c = CMSG_FIRSTHDR(&msg);
        if (c != nullptr) std::memcpy(&events_fd, CMSG_DATA(c), sizeof(int));
      }
      absl::StatusOr<CudaImportedPool> pool = cuda.import_pool(pool_fd);
      absl::StatusOr<std::vector<CudaEvent>> events =
          cuda.import_ipc_events(0, events_fd, std::string_view(handles, n > 0 ? static_cast<size_t>(n) : 0));
      absl::StatusOr<void*> q = pool.ok() ? cuda.import_pointer(*pool, x) : pool.status();
      CudaStream s = *cuda.create_stream(0);
      if (!q.ok() || !events.ok() || !cuda.wait(s, (*events)[0]).ok()) {
        code = 2;
      } else {
        std::vector<unsigned char> seen = read_back(cuda, *q, s);
        if (seen != std::vector<unsigned char>(kBytes, 5)) code = 3;
        std::vector<unsigned char> sixes(kBytes, 6);
        (void)cuda.copy_async(*q, Device::cuda(0), sixes.data(), Device::cpu(), kBytes, s);
        (void)cuda.release_imported_pointer(*q, s);
        (void)cuda.synchronize(s);
      }
      cuda.destroy_stream(s);
    }
    char done = static_cast<char>(code);
    (void)!write(socks[1], &done, 1);
    _exit(code);
  }
  close(socks[1]);
  int code = -1;
  {
    EmulatedCudaRuntime cuda(1, options(std::chrono::milliseconds(5)));
    std::vector<CudaEvent> events = *cuda.create_ipc_events(0, 1);
    CudaIpcEvents shared = *cuda.export_ipc_events(events);
    CudaStream s = *cuda.create_stream(0);
    void* p = *cuda.allocate_async(0, kBytes, s);
    std::vector<unsigned char> garbage(kBytes, 1), x(kBytes, 5);
    for (const std::vector<unsigned char>* src : {&garbage, &garbage, &x}) {
      ASSERT_OK(cuda.copy_async(p, Device::cuda(0), src->data(), Device::cpu(), kBytes, s));
    }
    ASSERT_OK(cuda.record(events[0], s));
    int pool_fd = *cuda.export_pool(0);
    CudaPointerExport data = *cuda.export_pointer(p);
    send_fd(socks[0], pool_fd, &data, sizeof(data));
    send_fd(socks[0], shared.fd, shared.handles.data(), shared.handles.size());
    close(pool_fd);
    close(shared.fd);
    char done = 0;
    ASSERT_EQ(read(socks[0], &done, 1), 1);
    code = done;
    EXPECT_EQ(read_back(cuda, p, s), std::vector<unsigned char>(kBytes, 6));
    cuda.deallocate_async(0, p, s);
    ASSERT_OK(cuda.synchronize(s));
    cuda.destroy_event(events[0]);
    cuda.destroy_stream(s);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the importing process failed with code " << code;
  close(socks[0]);
}

TEST(EmulatedIpc, BadImportsAreRefusedSayingWhy) {
  EmulatedCudaRuntime exporter(1, options()), importer(1, options());
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  EXPECT_THAT(importer.import_pool(pipe_fds[0]).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not an emulated CUDA export")));
  close(pipe_fds[0]);
  close(pipe_fds[1]);

  // Pointer data of one pool does not open in another.
  EmulatedCudaRuntime other(1, options());
  void* p = filled(other, 1);
  int fd = *exporter.export_pool(0);
  CudaImportedPool pool = *importer.import_pool(fd);
  close(fd);
  EXPECT_THAT(importer.import_pointer(pool, *other.export_pointer(p)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("another pool")));
  EXPECT_THAT(other.export_pointer(static_cast<char*>(p) + 256).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not the start of a live pool allocation")));
  importer.release_imported_pool(pool);

  // A runtime without IPC says so, naming the switch.
  EmulatedCudaOptions no_ipc = options();
  no_ipc.ipc = false;
  EmulatedCudaRuntime closed(1, no_ipc);
  fd = *exporter.export_pool(0);
  EXPECT_THAT(closed.import_pool(fd).status(),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("FERRY_EMULATE_CUDA_IPC=0")));
  close(fd);
  EXPECT_THAT(closed.export_pool(0).status(), StatusIs(absl::StatusCode::kUnimplemented));
  EXPECT_THAT(importer.import_ipc_events(0, -1, "xyz").status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace ferry
