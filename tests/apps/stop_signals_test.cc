// The stop signals go to one thread of their own (apps/weightlift/stop_signals.h): a thread
// started after route_stop_signals() has them blocked, so no signal handler ever runs on a
// thread that computes; a caught one is recorded; the same again, or one not caught, ends the
// process by that signal.
#include "stop_signals.h"

#include <gtest/gtest.h>
#include <pthread.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <thread>

namespace wl::app {
namespace {

bool stop_signal_within(int sig, std::chrono::milliseconds wait) {
  const auto deadline = std::chrono::steady_clock::now() + wait;
  while (stop_signal().load() != sig) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

TEST(StopSignals, GoToTheirOwnThreadAndACaughtOneIsRecorded) {
  route_stop_signals();
  catch_stop_signals({SIGHUP});
  sigset_t mask;
  sigemptyset(&mask);
  std::thread([&] { pthread_sigmask(SIG_BLOCK, nullptr, &mask); }).join();
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) EXPECT_TRUE(sigismember(&mask, sig)) << sig;
  EXPECT_EQ(stop_signal().load(), 0);
  ASSERT_EQ(::kill(::getpid(), SIGHUP), 0);
  EXPECT_TRUE(stop_signal_within(SIGHUP, std::chrono::seconds(10)));
  EXPECT_EQ(stop_signal_name(SIGHUP), "SIGHUP");
}

TEST(StopSignalsDeathTest, TheSameSignalAgainOrOneNotCaughtEndsTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        route_stop_signals();
        catch_stop_signals({SIGHUP, SIGINT});
        ::kill(::getpid(), SIGHUP);
        if (!stop_signal_within(SIGHUP, std::chrono::seconds(10))) std::_Exit(2);
        ::kill(::getpid(), SIGINT);  // another caught one: recorded too, the first stays
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        if (stop_signal().load() != SIGHUP) std::_Exit(3);
        ::kill(::getpid(), SIGHUP);
        std::this_thread::sleep_for(std::chrono::seconds(10));
        std::_Exit(0);
      },
      ::testing::KilledBySignal(SIGHUP), "");
  EXPECT_EXIT(
      {
        route_stop_signals();
        ::kill(::getpid(), SIGTERM);
        std::this_thread::sleep_for(std::chrono::seconds(10));
        std::_Exit(0);
      },
      ::testing::KilledBySignal(SIGTERM), "");
}

}  // namespace
}  // namespace wl::app
