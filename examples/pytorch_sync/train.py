"""The trainer: a plain PyTorch loop on its own nn.Module that, after every optimizer step,
pushes the state dict to every rollout process through weightlift's parameter server (p2p
one-sided writes straight into the receivers' buffers, fused as the layout spec says).

Each version it sends is also saved (f32, `sent-v<N>.pt` in the output directory) so the
rollouts can check, byte for byte, that what arrived is what was sent."""
from __future__ import annotations

import os
import time

import torch

import weightlift as wl
from model import Config, Llama, layout_spec


def batch(c: Config, g: torch.Generator, size: int = 16, length: int = 24) -> torch.Tensor:
    """Counting sequences mod the vocabulary from random starts: 5 6 7 8 ..."""
    start = torch.randint(0, c.vocab, (size, 1), generator=g)
    return (start + torch.arange(length)) % c.vocab


def main(job: wl.Job, c: Config, steps: int, out: str, rollouts: int) -> None:
    torch.manual_seed(0)
    model = Llama(c)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    server = wl.ParameterServer(job)
    server.register_checkpoint("policy", layout=layout_spec(c), named_tensors=model.state_dict())
    server.wait_for_receivers(rollouts)
    for step in range(1, steps + 1):
        tokens = batch(c, g)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, c.vocab),
                                                 tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()

        sent = {n: t.detach().clone() for n, t in model.state_dict().items()}
        torch.save(sent, os.path.join(out, f"sent-v{step}.pt"))
        server.refresh("policy", sent)
        t0 = time.perf_counter()
        u = server.update("policy")
        ms = (time.perf_counter() - t0) * 1e3
        print(f"trainer: step {step} loss {loss.item():.3f}, version {u['version']} to "
              f"receivers {u['receivers']} in {ms:.1f} ms ({u['bytes']} bytes)", flush=True)
        job.barrier(f"checked-{step}", timeout=120)  # every rollout has checked this version
