// A tiny worker for the `ferry run` tests. It reports the environment the launcher
// gave it, meets the other workers through env:// (worker rank 0 hosts the store at
// MASTER_ADDR:MASTER_PORT), passes a barrier with them, and exits 0. Flags make it
// misbehave on purpose:
//
//   --min-world N            block (until stopped) while WORLD_SIZE < N
//   --die-rank R --die-restart C   rank R SIGKILLs itself after meeting the others,
//                            when FERRY_RESTART_COUNT is C
//   --exit-rank R --exit-code K    rank R exits K after meeting the others
//   --hang                   after meeting the others, start a grandchild, print both
//                            pids, block until stopped
//   --alone                  with --hang: no grandchild
//
// Lines it prints (the tests look for them):
//   started rank=R world=W local=L local_world=LW group=G group_world=GW restart=C run=ID master=A:P
//   waiting for world N
//   hanging pid=P grandchild=G
//   done rank=R world=W restart=C
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "rendezvous/rendezvous.h"

namespace {

int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? -1 : std::atoi(v);
}
std::string env_str(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "<unset>" : v;
}

[[noreturn]] void block_forever() {
  for (;;) pause();
}

}  // namespace

int main(int argc, char** argv) {
  int min_world = 0, die_rank = -1, die_restart = -1, exit_rank = -1, exit_code = 0;
  bool hang = false, alone = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::atoi(argv[++i]) : 0; };
    if (a == "--min-world") min_world = next();
    else if (a == "--die-rank") die_rank = next();
    else if (a == "--die-restart") die_restart = next();
    else if (a == "--exit-rank") exit_rank = next();
    else if (a == "--exit-code") exit_code = next();
    else if (a == "--hang") hang = true;
    else if (a == "--alone") alone = true;
    else {
      std::fprintf(stderr, "run_test_worker: unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  setvbuf(stdout, nullptr, _IOLBF, 0);
  const int rank = env_int("RANK"), world = env_int("WORLD_SIZE"), restart = env_int("FERRY_RESTART_COUNT");
  std::printf("started rank=%d world=%d local=%d local_world=%d group=%d group_world=%d restart=%d run=%s master=%s:%s\n",
              rank, world, env_int("LOCAL_RANK"), env_int("LOCAL_WORLD_SIZE"), env_int("GROUP_RANK"),
              env_int("GROUP_WORLD_SIZE"), restart, env_str("FERRY_RUN_ID").c_str(), env_str("MASTER_ADDR").c_str(),
              env_str("MASTER_PORT").c_str());
  if (world < min_world) {
    std::printf("waiting for world %d\n", min_world);
    block_forever();
  }
  auto joined = ferry::rendezvous("env://", std::chrono::seconds(30));
  if (!joined.ok()) {
    std::fprintf(stderr, "env:// rendezvous failed: %s\n", joined.status().ToString().c_str());
    return 1;
  }
  ferry::Store& store = *joined->store;
  if (rank == exit_rank) {
    // With --hang, exit only once rank 0 hangs, so that the launcher has it to stop.
    if (hang) (void)store.wait({"hanging/0"}, std::chrono::seconds(30));
    return exit_code;
  }
  if (hang) {
    if (alone) {
      std::printf("hanging pid=%d\n", getpid());
    } else {
      pid_t child = fork();
      if (child == 0) block_forever();
      std::printf("hanging pid=%d grandchild=%d\n", getpid(), child);
    }
    (void)store.set("hanging/" + std::to_string(rank), ferry::to_bytes("1"));
    block_forever();
  }
  if (rank == die_rank && restart == die_restart) {
    std::printf("dying rank=%d\n", rank);
    raise(SIGKILL);
  }
  // Barrier, then a second count so that rank 0, which hosts the store, leaves last.
  auto arrived = store.add("arrived", 1);
  if (arrived.ok() && *arrived == world) (void)store.set("go", ferry::to_bytes("1"));
  absl::Status go = store.wait({"go"}, std::chrono::seconds(30));
  if (!arrived.ok() || !go.ok()) {
    std::fprintf(stderr, "barrier failed: %s\n", (arrived.ok() ? go : arrived.status()).ToString().c_str());
    return 1;
  }
  std::printf("done rank=%d world=%d restart=%d\n", rank, world, restart);
  auto left = store.add("left", 1);
  if (left.ok() && *left == world) (void)store.set("all_left", ferry::to_bytes("1"));
  if (rank == 0) (void)store.wait({"all_left"}, std::chrono::seconds(30));
  return 0;
}
