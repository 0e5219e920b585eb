"""scripts/testbed.sh against the kernel: hosts that are network namespaces on a shaped bridge.

  testbed_test.py WEIGHTLIFT

- A job of 2 hosts x 2 ranks through `weightlift launch --nnodes` (the script's `run`): the ranks
  of a host reach each other through shared memory and the other host's only through their
  NICs (UCX's own choice of transport, read from its debug log), and an allreduce across the
  hosts stays under its NIC's rate and comes within reach of it.
- A host's link cut in the middle of an allreduce (a flat one with a rank per host, the
  hierarchical one with two) stops the job on every host within the collectives' deadline and
  the launchers' host timeout, each error naming the peer.
- Random packet loss (1% and 5%, both ways, nftables) on one host: allreduces between hosts
  complete with the right sums.
- Nothing is left behind: after a run, after Ctrl-C in the middle of one, after a cut link, and
  after a testbed whose owner died (removed by the next start).
- A spec that cannot be built (a rate of 0, more hosts than the machine holds, a host rate for
  a host that is not there) is refused with a clear error, before anything is made.

Needs root and network namespaces; without them it exits 77 (ctest: skipped).
"""
import json
import os
import re
import signal
import subprocess
import time

from testbed_common import (SCRIPT, drops, launch_on, leftovers, namespaces, run_suite, running,
                            testbed, testbed_up)


def bad_specs(s, exe):
    cases = [
        (["--hosts", "2", "--rate", "0mbit"], "above 0"),
        (["--hosts", "2", "--rate", "fast"], "expected a rate"),
        (["--hosts", "100"], "at most 32 hosts"),
        (["--hosts", "1"], "at least 2 hosts"),
        (["--hosts", "8", "--ranks-per-host", "64"], "more than the 128"),
        (["--hosts", "2", "--host-rate", "5=1gbit"], "no host 5 of 2"),
        (["--hosts", "2", "--host-rate", "1=0gbit"], "above 0"),
        (["--hosts", "2", "--loss", "200"], "at most 100"),
        (["--hosts", "2", "--loss", "2%"], "expected a percentage"),
    ]
    for args, says in cases:
        before = leftovers()
        r = testbed("run", *args, "--bin", exe, "--", exe, "--version")
        lines = r.stderr.strip().splitlines()
        ok = r.returncode == 2 and len(lines) == 1 and says in lines[0] and \
            leftovers() == before
        s.check("refused: " + " ".join(args), ok, lines[-1] if lines else f"exit {r.returncode}")


def name_taken(s, exe):
    """A testbed up under a name: a second `up` or a `run` with the name is refused, and the
    first is left as it was."""
    owner = subprocess.Popen(["sleep", "60"])
    name = "taken%d" % (os.getpid() % 1000)
    try:
        r = testbed("up", "--hosts", "2", "--name", name, "--owner", str(owner.pid))
        before = leftovers()
        again = testbed("up", "--hosts", "2", "--name", name)
        run = testbed("run", "--hosts", "2", "--name", name, "--bin", exe, "--", exe, "--version")
        ok = r.returncode == 0 and again.returncode == 2 and run.returncode == 2 and \
            "is up already" in again.stderr and "is up already" in run.stderr and \
            leftovers() == before
        s.check("a second up or a run under a name that is up is refused, the first untouched", ok,
                (again.stderr + run.stderr).strip()[-300:])
    finally:
        testbed("down", name)
        owner.kill()
        owner.wait()


def transports(s, exe):
    """Which UCX transport each rank's endpoints took: shared memory inside a host, TCP between;
    and the allreduce the group picks there, the hierarchical one, gives the right sums."""
    r = testbed("run", "--hosts", "2", "--ranks-per-host", "2", "--bin", exe, "--",
                "env", "UCX_LOG_LEVEL=debug", exe, "--threads", "1", "bench", "collectives",
                "--ops", "allreduce", "--min-bytes", "64K", "--max-bytes", "64K", "--iters", "3",
                "--warmup", "1", "--json", timeout=180)
    s.check("2 hosts x 2 ranks run", r.returncode == 0, r.stderr[-400:] if r.returncode else "")
    rows = [json.loads(line.split("] ", 2)[2]) for line in r.stdout.splitlines()
            if line.startswith("[host 0] [rank 0] {")]
    s.check("2 hosts x 2 ranks: the allreduce is the hierarchical one, every sum right",
            len(rows) == 1 and rows[0]["algorithm"] == "hierarchical" and rows[0]["wrong"] == 0,
            str(rows))
    # "[host 0] [rank 1] ... ep 0x...: lane[0]:  3:sysv/memory.0 md[2] -> ..." for each endpoint
    kinds = {}
    for m in re.finditer(r"\[host (\d)\] \[rank (\d)\].*?lane\[0\]:\s+\d+:(\w+)/", r.stdout):
        kinds.setdefault(int(m.group(2)), set()).add(m.group(3))
    tcp_only = {"tcp"}
    ok = len(kinds) == 4 and all("tcp" in k and len(k - tcp_only) > 0 for k in kinds.values())
    s.check("every rank reaches its host's other rank by shared memory and the other host's "
            "ranks by TCP", ok, str({r: sorted(k) for r, k in sorted(kinds.items())}))


def bandwidth(s, exe):
    """An allreduce between 2 hosts of one rank each, each NIC held to 200 Mbit/s: every byte
    a rank sends crosses its NIC, so the ring's bus bandwidth cannot exceed the NIC's rate
    (25 MB/s). A plain TCP stream between the hosts gets 24 MB/s; UCX's ring got 58-66% of
    the rate (14.6-17 MB/s, 4-16 MB), so the floor is a quarter: enough to tell a shaped link
    that works from one that stalls."""
    r = testbed("run", "--hosts", "2", "--rate", "200mbit", "--bin", exe, "--", exe,
                "--threads", "1", "bench", "collectives", "--ops", "allreduce", "--min-bytes",
                "4M", "--max-bytes", "4M", "--iters", "3", "--warmup", "1", "--json",
                timeout=180)
    rows = [json.loads(line.split("] ", 2)[2]) for line in r.stdout.splitlines()
            if line.startswith("[host 0] [rank 0] {")]
    if r.returncode != 0 or len(rows) != 1:
        s.check("allreduce at 200 Mbit/s", False, r.stderr[-400:])
        return
    row = rows[0]
    busbw = row["busbw_gbps"] * 1e9 / 1e6  # MB/s
    # 200 Mbit/s is 25 MB/s of Ethernet frames; TCP/IP headers take about 3% of 1500-byte ones.
    s.check("the allreduce ran between hosts over messages, not a shared arena",
            row["algorithm"] != "shm", row["algorithm"])
    s.check(f"bus bandwidth {busbw:.1f} MB/s is at most the NIC's 25 MB/s", busbw <= 25.0)
    s.check(f"bus bandwidth {busbw:.1f} MB/s is at least a quarter of the NIC's", busbw >= 6.25)


def interrupted(s, exe):
    """Ctrl-C as soon as the hosts' namespaces exist (while the testbed is being built and its
    launchers start), and a second after (while the ranks run): the script ends the ranks and
    removes its namespaces."""
    # A duration no other test's process has (ctest runs tests side by side), to find ours.
    duration = "60.%d" % os.getpid()
    for delay in (0.0, 1.0):
        before = leftovers()
        p = subprocess.Popen(["bash", SCRIPT, "run", "--hosts", "2", "--bin", exe, "--",
                              "sleep", duration], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        deadline = time.time() + 30
        while time.time() < deadline and len(namespaces()) < len(before) + 3:
            time.sleep(0.05)
        up = len(namespaces()) >= len(before) + 3
        time.sleep(delay)
        os.killpg(p.pid, signal.SIGINT)
        try:
            p.wait(timeout=30)
            stopped = True
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            stopped = False
        said = p.communicate()[1].strip().splitlines()  # what the script said, for a failure
        sleeps = [pid for pid in subprocess.run(["pgrep", "-f", f"^sleep {duration}$"],
                                                capture_output=True, text=True).stdout.split()
                  if running(pid)]
        ok = up and stopped and leftovers() == before and not sleeps
        s.check(f"Ctrl-C {delay:.0f} s into a run stops it and leaves no namespace, state or rank",
                ok, f"up {up}, stopped {stopped}, left {sorted(set(leftovers()) - set(before))}, "
                f"ranks {sleeps}" + ("" if ok else "; the script said: " + " | ".join(said[-6:])))
        for pid in sleeps:
            os.kill(int(pid), signal.SIGKILL)


def link_cut(s, exe):
    """A host's link cut in the middle of an allreduce (its switch port down): no rank hangs.
    Each rank's wait ends at its 5 s deadline with an error naming the peer, host 0's launcher
    gives up on host 1 after its 10 s, and host 1's launcher stops when the store (on host 0)
    does not answer; the whole job is down within 25 s of the cut. With one rank per host the
    allreduce is a flat one; with two it is the hierarchical one, cut between its lanes."""
    cases = ((1, r"\[host 0\] \[rank 0\] .*DeadlineExceeded: rank 0: .* rank 1"),
             (2, r"\[host 0\] \[rank [01]\] .*DeadlineExceeded: .*allreduce \(hierarchical\)"
                 r".*between hosts: rank [01]: .* from rank [23] "))
    for ranks_per_host, expected in cases:
        name = "cut%d%d" % (os.getpid() % 1000, ranks_per_host)
        p = subprocess.Popen(["bash", SCRIPT, "run", "--hosts", "2", "--ranks-per-host",
                              str(ranks_per_host), "--rate", "100mbit", "--name", name, "--bin",
                              exe, "--", exe, "--threads", "1", "bench", "collectives", "--ops",
                              "allreduce", "--min-bytes", "8M", "--max-bytes", "8M", "--iters",
                              "1000", "--timeout", "5"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 60
        started = False
        while time.time() < deadline and not started:  # until the sizes' table has begun
            line = p.stdout.readline()
            started = "size(B)" in line
        time.sleep(1.5)  # a few allreduces in
        cut = time.time()
        subprocess.run(["ip", "-n", f"wltb-{name}-sw", "link", "set", "p1", "down"], check=True)
        try:
            rest, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            rest, _ = p.communicate()
        took = time.time() - cut
        deadline_hit = re.search(expected, rest)
        host1_stopped = "[host 1] [launch]" in rest and "stopping this host's ranks" in rest
        s.check(f"{ranks_per_host} rank(s) per host: a link cut mid-allreduce stops every host, "
                f"with the peer named, {took:.1f} s after the cut (at most 25)",
                started and p.returncode not in (0, None) and bool(deadline_hit) and
                host1_stopped and took <= 25,
                rest[-900:] if not (deadline_hit and host1_stopped) else "")


def lossy(s, exe):
    """Random packet loss of 1% and 5% on one host's NIC, both ways, in the middle of a run of
    allreduces between 2 hosts at 200 Mbit/s: TCP retransmits what was dropped and every
    allreduce completes with the right sum (bench collectives checks it), no error, and the
    drop counters show the loss was there. A fault on a host or a testbed that is not there, or
    a loss that is no percentage, is refused."""
    name = "loss%d" % (os.getpid() % 1000)
    try:
        addrs = testbed_up(s, name, 2, "200mbit", "packet loss")
        if not addrs:
            return
        refusals = [(("loss", name, "1", "101"), "at most 100"),
                    (("loss", name, "1", "some"), "expected a percentage"),
                    (("loss", name, "2", "1"), "has no host '2'"),
                    (("rate", name, "0", "0mbit"), "above 0"),
                    (("link", name, "1", "sideways"), "expected down or up"),
                    (("loss", "nosuch%d" % os.getpid(), "0", "1"), "no testbed named")]
        for args, says in refusals:
            r = testbed(*args)
            s.check("refused: " + " ".join(args), r.returncode == 2 and says in r.stderr,
                    r.stderr.strip())
        for port, percent in ((29710, "1"), (29711, "5")):
            before = drops(name, 1)
            r = testbed("loss", name, "1", percent)
            if r.returncode != 0:
                s.check(f"{percent}% loss set", False, r.stderr.strip())
                continue
            start = time.time()
            ranks = launch_on(name, addrs, port,
                              [exe, "--threads", "1", "bench", "collectives", "--ops",
                               "allreduce", "--min-bytes", "4M", "--max-bytes", "4M", "--iters",
                               "5", "--warmup", "1", "--timeout", "30", "--json"])
            outs = []
            for p in ranks:
                try:
                    outs.append(p.communicate(timeout=120)[0])
                except subprocess.TimeoutExpired:
                    p.kill()
                    outs.append(p.communicate()[0])
            took = time.time() - start
            sent, received = (a - b for a, b in zip(drops(name, 1), before))
            testbed("loss", name, "1", "0")
            rows = [json.loads(line.split("] ", 1)[1]) for line in outs[0].splitlines()
                    if line.startswith("[rank 0] {")]
            ok = all(p.returncode == 0 for p in ranks) and len(rows) == 1 and \
                sent > 0 and received > 0
            busbw = rows[0]["busbw_gbps"] * 1e3 if rows else 0
            s.check(f"{percent}% packet loss both ways: 5 allreduces of 4 MB complete with the "
                    f"right sums, {sent} + {received} packets dropped, {busbw:.1f} MB/s bus "
                    f"bandwidth, {took:.1f} s in all", ok,
                    "" if ok else "\n".join(o[-400:] for o in outs))
    finally:
        testbed("down", name)


def stale(s):
    """A testbed whose owner died is removed by the next clean, holders and all."""
    owner = subprocess.Popen(["sleep", "30"])
    r = testbed("up", "--hosts", "3", "--rate", "1gbit", "--name", "stale%d" % (os.getpid() % 1000),
                "--owner", str(owner.pid))
    up = r.returncode == 0 and len([n for n in namespaces() if "-stale" in n]) == 4
    holders = re.search(r'TESTBED_HOLDERS="([^"]*)"', r.stdout)
    holder_pids = holders.group(1).split() if holders else []
    owner.kill()
    owner.wait()
    c = testbed("clean")
    alive = [p for p in holder_pids if running(p)]
    s.check("a testbed whose owner died is removed by the next clean (every up and run cleans "
            "first)",
            up and c.returncode == 0 and not [n for n in namespaces() if "-stale" in n] and
            not alive and "removing stale testbed" in c.stderr,
            f"up {up} ({r.stderr.strip()[-200:]}), holders alive {alive}")


def main():
    run_suite((bad_specs, name_taken, transports, bandwidth, interrupted, link_cut, lossy,
               lambda s, exe: stale(s)),
              "the testbed builds, shapes and cleans up")


if __name__ == "__main__":
    main()
