// Test helper for launcher_test: a worker whose behaviour the test picks with
// KEY=VALUE arguments (RANK from the environment decides who does what):
//   pid_dir=DIR          write DIR/<rank>.pid first (tests wait for them, then check the pids died)
//   fail_rank=R code=C   rank R exits with code C after delay_ms (default 100)
//   kill_rank=R          rank R kills itself with SIGKILL after delay_ms
//   fail_until_restart=K exit 3 while TORCHELASTIC_RESTART_COUNT < K, else 0 (only
//                        rank R does with fail_rank=R, after delay_ms; the others exit 0 at once)
//   sleep=S              everyone else sleeps S seconds, then exits 0
//   ignore_term          ignore SIGTERM (the launcher must fall back to SIGKILL)
//   shm                  create /dev/shm/cohort-<COHORT_RUN_ID>-test<rank> and print its path
//   partial              write "par", pause, "tial\n" on stdout (one line in two writes)
//   say=TEXT / warn=TEXT print TEXT on stdout / stderr
//   lines=N              print "line 1" ... "line N" on stdout (blocking while nobody reads)
//   term_lines=N         on SIGTERM (while sleeping): print "bye 1" ... "bye N", "bye done", exit 0
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

namespace {

volatile sig_atomic_t g_term = 0;
void on_term(int) { g_term = 1; }

int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoi(v) : dflt;
}

void write_str(int fd, const std::string& s) {
  ssize_t n = write(fd, s.data(), s.size());
  (void)n;
}

}  // namespace

int main(int argc, char** argv) {
  const int rank = env_int("RANK", 0);
  int fail_rank = -1, code = 1, kill_rank = -1, fail_until = -1, delay_ms = 100;
  double sleep_s = 0;
  long term_lines = -1;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto eq = a.find('=');
    std::string key = a.substr(0, eq), val = eq == std::string::npos ? "" : a.substr(eq + 1);
    if (key == "pid_dir") {
      std::string path = val + "/" + std::to_string(rank) + ".pid", tmp = path + ".tmp";
      FILE* f = std::fopen(tmp.c_str(), "w");
      if (f == nullptr) return 90;
      std::fprintf(f, "%d\n", static_cast<int>(getpid()));
      std::fclose(f);
      std::rename(tmp.c_str(), path.c_str());  // appears whole
    } else if (key == "fail_rank") fail_rank = std::atoi(val.c_str());
    else if (key == "code") code = std::atoi(val.c_str());
    else if (key == "kill_rank") kill_rank = std::atoi(val.c_str());
    else if (key == "fail_until_restart") fail_until = std::atoi(val.c_str());
    else if (key == "delay_ms") delay_ms = std::atoi(val.c_str());
    else if (key == "sleep") sleep_s = std::atof(val.c_str());
    else if (key == "ignore_term") signal(SIGTERM, SIG_IGN);
    else if (key == "say") write_str(1, val + "\n");
    else if (key == "warn") write_str(2, val + "\n");
    else if (key == "term_lines") {
      term_lines = std::atol(val.c_str());
      struct sigaction sa {};
      sa.sa_handler = on_term;
      sa.sa_flags = SA_RESTART;
      sigaction(SIGTERM, &sa, nullptr);
    } else if (key == "lines") {
      for (long k = 1, n = std::atol(val.c_str()); k <= n; ++k) std::printf("line %ld\n", k);
      std::fflush(stdout);
    }
    else if (key == "partial") {
      write_str(1, "par");
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      write_str(1, "tial\n");
    } else if (key == "shm") {
      const char* id = std::getenv("COHORT_RUN_ID");
      std::string path = std::string("/dev/shm/cohort-") + (id ? id : "none") + "-test" + std::to_string(rank);
      int fd = open(path.c_str(), O_CREAT | O_WRONLY, 0600);
      if (fd < 0) return 91;
      close(fd);
      write_str(1, "SHM=" + path + "\n");
    } else {
      std::fprintf(stderr, "launch_behave: unknown argument %s\n", argv[i]);
      return 92;
    }
  }
  if (fail_until >= 0) {
    int restart = env_int("TORCHELASTIC_RESTART_COUNT", -1);
    write_str(1, "restart " + std::to_string(restart) + "\n");
    bool failing = (fail_rank < 0 || rank == fail_rank) && restart < fail_until;
    if (failing && fail_rank >= 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    return failing ? 3 : 0;
  }
  if (rank == fail_rank || rank == kill_rank) {
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    if (rank == kill_rank) raise(SIGKILL);
    return code;
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(sleep_s);
  while (std::chrono::steady_clock::now() < until) {
    if (g_term && term_lines >= 0) {
      for (long k = 1; k <= term_lines; ++k) std::printf("bye %ld\n", k);
      std::printf("bye done\n");
      std::fflush(stdout);
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return 0;
}
