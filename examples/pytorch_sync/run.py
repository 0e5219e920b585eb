"""One process of the example, by its rank under `weightlift launch`: rank 0 trains and
pushes, rank 1 receives in-process (bf16), rank 2 through a receiver sidecar (fp8).

    weightlift launch -n 3 -- python3 examples/pytorch_sync/run.py --steps 5 --out /tmp/sync
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import weightlift as wl  # noqa: E402
from model import Config  # noqa: E402

import rollout  # noqa: E402
import train  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps, one version each")
    ap.add_argument("--out", required=True, help="where the trainer saves what it sends")
    args = ap.parse_args()
    job = wl.init(timeout=120)
    assert job.size == 3, f"the example runs on 3 ranks (weightlift launch -n 3), not {job.size}"
    c = Config()
    os.makedirs(args.out, exist_ok=True)
    if job.rank == 0:
        train.main(job, c, args.steps, args.out, rollouts=job.size - 1)
    else:
        rollout.main(job, c, args.steps, args.out, sidecar=job.rank == 2)
    job.close(timeout=120)
