#include "runtime/ipc_socket.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

namespace loom::runtime {
namespace {

using std::chrono::milliseconds;

constexpr int kNode = 0;

SocketTag fresh_tag() {
  Result<SocketTag> tag = random_socket_tag();
  EXPECT_TRUE(tag.ok()) << tag.status().to_string();
  return tag.ok() ? *tag : SocketTag{};
}

FdExchange listen_or_die(const SocketTag& tag, int local_rank) {
  Result<FdExchange> exchange = FdExchange::listen(tag, kNode, local_rank, 4);
  EXPECT_TRUE(exchange.ok()) << exchange.status().to_string();
  return std::move(exchange).value();
}

// An anonymous in-memory file holding `text`: what a cuMem export looks like to the socket.
UniqueFd memfd_with(const std::string& text) {
  UniqueFd fd(memfd_create("loom-ipc-socket-test", MFD_CLOEXEC));
  if (fd.valid() && write(fd.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size())) fd.reset();
  return fd;
}

// Reads the file behind a received descriptor from its start (the file offset is shared with the
// sender's descriptor, which wrote it, so plain read() would start at the end).
std::string read_all(int fd) {
  char buffer[256] = {};
  const ssize_t got = pread(fd, buffer, sizeof(buffer), 0);
  return got > 0 ? std::string(buffer, static_cast<size_t>(got)) : std::string();
}

size_t open_fd_count() {
  size_t count = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) ++count;
  return count;
}

// A raw client of an endpoint, for the misbehaving-peer cases.
UniqueFd raw_connect(const SocketTag& tag, int local_rank) {
  const std::string name = endpoint_socket_name(tag, kNode, local_rank);
  UniqueFd fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path + 1, name.data(), name.size());
  const auto length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  if (connect(fd.get(), reinterpret_cast<const sockaddr*>(&address), length) != 0) fd.reset();
  return fd;
}

TEST(IpcSocket, NamesSeparateJobsNodesAndRanks) {
  const SocketTag a = fresh_tag();
  const SocketTag b = fresh_tag();
  EXPECT_NE(a, b);
  EXPECT_NE(endpoint_socket_name(a, 0, 1), endpoint_socket_name(b, 0, 1));
  EXPECT_NE(endpoint_socket_name(a, 0, 1), endpoint_socket_name(a, 1, 1));
  EXPECT_NE(endpoint_socket_name(a, 0, 1), endpoint_socket_name(a, 0, 2));
  EXPECT_LT(endpoint_socket_name(a, 1000, 1000).size(), sizeof(sockaddr_un::sun_path) - 1);
}

TEST(IpcSocket, SecondListenerOnOneNameFails) {
  const SocketTag tag = fresh_tag();
  FdExchange first = listen_or_die(tag, 0);
  Result<FdExchange> second = FdExchange::listen(tag, kNode, 0, 4);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kSystemError);
  EXPECT_NE(second.status().message().find("another process holds"), std::string::npos)
      << second.status().message();
}

// Both endpoints send before either receives, in one thread: the buffered sends are what makes
// the heap's "send to all, then receive from all" order safe.
TEST(IpcSocket, SendAllThenReceiveAllInOneThread) {
  const size_t fds_before = open_fd_count();
  {
    const SocketTag tag = fresh_tag();
    FdExchange rank0 = listen_or_die(tag, 0);
    FdExchange rank1 = listen_or_die(tag, 1);
    UniqueFd file0 = memfd_with("heap of rank 0");
    UniqueFd file1 = memfd_with("heap of rank 1");
    ASSERT_TRUE(file0.valid() && file1.valid());
    const Deadline deadline = Clock::now() + milliseconds(2000);
    ASSERT_TRUE(rank0.send(1, file0.get(), 1000, deadline).ok());
    ASSERT_TRUE(rank1.send(0, file1.get(), 1001, deadline).ok());

    const int from_rank1[] = {1};
    Result<std::vector<ReceivedFd>> at0 = rank0.receive(from_rank1, deadline);
    ASSERT_TRUE(at0.ok()) << at0.status().to_string();
    ASSERT_EQ(at0->size(), 1u);
    EXPECT_EQ((*at0)[0].local_rank, 1);
    EXPECT_EQ((*at0)[0].value, 1001u);
    EXPECT_EQ(read_all((*at0)[0].fd.get()), "heap of rank 1");

    const int from_rank0[] = {0};
    Result<std::vector<ReceivedFd>> at1 = rank1.receive(from_rank0, deadline);
    ASSERT_TRUE(at1.ok()) << at1.status().to_string();
    EXPECT_EQ((*at1)[0].value, 1000u);
    EXPECT_EQ(read_all((*at1)[0].fd.get()), "heap of rank 0");
  }
  EXPECT_EQ(open_fd_count(), fds_before) << "descriptors leaked";
}

// The real use: another process receives a descriptor and reads what we wrote through it.
TEST(IpcSocket, ChildProcessReadsTheParentsFile) {
  const SocketTag tag = fresh_tag();
  const std::string parent_text = "written by the parent before the fork's exchange";
  const std::string child_text = "written by the child";
  FdExchange parent = listen_or_die(tag, 0);
  UniqueFd parent_file = memfd_with(parent_text);
  ASSERT_TRUE(parent_file.valid());

  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Child: local rank 1. Exit codes say which step failed; never return into gtest.
    const Deadline deadline = Clock::now() + milliseconds(5000);
    Result<FdExchange> mine = FdExchange::listen(tag, kNode, 1, 4);
    if (!mine.ok()) _exit(10);
    UniqueFd child_file = memfd_with(child_text);
    if (!mine->send(0, child_file.get(), 7, deadline).ok()) _exit(11);
    const int from_parent[] = {0};
    Result<std::vector<ReceivedFd>> got = mine->receive(from_parent, deadline);
    if (!got.ok()) _exit(12);
    if ((*got)[0].value != 42 || read_all((*got)[0].fd.get()) != parent_text) _exit(13);
    _exit(0);
  }

  const Deadline deadline = Clock::now() + milliseconds(5000);
  EXPECT_TRUE(parent.send(1, parent_file.get(), 42, deadline).ok());
  const int from_child[] = {1};
  Result<std::vector<ReceivedFd>> got = parent.receive(from_child, deadline);
  EXPECT_TRUE(got.ok()) << got.status().to_string();
  if (got.ok()) {
    EXPECT_EQ((*got)[0].value, 7u);
    EXPECT_EQ(read_all((*got)[0].fd.get()), child_text);
  }

  int wait_status = 0;
  pid_t reaped = 0;
  const auto give_up = Clock::now() + milliseconds(10000);
  while ((reaped = waitpid(child, &wait_status, WNOHANG)) == 0 && Clock::now() < give_up) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  if (reaped == 0) {
    kill(child, SIGKILL);
    waitpid(child, &wait_status, 0);
    FAIL() << "child did not finish";
  }
  ASSERT_TRUE(WIFEXITED(wait_status));
  EXPECT_EQ(WEXITSTATUS(wait_status), 0) << "child failed at step " << WEXITSTATUS(wait_status);
}

TEST(IpcSocket, PeerThatNeverConnectsTimesOutNamingIt) {
  const SocketTag tag = fresh_tag();
  FdExchange rank0 = listen_or_die(tag, 0);
  const auto timeout = milliseconds(500);
  const auto started = Clock::now();
  const int peers[] = {1, 2};
  Result<std::vector<ReceivedFd>> got = rank0.receive(peers, started + timeout);
  const auto took = Clock::now() - started;
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kTimeout);
  EXPECT_NE(got.status().message().find("local rank(s) 1, 2"), std::string::npos) << got.status().message();
  EXPECT_GE(took, timeout);
  EXPECT_LT(took, timeout + milliseconds(1000));
}

TEST(IpcSocket, SendToAnAbsentListenerTimesOut) {
  const SocketTag tag = fresh_tag();
  FdExchange rank0 = listen_or_die(tag, 0);
  UniqueFd file = memfd_with("never delivered");
  const auto started = Clock::now();
  Status sent = rank0.send(3, file.get(), 0, started + milliseconds(300));
  const auto took = Clock::now() - started;
  EXPECT_EQ(sent.code(), StatusCode::kTimeout);
  EXPECT_NE(sent.message().find("local rank 3"), std::string::npos) << sent.message();
  EXPECT_LT(took, milliseconds(1300));
}

// Garbage, early hang-ups and silent connections are dropped; the real peer still gets through.
TEST(IpcSocket, StrayConnectionsAreDroppedAndTheExchangeCompletes) {
  const SocketTag tag = fresh_tag();
  FdExchange rank0 = listen_or_die(tag, 0);
  FdExchange rank1 = listen_or_die(tag, 1);

  UniqueFd garbage = raw_connect(tag, 0);
  ASSERT_TRUE(garbage.valid());
  const char junk[48] = "definitely not a loom message";
  ASSERT_EQ(send(garbage.get(), junk, sizeof(junk), MSG_NOSIGNAL), static_cast<ssize_t>(sizeof(junk)));
  UniqueFd hang_up = raw_connect(tag, 0);
  ASSERT_TRUE(hang_up.valid());
  hang_up.reset();
  UniqueFd silent = raw_connect(tag, 0);  // stays open, sends nothing
  ASSERT_TRUE(silent.valid());

  UniqueFd file = memfd_with("the real one");
  const Deadline deadline = Clock::now() + milliseconds(2000);
  ASSERT_TRUE(rank1.send(0, file.get(), 5, deadline).ok());
  const int from_rank1[] = {1};
  Result<std::vector<ReceivedFd>> got = rank0.receive(from_rank1, deadline);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(read_all((*got)[0].fd.get()), "the real one");
}

}  // namespace
}  // namespace loom::runtime
