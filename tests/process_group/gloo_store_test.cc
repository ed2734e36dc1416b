// GlooStore (process_group/internal/): Gloo's rendezvous over a ferry store, including a
// real Gloo full mesh; a failed operation keeps the store's status as a value.
#include <barrier>
#include <thread>
#include <vector>

#include "gloo/allreduce_ring.h"
#include "gloo/common/error.h"
#include "gloo/rendezvous/context.h"
#include "gloo/transport/tcp/device.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "process_group/internal/gloo_store.h"
#include "store/hash_store.h"
#include "store/prefix_store.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::internal::GlooStore;
using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

TEST(GlooStoreTest, SetGetWait) {
  auto store = std::make_shared<HashStore>(2s);
  GlooStore gloo_store(store);
  gloo_store.set("k", {'h', 'i'});
  EXPECT_EQ(gloo_store.get("k"), (std::vector<char>{'h', 'i'}));
  FERRY_ASSERT_OK_AND_ASSIGN(Bytes v, store->get("k"));
  EXPECT_EQ(to_string(v), "hi");
  gloo_store.wait({"k"});
  gloo_store.wait({"k"}, 10ms);
  EXPECT_OK(gloo_store.last_error());
}

TEST(GlooStoreTest, TimeoutsThrowIoExceptionNamingTheKey) {
  GlooStore gloo_store(std::make_shared<HashStore>(100ms));
  try {
    gloo_store.wait({"never"}, 100ms);
    FAIL() << "wait did not throw";
  } catch (const gloo::IoException& e) {
    EXPECT_THAT(e.what(), HasSubstr("'never'"));
    EXPECT_THAT(e.what(), HasSubstr("timed out after"));
  }
  // The status itself is kept, code included: nobody parses the message back.
  EXPECT_THAT(gloo_store.last_error(), StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("'never'")));
  EXPECT_THROW(gloo_store.get("never"), gloo::IoException);
  // The first error is the one kept.
  EXPECT_THAT(gloo_store.last_error(), StatusIs(absl::StatusCode::kDeadlineExceeded));
}

TEST(GlooStoreTest, GlooFullMeshRendezvousesThroughIt) {
  constexpr int kSize = 3;
  auto store = std::make_shared<PrefixStore>("gloo", std::make_shared<HashStore>(10s));
  std::vector<float> results(kSize);
  // A rank that closes its connections while another still reads from them can reset
  // them (Gloo's own teardown race): no context goes before every rank is done.
  std::barrier done(kSize);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kSize; ++rank) {
    threads.emplace_back([&, rank] {
      gloo::transport::tcp::attr attr;
      attr.hostname = "127.0.0.1";
      auto device = gloo::transport::tcp::CreateDevice(attr);
      auto context = std::make_shared<gloo::rendezvous::Context>(rank, kSize);
      GlooStore gloo_store(store);
      context->connectFullMesh(gloo_store, device);
      float value = static_cast<float>(rank + 1);
      std::vector<float*> ptrs{&value};
      gloo::AllreduceRing<float> allreduce(context, ptrs, 1);
      allreduce.run();
      results[rank] = value;
      done.arrive_and_wait();
    });
  }
  for (auto& t : threads) t.join();
  for (float r : results) EXPECT_EQ(r, 6.0f);
}

}  // namespace
}  // namespace ferry
