"""The ranks of tests/testbed/fleet_hosts_test.py, one per testbed host, started without a
launcher (a launcher stops the whole job when a host is lost; a fleet outlives its receivers):

  fleet_hosts_ranks.py server|receiver STOP_FILE

Rank 0 is the parameter server: it refreshes `small` to step 1, 2, ... and sends each step
as an update to every receiver that joined, 0.3 s apart, until STOP_FILE exists. Step s is
every weight of a fixed state dict plus s, and every norm weight exactly s. Ranks 1 and 2 are
receivers (ids 0 and 1): they serve rounds and, whenever their version changes, read the
version they hold and check it is one step whole (every tensor the step its norms name: no
mixture of two). Each prints one JSON line per event, for the test to follow:

  server:   {"update": step, "started": t} before an update, then {"step", "version",
            "members", "dropped"} or {"step", "error"}
  receiver: {"version", "step", "whole", "t"} per new version (t: when it first held it),
            {"error", "t"} per failed round, {"left_behind": version} when an update left it
            out
"""
import json
import os
import sys
import time

import torch

import weightlift as wl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from ranks import expected  # noqa: E402  (what a receiver holds of a state dict's tensor)

MODEL = "small"
PACE_S = 0.3
STEP_TENSOR = "layers.0.attn_norm.weight"


def say(**fields):
    print(json.dumps(fields), flush=True)


def base():
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(s, generator=g) for n, s in wl.parameters(MODEL)}


def at_step(b, step):
    return {n: (torch.full_like(t, float(step)) if "norm" in n else t + step) for n, t in b.items()}


def server(job, stop_file):
    b = base()
    ps = wl.ParameterServer(job, timeout=5)
    ps.register_checkpoint("policy", MODEL, named_tensors=at_step(b, 0))
    ps.wait_for_receivers(2, timeout=60)
    step = 0
    while not os.path.exists(stop_file):
        step += 1
        ps.refresh("policy", at_step(b, step))
        say(update=step, started=time.time())
        try:
            u = ps.update("policy")
            say(step=step, version=u["version"], members=u["receivers"], dropped=u["dropped"],
                t=time.time())
        except wl.Error as e:
            say(step=step, error=str(e), t=time.time())
        ps.serve_for(PACE_S)
    job.close(timeout=60)


def receiver(job, stop_file):
    b = base()
    r = wl.Receiver(job, id=job.rank - 1, model=MODEL, timeout=5)
    seen = 0
    while not os.path.exists(stop_file):
        try:
            out = r.serve_one(timeout=0.2)
            if out["left_behind"]:
                say(left_behind=out["version"], t=time.time())
        except wl.Error as e:
            if not str(e).startswith("DeadlineExceeded") or "no round posted" not in str(e):
                say(error=str(e)[:300], t=time.time())
        if r.version == seen:
            continue
        with r.acquire() as w:
            seen, took = w.version, time.time()  # when it had it: the check below takes a while
            step = int(w[STEP_TENSOR][0].float())
            want = at_step(b, step)
            whole = all(torch.equal(w[n], expected(want, n)) for n in w.keys())
            say(version=seen, step=step, whole=whole, t=took)
    job.close(timeout=60)


def main():
    role, stop_file = sys.argv[1], sys.argv[2]
    job = wl.init(timeout=60)
    (server if role == "server" else receiver)(job, stop_file)


if __name__ == "__main__":
    main()
