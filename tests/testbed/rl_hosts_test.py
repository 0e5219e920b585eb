"""The RL job with rollout workers on other hosts of the testbed (scripts/testbed.sh).

  rl_hosts_test.py WEIGHTLIFT

The trainer and one worker run on host 0 (`weightlift launch -n 2`); a worker on each of hosts 1
and 2 joins the running job over the network (`rl --join`). Then, in turn:
- host 1's NIC drops 5% of its packets both ways, then runs at a 50th of its rate: its worker
  stays in the job;
- host 2's link is cut: the trainer loses that worker within the run's timeout and goes on
  with the two others;
- host 2's link comes back and a new worker there joins, heals and stays.
The run goes on until the test has seen all of it and 20 more steps, then is asked to stop
(SIGTERM to the trainer). Every step trained all its samples, none older than the weights it
was trained against, with the log-probability gaps bf16 weights give (a worker on other weights
would stand out), and the only worker lost is the one whose link was cut.

Needs root and network namespaces; without them it exits 77 (ctest: skipped).
"""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time

from testbed_common import SCRIPT, drops, run_suite, testbed, testbed_up

# Steps enough that the run ends only when asked: a fixed length may end before the faults.
UNTIL_STOPPED = 1000000
STEPS_AFTER = 20  # steps the new worker must stay in the job before the run is stopped
TIMEOUT_S = 6     # the run's --timeout: how long a silent worker is waited for


class Output:
    """A process's output lines as they come (a thread reads them), to wait on."""

    def __init__(self, proc):
        self.proc, self.lines = proc, []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, what, timeout):
        """The time `what` was first printed (within `timeout`), or None."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(what in line for line in list(self.lines)):
                return time.time()
            if self.proc.poll() is not None and not self.thread.is_alive():
                return None
            time.sleep(0.02)
        return None

    def text(self):
        return "".join(self.lines)


def records(out):
    """The whole records of the run's rl_metrics.jsonl (the trainer may be writing the next)."""
    path = os.path.join(out, "rl_metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def steps_on(out, more, timeout):
    """Whether the run in `out` writes `more` records within `timeout` seconds."""
    want = len(records(out)) + more
    deadline = time.time() + timeout
    while time.time() < deadline:
        if len(records(out)) >= want:
            return True
        time.sleep(0.05)
    return False


def trainer_pid(out):
    """The pid of the job's rank 0 (processes.json), 0 if it is not there. The testbed's hosts
    share the machine's pid namespace."""
    try:
        with open(os.path.join(out, "processes.json")) as f:
            return next((p["pid"] for p in json.load(f) if p["rank"] == 0), 0)
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def events(output):
    """What a process printed but its progress bar, for a failure's report."""
    return "".join(line for line in output.lines if "] rl [" not in line)[-12000:]


def faults(name, job, join, out, steps):
    """Joins from hosts 1 and 2, then the faults in turn; False at the first that goes wrong
    (each appends what happened to `steps`)."""
    for h, k in ((1, 2), (2, 3)):
        join(h)
        if job.wait_for(f"rollout worker {k} joined the job", 120) is None:
            steps.append(f"worker {k} did not join from host {h}")
            return False
        steps.append(f"worker {k} joined from host {h}")
    # Host 1's NIC drops 5% of its packets both ways, then runs at 20 Mbit/s, 3 s each: its
    # worker's updates and replies take longer, and it stays in the job.
    at = len(job.lines)
    ok = testbed("loss", name, "1", "5").returncode == 0
    time.sleep(3)
    dropped = sum(drops(name, 1))
    ok = ok and testbed("loss", name, "1", "0").returncode == 0 and \
        testbed("rate", name, "1", "20mbit").returncode == 0
    time.sleep(3)
    ok = ok and testbed("rate", name, "1", "1gbit").returncode == 0
    kept = not any("rollout worker 2 lost" in line for line in job.lines[at:])
    steps.append(f"host 1's worker stayed through 5% loss ({dropped} packets dropped) and "
                 "20 Mbit/s" if kept and dropped > 0 else
                 f"host 1's worker lost to 5% loss or 20 Mbit/s ({dropped} dropped)")
    if not (ok and kept and dropped > 0):
        return False
    cut = time.time()
    lost = job.wait_for("rollout worker 3 lost", 60) \
        if testbed("link", name, "2", "down").returncode == 0 else None
    steps.append(f"host 2's worker lost {lost - cut:.1f} s after its link was cut" if lost else
                 "host 2's worker never lost after its link was cut")
    if lost is None or testbed("link", name, "2", "up").returncode != 0:
        return False
    join(2)
    if job.wait_for("rollout worker 4 joined the job", 120) is None:
        steps.append("no worker joined from the host that came back")
        return False
    stayed = steps_on(out, STEPS_AFTER, 120)
    steps.append(f"a new worker on the host that came back joined, {STEPS_AFTER} steps on"
                 if stayed else "the run stalled after the new worker joined")
    return stayed


def check_run(out):
    """What the stopped run recorded: '' if whole, else what is wrong."""
    try:
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError) as e:
        return f"no summary.json: {e}"
    rl = [r for r in records(out) if r.get("phase", "rl") == "rl"]
    bad = [r for r in rl if r["trained"] != 16 or r["staleness"] != [16] or
           r["logprob_gap_max"] >= 0.05]
    lost = [e["what"] for e in summary["events"] if " lost" in e["what"]]
    problems = []
    if len(rl) != summary["rl_steps_run"]:
        problems.append(f"{len(rl)} records of {summary['rl_steps_run']} steps")
    if bad:
        problems.append(f"{len(bad)} steps not whole, first {json.dumps(bad[0])}")
    if len(lost) != 1 or not lost[0].startswith("rollout worker 3 lost"):
        problems.append(f"workers lost: {lost}")
    if not summary["stopped_early"]:
        problems.append("the run was not the one stopped")
    return "; ".join(problems)


def rl_hosts(s, exe):
    name = "rl%d" % (os.getpid() % 1000)
    out = tempfile.mkdtemp(prefix="wl-testbed-rl-")
    procs, joiners, steps = [], [], []
    try:
        addrs = testbed_up(s, name, 3, "1gbit", "RL")
        if not addrs:
            return
        h0 = addrs[0]
        # A learning rate that keeps the policy as it starts: the log-probability gaps stay
        # what bf16 weights give, and a worker on other weights stands out.
        rl = [exe, "--threads", "1", "rl", "--preset", "tiny", "--task", "sort", "--difficulty",
              "2", "--sft-steps", "0", "--steps", str(UNTIL_STOPPED), "--eval-every",
              str(UNTIL_STOPPED), "--prompts", "4", "--group", "4", "--eval-problems", "8",
              "--no-dynamic-sampling", "--lr", "1e-5", "--timeout", str(TIMEOUT_S)]
        env = dict(os.environ, WEIGHTLIFT_JOB_TOKEN="testbed-rl-%d" % os.getpid())

        def on_host(h, cmd):
            p = subprocess.Popen(["bash", SCRIPT, "exec", name, str(h), "--", *cmd], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.append(p)
            return Output(p)

        def join(h):
            joiners.append(on_host(h, ["env", "MASTER_ADDR=" + h0, "MASTER_PORT=29500", *rl,
                                       "--join"]))

        job = on_host(0, [exe, "launch", "-n", "2", "--master-addr", h0, "--master-port",
                          "29500", "--", *rl, "--out", out])
        ok = job.wait_for("rl [", 120) is not None and faults(name, job, join, out, steps)
        pid = trainer_pid(out)
        if pid:
            os.kill(pid, signal.SIGTERM)  # the run ends after its step and writes its summary
        try:
            job.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
        wrong = check_run(out) if ok else ""
        good = ok and pid > 0 and job.proc.returncode == 0 and not wrong
        s.check("RL across hosts: workers join from two other hosts, one host loses packets and "
                "most of its rate and keeps its worker, another host's link is cut and the run "
                "goes on, the host comes back and its new worker joins (" + "; ".join(steps) +
                ")", good,
                "" if good else wrong + "\n" + events(job) + "\n--- joiners:\n" +
                "\n".join(o.text()[-4000:] for o in joiners))
    finally:
        for p in procs:  # the launcher stops its ranks on SIGTERM
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        testbed("down", name)
        shutil.rmtree(out, ignore_errors=True)


def main():
    run_suite((rl_hosts,), "the RL job survives its hosts' faults")


if __name__ == "__main__":
    main()
