// launch: `weightlift launch -n N -- CMD ...`, the embedded launcher, for one host or several.
//
// Starts N copies of CMD with the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and a fresh random WEIGHTLIFT_JOB_TOKEN, so that
// the job's store refuses any process it did not start. The launcher runs the job's
// rendezvous store itself on MASTER_ADDR:MASTER_PORT (WEIGHTLIFT_STORE_HOSTED=1 tells the
// ranks), as torchrun's agent does: the store outlives any rank, so any rank, rank 0
// included, may be lost and started again. Every
// line a rank prints (stdout and stderr) comes out prefixed "[rank r] ". When a rank exits
// with an error the others are stopped (SIGTERM, then SIGKILL after a grace period) and its
// exit code is returned (unless restart_failed starts it again); a rank killed by signal s
// counts as 128 + s, as a shell reports it. The launcher's last line then repeats that rank's
// last line, its error, which the others' errors about it may have come before.
// Ranks die with the launcher (PR_SET_PDEATHSIG), so no orphan outlives a killed launch. A
// launcher asked to stop (`stop_signal`: its caller's handler of SIGINT, SIGTERM or SIGHUP)
// stops its ranks as it stops them after a failure, so that each can clean up (remove its
// shared memory and sockets) before the grace period ends.
//
// Several hosts (`--nnodes N --node-rank R --master-addr A --master-port P`, torchrun's
// contract): one launcher per host, each starting its -n ranks as global ranks R*n .. R*n+n-1
// (LOCAL_RANK and LOCAL_WORLD_SIZE within the host, GROUP_RANK = R), all with the same job
// token, which every launcher takes from WEIGHTLIFT_JOB_TOKEN (set it to one secret on every
// host). Node 0's launcher runs the store on A:P; the others connect to it before they start
// their ranks, waiting up to join_timeout for it. A rank that fails (and is not started again)
// fails the job on every host: its launcher records the failure in the store, and each of the
// others, which looks every 100 ms, stops its own ranks and exits with the same code. A
// launcher that loses the store stops its ranks too, and node 0's stops the job when another
// launcher falls silent for host_timeout. Node 0's launcher keeps the store up
// until every host's ranks are done. --restart-failed works on every host, each launcher
// restarting its own ranks.
#pragma once

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "weightlift/comm/store/store.h"
#include "weightlift/core/status.h"

namespace wl::comm {

// A job telling its launcher, through the job's store, that process `pid` of rank `rank` is
// lost: alive perhaps (stopped, cut off, stuck), but given up on by the job, which goes on
// without it. `weightlift launch` kills that process if it is the one running as that rank
// (not a replacement started since), and starts the rank again as a failed one when it may
// (restart_failed), so that a replacement rejoins; with no restarts left its end is not
// counted as the job's failure. Under another launcher the key is simply never read.
Status declare_lost(Store& store, int rank, int64_t pid);

struct LaunchOptions {
  int nprocs = 1;  // on this host
  // Hosts in the job and this one's place among them; see the top.
  int nnodes = 1;
  int node_rank = 0;
  // The job's token: the same on every host when it spans several, and known to a process
  // that joins the running job (rl --join); drawn at random when this is empty (one host).
  std::string job_token;
  // How long a launcher waits for the store on node 0 (and node 0's, at the end, for the other
  // hosts' ranks to be done).
  std::chrono::milliseconds join_timeout{60000};
  // A host whose launcher has not been heard from for this long (it beats every 100 ms) is
  // lost: node 0's launcher stops the job.
  std::chrono::milliseconds host_timeout{10000};
  std::vector<std::string> command;  // argv; command[0] is looked up on PATH
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free port on master_addr
  // Between SIGTERM and SIGKILL when stopping the others after a failure.
  std::chrono::milliseconds grace{2000};
  int output_fd = 1;  // where the ranks' lines go, each prefixed "[rank r] "
  // Where the launcher's own lines go ("[launch] rank 1 exited with code 1; ...", a command
  // that cannot be run): apart from the ranks' output, so that it can be piped on whole.
  int notice_fd = 2;
  // A rank that fails while the job runs is started again, with the same variables and
  // WEIGHTLIFT_RESTART=<n>, up to this many times each: jobs whose processes rejoin (RL
  // rollout workers, pipeline stages under --recovery) survive a lost process. 0: a failure
  // stops the job.
  int restart_failed = 0;
  // A rank that exits with this code failed on what it was given (weightlift's exit code for
  // InvalidArgument: docs/errors.md): it is never restarted, the same arguments would fail again.
  int usage_exit_code = 2;
  // The whole job's deadline; 0: none. Past it, every rank still running is killed and the
  // result is DeadlineExceeded naming them: a backstop for a rank stuck where no wait of its
  // own has a deadline (inside a library, or out of resources).
  std::chrono::milliseconds deadline{0};
  // When this holds a signal number (set by the caller's signal handler; 0 until then), every
  // rank still running gets SIGTERM, then SIGKILL after `grace`, none is restarted, and the
  // job's exit code is 128 + that signal, as a shell reports a process the signal ended.
  const std::atomic<int>* stop_signal = nullptr;
};

// The job's exit code (0 when every rank exited 0), or a Status when it could not be started
// or did not finish by its deadline.
Result<int> run_launch(const LaunchOptions& options);

}  // namespace wl::comm
