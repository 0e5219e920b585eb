"""What the testbed's tests share: scripts/testbed.sh driven from Python, the leftovers a test
compares before and after, and a suite of named checks."""
import os
import re
import subprocess
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
SCRIPT = os.path.join(ROOT, "scripts", "testbed.sh")
PREFIX = "wltb-"
STATE_DIR = "/run/weightlift-testbed"


class Suite:
    def __init__(self):
        self.failures = 0

    def check(self, name, ok, detail=""):
        self.failures += 0 if ok else 1
        print(f"{'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""), flush=True)


def namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.startswith(PREFIX))


def leftovers():
    """Namespaces, state files and host holders (the `sleep infinity` of each host) of
    testbeds: what a test compares before and after."""
    state = sorted(os.listdir(STATE_DIR)) if os.path.isdir(STATE_DIR) else []
    holders = [p for p in subprocess.run(["pgrep", "-f", "^sleep infinity$"], capture_output=True,
                                         text=True).stdout.split() if running(p)]
    return namespaces() + state + ["holder " + p for p in sorted(holders)]


def running(pid):
    """Whether process `pid` exists and is not a zombie (which holds no namespace)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def testbed(*args, timeout=120, env=None):
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def can_run():
    if os.geteuid() != 0:
        return "not root"
    probe = "wltb-probe-%d" % os.getpid()
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return "ip netns add: " + r.stderr.strip()
    subprocess.run(["ip", "netns", "del", probe])
    return None


def testbed_up(s, name, hosts, rate, what):
    """Testbed `name` of `hosts` hosts at `rate` up, owned by this test: its hosts' addresses,
    or None after a failed check naming `what` it was for."""
    up = testbed("up", "--hosts", str(hosts), "--rate", rate, "--name", name, "--owner",
                 str(os.getpid()))
    addrs = re.search(r'TESTBED_ADDRS="([^"]*)"', up.stdout)
    if up.returncode != 0 or not addrs:
        s.check(f"a testbed of {hosts} hosts for {what}", False, up.stderr[-300:])
        return None
    return addrs.group(1).split()


def launch_on(name, addrs, port, cmd, env=None):
    """`weightlift launch` of one rank on every host of testbed `name` that is up (torchrun's
    contract: the rendezvous on host 0); the launchers' Popen objects, output merged."""
    env = dict(env or os.environ, WEIGHTLIFT_JOB_TOKEN="testbed-%d" % os.getpid())
    return [subprocess.Popen(["bash", SCRIPT, "exec", name, str(h), "--", cmd[0], "launch",
                              "--nnodes", str(len(addrs)), "--node-rank", str(h),
                              "--master-addr", addrs[0], "--master-port", str(port), "-n", "1",
                              "--", *cmd], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
            for h in range(len(addrs))]


def drops(name, h):
    """Packets host h's loss rules dropped so far: (sent, received)."""
    r = testbed("drops", name, str(h))
    return tuple(int(x) for x in r.stdout.split()) if r.returncode == 0 else (0, 0)


def run_suite(cases, passed):
    """The testbed test's main: `cases` (each called with the Suite and the weightlift binary,
    argv[1]) in turn, then a check that they left no testbed (a stale one found at the start
    may be gone); exit 77 (ctest: skipped) without root and network namespaces, 1 on a failed
    check. `passed`: what a clean run says."""
    exe = os.path.abspath(sys.argv[1])
    why = can_run()
    if why:
        print(f"skipped: network namespaces are not available here ({why})")
        sys.exit(77)
    s = Suite()
    start = leftovers()
    for case in cases:
        case(s, exe)
    # Nothing new: a stale testbed of a killed run, found at the start, may have been cleaned
    # since (every `up` removes those whose owner is gone), which is what it is for.
    left = leftovers()
    s.check("nothing of any testbed is left", set(left) <= set(start), str(left))
    print(f"{s.failures} failed" if s.failures else passed)
    sys.exit(1 if s.failures else 0)
