// Peers' processes on this host, seen through /proc: a wait stops as soon
// as a watched peer exits instead of at the timeout.
#include "comm.h"

#include <cstdio>
#include <cstring>
#include <sstream>

namespace rdna4_comm {

namespace {
// State (field 3) and start time (field 22) from /proc/<pid>/stat; false when
// the process is not visible. Fields are counted after the ")" that ends the
// command name, which may itself hold spaces and parentheses.
bool read_proc_stat(int pid, char* state, uint64_t* start_time) {
  char path[64], buf[1024];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* p = std::strrchr(buf, ')');
  if (!p) return false;
  unsigned long long start = 0;
  // After ")": state ppid pgrp session tty tpgid flags minflt cminflt majflt
  // cmajflt utime stime cutime cstime priority nice threads itrealvalue starttime
  if (std::sscanf(p + 1, " %c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu",
                  state, &start) != 2)
    return false;
  *start_time = start;
  return true;
}
}  // namespace

uint64_t process_start_time(int pid) {
  char state = 0;
  uint64_t start = 0;
  return read_proc_stat(pid, &state, &start) ? start : 0;
}

bool process_alive(const PeerProcess& p) {
  char state = 0;
  uint64_t start = 0;
  // Gone, reused by another process, or a zombie waiting to be reaped.
  return read_proc_stat(p.pid, &state, &start) && start == p.start_time && state != 'Z' && state != 'X';
}

void Comm::watch_peers(const std::vector<PeerProcess>& peers) {
  watched_.clear();
  for (const auto& p : peers)
    if (p.rank != cfg_.rank && p.start_time != 0 && process_alive(p)) watched_.push_back(p);
}

int Comm::exited_peer() const {
  for (const auto& p : watched_)
    if (!process_alive(p)) return p.rank;
  return -1;
}

std::string Comm::exit_message(int peer) const {
  int pid = 0;
  for (const auto& p : watched_)
    if (p.rank == peer) pid = p.pid;
  std::ostringstream s;
  s << "rdna4_comm: rank " << peer << " (pid " << pid << ") of communicator '" << cfg_.id
    << "' exited; rank " << cfg_.rank
    << " stopped waiting for it. The communicator is unusable now: close it and create a new one.";
  return s.str();
}

}  // namespace rdna4_comm
