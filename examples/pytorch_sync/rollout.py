"""A rollout process: receives every version the trainer pushes, checks it is exactly what was
sent (bf16) or within fp8 e4m3's rounding of it, rebuilds a PyTorch model from the received
tensors and generates with it.

Two ways to hold the weights:
  - in this process: `wl.Receiver(job, id, layout=...)`; the tensors are zero-copy views of
    the receiver's buffers;
  - beside this process: `weightlift receiver serve` runs the receiver as a sidecar of its own
    and this process, the "engine", only attaches (`wl.attach`): no weightlift code runs in
    the engine beyond that plain-Python module."""
from __future__ import annotations

import os
import subprocess
import tempfile
from typing import Mapping

import torch

import weightlift as wl
from model import Config, block_scales, dequantized, layout_spec, rebuilt, sources


def check(weights: Mapping[str, torch.Tensor], sent: Mapping[str, torch.Tensor],
          lo: int, hi: int) -> int:
    """Every received tensor against what the trainer sent; returns how many were fp8."""
    quantized = 0
    for name in weights.keys():
        if name.endswith(".scale"):
            continue
        t = weights[name]
        assert lo <= t.data_ptr() < hi, f"{name} is not a view of the receiver's memory"
        want = torch.cat([sent[s] for s in sources(name)])
        if name + ".scale" not in weights.keys():
            assert torch.equal(t, want.to(torch.bfloat16)), f"{name} differs from what was sent"
            continue
        quantized += 1
        # e4m3's rounding: half a step (2^-4 relative), or half a subnormal step (2^-10 of the
        # block's scale) for the block's smallest values.
        bound = want.abs() * 2.0 ** -4 + block_scales(weights, name) * 2.0 ** -10
        worst = ((dequantized(weights, name) - want).abs() - bound).max().item()
        assert worst <= 1e-6, f"{name}: off by {worst} beyond e4m3's rounding"
    return quantized


def versions(job: wl.Job, c: Config, steps: int, out: str, holder) -> None:
    """For each version: wait, pin, check, generate, unpin, tell the trainer."""
    for v in range(1, steps + 1):
        holder.wait_for_version(v, timeout=120)
        lo, hi = holder.memory_range()
        sent = torch.load(os.path.join(out, f"sent-v{v}.pt"))
        with holder.pin() as weights:
            assert weights.version == v, (weights.version, v)
            quantized = check(weights, sent, lo, hi)
            model = rebuilt(c, weights)
        text = model.generate([5, 6, 7], 8)
        kind = f"fp8 ({quantized} matrices)" if quantized else "bf16, exact"
        print(f"rollout {job.rank}: version {v} checked, {kind}; 5 6 7 -> "
              f"{' '.join(map(str, text))}", flush=True)
        job.barrier(f"checked-{v}", timeout=120)


class InProcess:
    """wl.Receiver with the sidecar's wait/pin/memory_range names."""

    def __init__(self, job: wl.Job, c: Config, id: int) -> None:
        self.r = wl.Receiver(job, id=id, layout=layout_spec(c), format="bf16")

    def wait_for_version(self, v: int, timeout: float) -> int:
        return self.r.wait_for_version(v, timeout)

    def memory_range(self):
        return self.r.memory_range()

    def pin(self):
        return self.r.acquire()


def main(job: wl.Job, c: Config, steps: int, out: str, sidecar: bool) -> None:
    id = job.rank - 1
    if not sidecar:
        versions(job, c, steps, out, InProcess(job, c, id))
        return
    exe = os.environ.get("WEIGHTLIFT_EXE", "weightlift")
    tmp = tempfile.mkdtemp()
    spec_path, sock = os.path.join(tmp, "layout.json"), os.path.join(tmp, f"r{id}.sock")
    with open(spec_path, "w") as f:
        f.write(layout_spec(c).to_json())
    proc = subprocess.Popen([exe, "receiver", "serve", "--id", str(id), "--layout", spec_path,
                             "--dtype", "fp8", "--socket", sock], stdout=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        assert "engines attach at" in line, f"receiver serve: {line!r}"
        engine = wl.attach(sock)
        versions(job, c, steps, out, engine)
        engine.close()
    finally:
        proc.terminate()
        code = proc.wait(timeout=30)
    assert code == 0, f"receiver serve exited {code}"
