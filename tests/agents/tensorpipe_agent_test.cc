// TensorPipeAgent in one process: several agents side by side, and a raw TensorPipe
// client sending what a ferry worker never would.
#include "agents/tensorpipe/factory.h"
#include "agents/tensorpipe/address_hold.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include <tensorpipe/tensorpipe.h>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "serialization/error.h"
#include "store/hash_store.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

// Replies with the request's payload and tensors, from the worker named `name`.
RequestHandler echo_handler(std::string name) {
  return [name](const Message& request, const WorkerInfo& from) {
    Message reply(MessageType::kResponse, request.id());
    reply.buffer() += std::string(request.payload()) + " from " + from.name + " via " + name;
    reply.tensors() = request.tensors();
    return reply;
  };
}

std::vector<std::shared_ptr<Agent>> start_group(int n, TensorPipeAgentOptions options = {}) {
  auto store = std::make_shared<HashStore>(std::chrono::seconds(20));
  std::vector<std::future<absl::StatusOr<std::shared_ptr<Agent>>>> starting;
  for (int r = 0; r < n; ++r) {
    starting.push_back(std::async(std::launch::async, [=] {
      std::string name = "a" + std::to_string(r);
      return TensorPipeAgent::create(store, name, r, n, options, echo_handler(name));
    }));
  }
  std::vector<std::shared_ptr<Agent>> agents;
  for (auto& f : starting) {
    auto agent = f.get();
    EXPECT_TRUE(agent.ok()) << agent.status();
    if (agent.ok()) agents.push_back(*agent);
  }
  return agents;
}

TEST(TensorPipeAgent, SeveralAgentsInOneProcess) {
  auto agents = start_group(3);
  ASSERT_EQ(agents.size(), 3u);
  for (auto& from : agents) {
    for (int to = 0; to < 3; ++to) {
      Message m(MessageType::kRequest, 0);
      m.buffer() += "hi";
      m.tensors().push_back(*Tensor::zeros({100000}, DType::kUInt8));
      absl::StatusOr<Message> reply = from->send(to, std::move(m)).result();
      ASSERT_OK(reply.status());
      EXPECT_EQ(reply->payload(), "hi from " + from->self().name + " via a" + std::to_string(to));
      ASSERT_EQ(reply->tensors().size(), 1u);
      EXPECT_EQ(reply->tensors()[0].nbytes(), 100000u);
    }
  }
  EXPECT_THAT(agents[0]->send(7, Message()).result(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("id 7")));
  EXPECT_THAT(agents[0]->worker_info("zz"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"zz\"")));
  EXPECT_EQ(agents[1]->worker_info("a2")->id, 2);
  EXPECT_EQ(agents[1]->worker_infos().size(), 3u);
  std::vector<std::thread> joiners;
  for (auto& a : agents) joiners.emplace_back([&a] { EXPECT_OK(a->join(std::chrono::seconds(20))); });
  for (auto& t : joiners) t.join();
  for (auto& a : agents) a->shutdown();
  EXPECT_THAT(agents[0]->send(1, Message()).result(), StatusIs(absl::StatusCode::kCancelled));
}

TEST(TensorPipeAgent, RejectsBadOptions) {
  auto store = std::make_shared<HashStore>();
  TensorPipeAgentOptions options;
  options.transports = std::vector<std::string>{"carrier-pigeon"};
  EXPECT_THAT(TensorPipeAgent::create(store, "a0", 0, 1, options, echo_handler("a0")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("unknown transport \"carrier-pigeon\" (expected one of: shm, ibv, uv)")));
  options = {};
  options.channels = std::vector<std::string>{"telepathy"};
  EXPECT_THAT(TensorPipeAgent::create(store, "a0", 0, 1, options, echo_handler("a0")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown channel \"telepathy\"")));
  options = {};
  options.agent.num_worker_threads = 0;
  EXPECT_THAT(TensorPipeAgent::create(store, "a0", 0, 1, options, echo_handler("a0")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_worker_threads must be at least 1, got 0")));
  EXPECT_THAT(TensorPipeAgent::create(store, "a0", 1, 1, {}, echo_handler("a0")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 1 out of range")));
  EXPECT_THAT(TensorPipeAgent::create(store, "", 0, 1, {}, echo_handler("")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
}

TEST(TensorPipeAgent, DuplicateNamesAndMissingPeersAreErrors) {
  auto store = std::make_shared<HashStore>();
  TensorPipeAgentOptions options;
  options.init_timeout = std::chrono::milliseconds(300);
  // Rank 1 never shows up.
  EXPECT_THAT(TensorPipeAgent::create(store, "a0", 0, 2, options, echo_handler("a0")),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("waiting for every worker to publish")));
  auto twin_store = std::make_shared<HashStore>(std::chrono::seconds(20));
  auto first = std::async(std::launch::async,
                          [&] { return TensorPipeAgent::create(twin_store, "same", 0, 2, {}, echo_handler("same")); });
  auto second = TensorPipeAgent::create(twin_store, "same", 1, 2, {}, echo_handler("same"));
  EXPECT_THAT(second, StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("worker name \"same\" is used by both rank 0 and rank 1")));
  EXPECT_THAT(first.get(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("used by both")));
}

// Resolves `closed` with true once the pipe closes, false if a message with tensors
// comes first; metadata-only messages (the agent's refusal) are read past.
void read_until_closed(const std::shared_ptr<tensorpipe::Pipe>& pipe, std::shared_ptr<std::promise<bool>> closed) {
  pipe->readDescriptor([pipe, closed](const tensorpipe::Error& error, tensorpipe::Descriptor descriptor) {
    if (error) {
      closed->set_value(true);
    } else if (!descriptor.tensors.empty()) {
      closed->set_value(false);
    } else {
      pipe->read(tensorpipe::Allocation{}, [pipe, closed](const tensorpipe::Error&) { read_until_closed(pipe, closed); });
    }
  });
}

// A plain TensorPipe client (uv, basic channel) with a pipe to `url`: what any host that
// reaches a worker's port can open, with no token.
struct RawClient {
  std::shared_ptr<tensorpipe::Context> context = std::make_shared<tensorpipe::Context>();
  std::shared_ptr<tensorpipe::Pipe> pipe;

  explicit RawClient(const std::string& url) {
    context->registerTransport(0, "uv", tensorpipe::transport::uv::create());
    context->registerChannel(0, "basic", tensorpipe::channel::basic::create());
    pipe = context->connect(url);
  }
  // Whether the worker closed the pipe without sending tensors first; nullopt when
  // neither happened within 10 s.
  std::optional<bool> closed_by_peer() {
    auto closed = std::make_shared<std::promise<bool>>();
    read_until_closed(pipe, closed);
    auto verdict = closed->get_future();
    if (verdict.wait_for(std::chrono::seconds(10)) != std::future_status::ready) return std::nullopt;
    return verdict.get();
  }
  void close() {
    context->close();
    context->join();
  }
};

TEST(TensorPipeAgent, GarbageFromARawClientClosesOnlyThatPipe) {
  auto agents = start_group(1);
  ASSERT_EQ(agents.size(), 1u);
  RawClient client(TensorPipeAgent::addresses(*agents[0]).at("uv"));
  tensorpipe::Message garbage;
  garbage.metadata = "this is not a ferry message at all";
  client.pipe->write(std::move(garbage), [](const tensorpipe::Error&) {});
  // The agent answers with a refusal, then closes the pipe.
  std::optional<bool> closed = client.closed_by_peer();
  ASSERT_TRUE(closed.has_value());
  EXPECT_TRUE(*closed) << "the agent should close a pipe that sends garbage";

  // The agent still serves everyone else.
  Message m(MessageType::kRequest, 0);
  m.buffer() += "still";
  absl::StatusOr<Message> reply = agents[0]->send(0, std::move(m)).result();
  ASSERT_OK(reply.status());
  EXPECT_EQ(reply->payload(), "still from a0 via a0");
  client.close();
  agents[0]->shutdown();
}

}  // namespace
}  // namespace ferry

namespace ferry {
namespace {

TEST(TensorPipeAgent, AMessageOverTheLimitClosesThatPipeBeforeAllocating) {
  // The limit is read once per process: set it in a process of its own.
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(1, [](int) {
    setenv("FERRY_MAX_MESSAGE_BYTES", "1048576", 1);
    auto agents = start_group(1);
    ASSERT_EQ(agents.size(), 1u);
    RawClient client(TensorPipeAgent::addresses(*agents[0]).at("uv"));
    std::vector<uint8_t> big(2 << 20, 7);  // 2 MiB against a 1 MiB limit
    tensorpipe::Message m;
    m.metadata = Message(MessageType::kRequest, 1).seal();
    tensorpipe::Message::Tensor tensor;
    tensor.buffer = tensorpipe::CpuBuffer{big.data()};
    tensor.length = big.size();
    m.tensors.push_back(std::move(tensor));
    client.pipe->write(std::move(m), [](const tensorpipe::Error&) {});
    std::optional<bool> closed = client.closed_by_peer();
    ASSERT_TRUE(closed.has_value());
    EXPECT_TRUE(*closed) << "the agent should close a pipe that announces too many bytes";
    // Everyone else is still served.
    Message ok(MessageType::kRequest, 0);
    ok.buffer() += "small";
    EXPECT_OK(agents[0]->send(0, std::move(ok)).status());
    client.close();
    agents[0]->shutdown();
  }));
}

}  // namespace
}  // namespace ferry

namespace ferry {
namespace {

// A raw TensorPipe client, with no token, whose first message carries what ferry
// never sends: TensorPipe payloads. TensorPipe throws on its loop thread when the
// reader's allocation does not match, which used to end the worker (rc 134).
TEST(TensorPipeAgent, APayloadFromARawClientClosesOnlyThatPipe) {
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(1, [](int) {
    auto agents = start_group(1);
    ASSERT_EQ(agents.size(), 1u);
    RawClient client(TensorPipeAgent::addresses(*agents[0]).at("uv"));
    std::vector<uint8_t> bytes(64, 7);
    tensorpipe::Message m;
    m.metadata = Message(MessageType::kRequest, 1).seal();
    tensorpipe::Message::Payload payload;
    payload.data = bytes.data();
    payload.length = bytes.size();
    m.payloads.push_back(std::move(payload));
    client.pipe->write(std::move(m), [](const tensorpipe::Error&) {});
    std::optional<bool> closed = client.closed_by_peer();
    ASSERT_TRUE(closed.has_value());
    EXPECT_TRUE(*closed) << "the agent should close a pipe that sends payloads";
    Message ok(MessageType::kRequest, 0);
    ok.buffer() += "after";
    absl::StatusOr<Message> reply = agents[0]->send(0, std::move(ok)).result();
    ASSERT_OK(reply.status());
    EXPECT_EQ(reply->payload(), "after from a0 via a0");
    client.close();
    agents[0]->shutdown();
  }));
}

}  // namespace
}  // namespace ferry

namespace ferry {
namespace {

// Connects to a worker's TensorPipe listener at `url` ("uv://127.0.0.1:41234" or
// "shm://name") and hangs up before TensorPipe's hello: over TCP with a reset
// (SO_LINGER 0), over the shm transport's unix socket with a close. Anyone who reaches
// the port can do this. TensorPipe fails the listener's accept on it ("connection reset
// by peer", "eof"), and a TensorPipe listener that failed one accept fails every other.
absl::Status hang_up_before_hello(const std::string& url) {
  const size_t scheme = url.find("://");
  if (scheme == std::string::npos) return absl::InvalidArgumentError("no scheme in " + url);
  const std::string kind = url.substr(0, scheme);
  const std::string where = url.substr(scheme + 3);
  int fd = -1;
  if (kind == "shm") {
    sockaddr_un at{};
    at.sun_family = AF_UNIX;
    // An abstract name: a NUL, then the name, and no terminator.
    const size_t len = std::min(where.size(), sizeof(at.sun_path) - 1);
    std::memcpy(at.sun_path + 1, where.data(), len);
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const auto at_len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + len);
    if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&at), at_len) != 0) {
      const int err = errno;
      if (fd >= 0) close(fd);
      return absl::UnavailableError(absl::StrCat("connect to ", url, ": ", std::strerror(err)));
    }
  } else {
    const size_t colon = where.rfind(':');
    sockaddr_in at{};
    at.sin_family = AF_INET;
    if (colon == std::string::npos || inet_pton(AF_INET, where.substr(0, colon).c_str(), &at.sin_addr) != 1) {
      return absl::InvalidArgumentError("not an IPv4 address: " + url);
    }
    at.sin_port = htons(static_cast<uint16_t>(std::stoi(where.substr(colon + 1))));
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&at), sizeof(at)) != 0) {
      const int err = errno;
      if (fd >= 0) close(fd);
      return absl::UnavailableError(absl::StrCat("connect to ", url, ": ", std::strerror(err)));
    }
    linger reset{1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
  }
  close(fd);
  return absl::OkStatus();
}

uint64_t info_count(const Agent& agent, const std::string& key, uint64_t otherwise) {
  std::map<std::string, std::string> info = agent.debug_info();
  auto found = info.find(key);
  return found == info.end() ? otherwise : std::stoull(found->second);
}

class TensorPipeListener : public ::testing::TestWithParam<std::string> {};

// A worker whose listener failed accepts keeps accepting: a peer that connects after
// the failures gets in and is served, at the same address, and the pipe accepted
// before them stays open.
TEST_P(TensorPipeListener, AHangUpBeforeTensorPipesHelloDoesNotStopTheWorkerAccepting) {
  TensorPipeAgentOptions options;
  options.transports = std::vector<std::string>{GetParam()};
  auto agents = start_group(3, options);
  ASSERT_EQ(agents.size(), 3u);
  Agent& victim = *agents[0];
  auto call = [](Agent& from, const std::string& text) {
    Message m(MessageType::kRequest, 0);
    m.buffer() += text;
    return from.send(0, std::move(m), std::chrono::seconds(10)).result();
  };
  // a1's pipe is accepted by the first listener.
  ASSERT_OK(call(*agents[1], "before").status());
  const std::string opened_by_a1 = agents[1]->debug_info().at("pipes_opened");
  ASSERT_EQ(agents[2]->debug_info().at("pipes_opened"), "0") << "a2 must open its pipe after the failures";
  const std::map<std::string, std::string> addresses = TensorPipeAgent::addresses(victim);
  const std::string url = addresses.at(GetParam());

  constexpr uint64_t kHangUps = 3;
  for (uint64_t i = 1; i <= kHangUps; ++i) {
    ASSERT_OK(hang_up_before_hello(url));
    // The listener that failed is replaced by one on the same address; each hang-up
    // below hits the replacement. (Without replacements the count stays at 1, and a2's
    // call below fails.)
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (info_count(victim, "listeners", 1) < 1 + i && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  absl::StatusOr<Message> reply = call(*agents[2], "after");
  ASSERT_OK(reply.status());
  EXPECT_EQ(reply->payload(), "after from a2 via a0");
  EXPECT_EQ(TensorPipeAgent::addresses(victim), addresses);
  // One failed accept per hang-up: a failed listener is not re-armed (it would fail
  // again at once, forever).
  EXPECT_EQ(info_count(victim, "listener_failures", 0), kHangUps);
  // a1's pipe from before the failures still serves, and a1 opened no other.
  reply = call(*agents[1], "still");
  ASSERT_OK(reply.status());
  EXPECT_EQ(reply->payload(), "still from a1 via a0");
  EXPECT_EQ(agents[1]->debug_info().at("pipes_opened"), opened_by_a1);
  for (auto& a : agents) a->shutdown();
}

// A TCP socket bound to 127.0.0.1:`port` (0: any) with SO_REUSEADDR, as libuv binds,
// listening when `listening`; -1 when the bind fails.
int tcp_socket(uint16_t port, bool reuse, bool listening) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int on = 1;
  if (reuse) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &at.sin_addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&at), sizeof(at)) != 0 || (listening && listen(fd, 8) != 0)) {
    close(fd);
    return -1;
  }
  return fd;
}

uint16_t port_of(int fd) {
  sockaddr_in at{};
  socklen_t len = sizeof(at);
  getsockname(fd, reinterpret_cast<sockaddr*>(&at), &len);
  return ntohs(at.sin_port);
}

// What the replacement of a failed listener relies on: the hold is refused while the
// old listener still listens, and once taken it keeps the port from sockets that do not
// share it, while a listener that binds as TensorPipe's uv transport does still can.
TEST(AddressHold, WaitsForTheOldListenerAndLetsTheNewOneListen) {
  int old_listener = tcp_socket(0, /*reuse=*/true, /*listening=*/true);
  ASSERT_GE(old_listener, 0);
  const uint16_t port = port_of(old_listener);
  const std::string url = "uv://127.0.0.1:" + std::to_string(port);
  EXPECT_THAT(internal::AddressHold::take({url}),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot bind " + url + ": Address already in use")));
  close(old_listener);
  absl::StatusOr<internal::AddressHold> hold = internal::AddressHold::take({url});
  ASSERT_OK(hold.status());
  EXPECT_EQ(tcp_socket(port, /*reuse=*/false, /*listening=*/false), -1) << "the port is held";
  int new_listener = tcp_socket(port, /*reuse=*/true, /*listening=*/true);
  EXPECT_GE(new_listener, 0) << "a listener binding with SO_REUSEADDR is let in: " << std::strerror(errno);
  if (new_listener >= 0) close(new_listener);

  EXPECT_THAT(internal::AddressHold::take({"carrier://pigeon"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown transport in carrier://pigeon")));
}

TEST(AddressHold, AShmNameIsFreeOnlyOnceItsListenerIsClosed) {
  const std::string name = "ferry-address-hold-test-" + std::to_string(getpid());
  sockaddr_un at{};
  at.sun_family = AF_UNIX;
  std::memcpy(at.sun_path + 1, name.data(), name.size());
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  int old_listener = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_EQ(bind(old_listener, reinterpret_cast<sockaddr*>(&at), len), 0) << std::strerror(errno);
  ASSERT_EQ(listen(old_listener, 8), 0);
  EXPECT_THAT(internal::AddressHold::take({"shm://" + name}),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("Address already in use")));
  close(old_listener);
  EXPECT_OK(internal::AddressHold::take({"shm://" + name}).status());
  // A name is not held: the new listener binds it next.
  int new_listener = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  EXPECT_EQ(bind(new_listener, reinterpret_cast<sockaddr*>(&at), len), 0) << std::strerror(errno);
  close(new_listener);
}

INSTANTIATE_TEST_SUITE_P(Transports, TensorPipeListener, ::testing::Values("uv", "shm"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace ferry
