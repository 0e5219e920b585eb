"""The Python package, through real processes where processes are the point: collectives
between ranks, the parameter server and receivers, a receiver that dies; and in this process
the errors every public call gives on bad input.

Run by CTest (tests/CMakeLists.txt) with PYTHONPATH=<build>/python and WEIGHTLIFT_EXE, the
weightlift binary whose `launch` starts the ranks (tests/python/ranks.py)."""
import collections.abc
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import weightlift as wl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "support"))
from ports import free_port  # noqa: E402
EXE = os.environ.get("WEIGHTLIFT_EXE", "weightlift")


def launch(case, ranks=3, timeout=120):
    r = subprocess.run([EXE, "launch", "-n", str(ranks), "--", sys.executable,
                        os.path.join(HERE, "ranks.py"), case],
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{case}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"


def test_collectives_across_processes():
    launch("collectives")


@pytest.mark.parametrize("mode", ["p2p", "broadcast"])
def test_two_server_ranks_a_healed_receiver_and_the_gil_released(mode, monkeypatch):
    monkeypatch.setenv("WL_MODE", mode)
    launch("two_servers", ranks=4)


def test_server_to_receivers_exact_zero_copy_and_pinned():
    launch("fleet")


def test_a_hugging_face_checkpoint_directory_from_server_to_receivers(tmp_path):
    config = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
              "head_dim": 16, "num_experts": 4, "top_k": 2, "ffn_dim": 32, "vocab_size": 320,
              "max_seq_len": 64, "qk_norm": True, "dense_layers": [1], "dense_ffn_dim": 48}
    (tmp_path / "config.json").write_text(json.dumps(config))
    subprocess.run([EXE, "train", "--config", str(tmp_path / "config.json"), "--steps", "1",
                    "--batch", "2", "--seq", "16", "--out", str(tmp_path / "run")], check=True,
                   capture_output=True, timeout=120)
    os.environ["WL_HF_DIR"] = str(tmp_path / "run" / "hf")
    try:
        launch("hf_fleet")
    finally:
        del os.environ["WL_HF_DIR"]


def test_receiver_that_dies_is_left_out_without_a_hang():
    launch("dead_receiver")


def test_fp8_receiver_within_e4m3_rounding():
    launch("fp8", ranks=2)


def test_sidecar_engine_attaches_zero_copy_pinned_and_survives_bad_requests():
    launch("sidecar", ranks=2)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_launch_leaves_no_receiver_behind(tmp_path, sig):
    """Ctrl-C (or a container's SIGTERM) to `weightlift launch` reaches `receiver serve` as a
    SIGTERM it cleans up after: no shared memory, no socket, and the next start on the same
    socket works."""
    sock = str(tmp_path / "r0.sock")
    for attempt in range(2):
        p = subprocess.Popen([EXE, "launch", "-n", "1", "--", EXE, "receiver", "serve", "--id", "0",
                              "--model", "tiny", "--socket", sock],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = p.stdout.readline()
        assert "engines attach at" in line, line
        shm = line.split("in shared memory ")[1].split(";")[0]
        assert os.path.exists("/dev/shm" + shm) and os.path.exists(sock)
        p.send_signal(sig)
        try:
            out = p.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            p.kill()
            raise
        assert p.returncode == 128 + sig, (attempt, p.returncode, out)
        assert not os.path.exists(sock), "the receiver left its socket"
        assert not os.path.exists("/dev/shm" + shm), "the receiver left its shared memory"


def test_receiver_killed_mid_update_raises_or_is_left_out_without_a_hang():
    # Started here rather than by `weightlift launch`, which stops a job whose rank was killed.
    port = free_port()
    procs = []
    for r in range(3):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), WEIGHTLIFT_JOB_TOKEN="killed-mid-update")
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "ranks.py"),
                                       "killed_mid_update"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[2].returncode == -9, outputs[2]
    assert procs[0].returncode == 0, outputs[0]
    assert procs[1].returncode == 0, outputs[1]
    assert "server: the dead receiver was" in outputs[0], outputs[0]


@pytest.fixture
def job(monkeypatch):
    """A job of this one process, its store on a free port."""
    for v in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(v, raising=False)
    port = free_port()
    monkeypatch.setenv("MASTER_PORT", str(port))
    j = wl.init(timeout=10)
    yield j
    j.close()


def test_a_job_of_one(job):
    assert (job.rank, job.size) == (0, 1)
    pg = job.process_group()
    t = torch.arange(10, dtype=torch.float32)
    pg.allreduce(t)
    assert torch.equal(t, torch.arange(10, dtype=torch.float32))
    job.barrier("alone")


@pytest.mark.parametrize("bad, needle", [
    (lambda: torch.zeros(4, 4).t(), "not contiguous"),
    (lambda: torch.zeros(4, dtype=torch.float64), "torch.float64"),
    (lambda: np.zeros(4, dtype=np.float64), "float64"),
    (lambda: [1.0, 2.0], "a list"),
    (lambda: np.zeros(4, dtype=np.float32)[::2], "not C-contiguous"),
])
def test_collectives_refuse_what_they_cannot_take(job, bad, needle):
    pg = job.process_group()
    with pytest.raises(wl.Error, match=needle):
        pg.allreduce(bad())


def test_collective_arguments_are_checked(job):
    pg = job.process_group()
    with pytest.raises(wl.Error, match="reduce op 'mean'"):
        pg.allreduce(torch.zeros(4), op="mean")
    with pytest.raises(wl.Error, match="root 1 of a group of 1"):
        pg.broadcast(torch.zeros(4), root=1)
    with pytest.raises(wl.Error, match="output holds 3 elements"):
        pg.allgather(torch.zeros(3), torch.zeros(4))
    with pytest.raises(wl.Error, match="input is F32, output BF16"):
        pg.allgather(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4))
    with pytest.raises(wl.Error, match="timeout"):
        pg.barrier(timeout=-1)
    with pytest.raises(wl.Error, match=r"timeout: 1e\+308 s: expected seconds in \(0, 1e7\]"):
        pg.barrier(timeout=1e308)


def test_counts_and_spans_are_checked(job):
    with pytest.raises(wl.Error, match=r"ranks: -1: expected an integer in \[0, 1\]"):
        job.barrier("negative", ranks=-1)
    with pytest.raises(wl.Error, match=r"rank: 3: expected an integer in \[0, 1\]"):
        wl.ParameterServer(job, rank=3, size=2)
    with pytest.raises(wl.Error, match=r"id: -2"):
        wl.Receiver(job, id=-2, model="tiny")
    server = wl.ParameterServer(job)
    for bad in (float("nan"), -1.0, 1e308):
        with pytest.raises(wl.Error, match="serve_for"):
            server.serve_for(bad)


def state_dict():
    return {n: torch.randn(s) for n, s in wl.parameters("tiny")}


def test_register_checkpoint_names_the_tensor_at_fault(job):
    server = wl.ParameterServer(job)
    sd = state_dict()
    missing = dict(sd)
    del missing["layers.0.attn.q_proj.weight"]
    with pytest.raises(wl.Error, match="'layers.0.attn.q_proj.weight' is missing"):
        server.register_checkpoint("a", "tiny", named_tensors=missing)
    wrong = dict(sd, **{"norm.weight": torch.zeros(3)})
    with pytest.raises(wl.Error, match=r"'norm.weight' has shape \[3\]"):
        server.register_checkpoint("a", "tiny", named_tensors=wrong)
    extra = dict(sd, **{"layers.9.mlp.weight": torch.zeros(3)})
    with pytest.raises(wl.Error, match="'layers.9.mlp.weight' is not a parameter"):
        server.register_checkpoint("a", "tiny", named_tensors=extra)
    f64 = dict(sd, **{"embed.weight": sd["embed.weight"].double()})
    with pytest.raises(wl.Error, match="tensor 'embed.weight' is torch.float64"):
        server.register_checkpoint("a", "tiny", named_tensors=f64)
    with pytest.raises(wl.Error, match="exactly one"):
        server.register_checkpoint("a", "tiny", named_tensors=sd, files=["x"])
    with pytest.raises(wl.Error, match="no-such-preset"):
        server.register_checkpoint("a", "no-such-preset", named_tensors=sd)
    assert server.checkpoints == []
    server.register_checkpoint("a", "tiny", named_tensors=sd)
    with pytest.raises(wl.Error, match="InvalidArgument"):
        server.register_checkpoint("a", "tiny", named_tensors=sd)  # taken
    with pytest.raises(wl.Error, match="NotFound"):
        server.refresh("b", sd)
    with pytest.raises(wl.Error, match="NotFound"):
        server.unregister("b")
    with pytest.raises(wl.Error, match="NotFound"):
        server.update("b")
    with pytest.raises(wl.Error, match="DeadlineExceeded: 0 of 1 receivers"):
        server.wait_for_receivers(1, timeout=0.2)
    server.unregister("a")
    assert server.checkpoints == []


def test_a_layout_specs_checkpoint_and_receiver_are_checked(job):
    """Another model's state dict by its layout spec: the same refusals, naming the tensor and
    the layout; a model and a layout, or files with a layout, are refused before anything."""
    server = wl.ParameterServer(job)
    sd = TinyLlama().state_dict()
    spec = llama_spec(sd, layers=2, head_dim=8)
    with pytest.raises(wl.Error, match="a model or a layout, exactly one"):
        server.register_checkpoint("a", "tiny", layout=spec, named_tensors=sd)
    with pytest.raises(wl.Error, match="a model or a layout, exactly one"):
        server.register_checkpoint("a", named_tensors=sd)
    wrong = dict(sd, **{"model.embed_tokens.weight": torch.zeros(3)})
    with pytest.raises(wl.Error, match=r"'model.embed_tokens.weight' has shape \[3\]; "
                                       r"layout 'tiny-llama''s is \[50, 32\]"):
        server.register_checkpoint("a", layout=spec, named_tensors=wrong)
    odd = llama_spec(sd, layers=2, head_dim=12)
    with pytest.raises(wl.Error, match="register_checkpoint 'a'.*qkv_proj"):
        server.register_checkpoint("a", layout=odd, named_tensors=sd)
    with pytest.raises(wl.Error, match="layout spec"):
        server.register_checkpoint("a", layout="{not json", named_tensors=sd)
    assert server.checkpoints == []
    server.register_checkpoint("a", layout=spec.to_json(), named_tensors=sd)
    server.refresh("a", {n: t.to(torch.bfloat16) for n, t in sd.items()})
    with pytest.raises(wl.Error, match="'model.embed_tokens.weight' is missing"):
        server.refresh("a", {n: t for n, t in sd.items() if "embed" not in n})
    with pytest.raises(wl.Error, match="a model or a layout, exactly one"):
        wl.Receiver(job, id=0, model="tiny", layout=spec)
    with pytest.raises(wl.Error, match="a model or a layout, exactly one"):
        wl.Receiver(job, id=0)
    server.unregister("a")


def test_a_layout_specs_checkpoint_from_safetensors_files(job, tmp_path):
    """A Hugging Face style checkpoint split over two files, read by the layout's names."""
    server = wl.ParameterServer(job)
    sd = TinyLlama().state_dict()
    spec = llama_spec(sd, layers=2, head_dim=8)
    names = sorted(sd)
    first, second = tmp_path / "model-00001.safetensors", tmp_path / "model-00002.safetensors"
    write_safetensors(first, {n: sd[n] for n in names[::2]})
    write_safetensors(second, {n: sd[n] for n in names[1::2]})
    with pytest.raises(wl.Error, match=f"no file holds tensor '{names[1]}' of layout"):
        server.register_checkpoint("hf", layout=spec, files=[first])
    with pytest.raises(wl.Error, match=f"tensor '{names[0]}' is in both"):
        server.register_checkpoint("hf", layout=spec, files=[first, second, first])
    assert server.checkpoints == []
    server.register_checkpoint("hf", layout=spec, files=[first, second])
    assert server.checkpoints == ["hf"]


def test_pytorch_sync_example(tmp_path):
    """examples/pytorch_sync: a plain PyTorch trainer pushes every step to a rollout process
    holding the weights in bf16 and one attached to a sidecar holding them in fp8; each checks
    every version against what the trainer saved it sent, and generates."""
    example = os.path.join(HERE, "..", "..", "examples", "pytorch_sync", "run.py")
    r = subprocess.run([EXE, "launch", "-n", "3", "--", sys.executable, example,
                        "--steps", "8", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    for v in range(1, 9):
        assert f"rollout 1: version {v} checked, bf16, exact" in r.stdout, r.stdout
        assert f"rollout 2: version {v} checked, fp8 (8 matrices)" in r.stdout, r.stdout
    losses = [float(line.split(" loss ")[1].split(",")[0])
              for line in r.stdout.splitlines() if "trainer: step" in line]
    assert len(losses) == 8 and losses[-1] < losses[0], losses


def write_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name, t in tensors.items():
        b = t.numpy().astype(np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_register_checkpoint_from_files(job, tmp_path):
    server = wl.ParameterServer(job)
    path = tmp_path / "model.safetensors"
    write_safetensors(path, state_dict())
    server.register_checkpoint("from-file", "tiny", files=[path])
    assert server.checkpoints == ["from-file"]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(wl.Error, match="model.safetensors"):
        server.register_checkpoint("truncated", "tiny", files=[path])


def test_receiver_tensors_and_the_gil_released_while_it_waits(job):
    receiver = wl.Receiver(job, id=0, model="tiny", heal=False)
    assert receiver.version == 0
    specs = receiver.tensors
    assert specs["layers.0.attn.qkv_proj.weight"][0] == "BF16"
    with receiver.acquire() as w:
        assert w.version == 0
        t = w["embed.weight"]
        assert list(t.shape) == specs["embed.weight"][1] and t.dtype == torch.bfloat16
        lo, hi = receiver.memory_range()
        assert lo <= t.data_ptr() < hi
        with pytest.raises(KeyError):
            w["no.such.tensor"]
        assert isinstance(w, collections.abc.Mapping)
        assert len(w) == len(specs) and set(w) == set(specs) and "embed.weight" in w
        assert dict(w.items()).keys() == specs.keys()
    # Released: the version may be overwritten, so reading it is an error, not a crash.
    for read in (lambda: w.version, lambda: w["embed.weight"]):
        with pytest.raises(wl.Error, match="released"):
            read()
    w.release()  # twice is harmless
    ticks = []
    done = threading.Event()

    def tick():
        while not done.is_set():
            ticks.append(1)
            time.sleep(0.01)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        with pytest.raises(wl.Error, match="DeadlineExceeded"):
            receiver.serve_one(timeout=0.5)
    finally:
        done.set()
        ticker.join()
    assert len(ticks) > 10, "another thread could not run while serve_one waited"
    with pytest.raises(wl.Error, match="format 'fp16'"):
        wl.Receiver(job, id=1, model="tiny", format="fp16")
    receiver.leave()


class TinyLlama(torch.nn.Module):
    """A plain PyTorch model with Hugging Face's Llama names (not weightlift's model)."""

    def __init__(self, layers=2, d=32, heads=4, kv_heads=2, head_dim=8, ffn=48, vocab=50):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(vocab, d)
        self.model.layers = torch.nn.ModuleList()
        for _ in range(layers):
            layer = torch.nn.Module()
            layer.self_attn = torch.nn.Module()
            layer.self_attn.q_proj = torch.nn.Linear(d, heads * head_dim, bias=False)
            layer.self_attn.k_proj = torch.nn.Linear(d, kv_heads * head_dim, bias=False)
            layer.self_attn.v_proj = torch.nn.Linear(d, kv_heads * head_dim, bias=False)
            layer.self_attn.o_proj = torch.nn.Linear(heads * head_dim, d, bias=False)
            layer.mlp = torch.nn.Module()
            layer.mlp.gate_proj = torch.nn.Linear(d, ffn, bias=False)
            layer.mlp.up_proj = torch.nn.Linear(d, ffn, bias=False)
            layer.mlp.down_proj = torch.nn.Linear(ffn, d, bias=False)
            self.model.layers.append(layer)


def llama_spec(sd, layers, head_dim, dtype="bf16"):
    spec = wl.LayoutSpec("tiny-llama").params_from(sd)
    spec.tensor("model.embed_tokens.weight")
    for l in range(layers):
        p = f"model.layers.{l}."
        spec.tensor(p + "self_attn.qkv_proj.weight",
                    [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                     p + "self_attn.v_proj.weight"], split="heads", head_dim=head_dim,
                    dtype=dtype)
        spec.tensor(p + "self_attn.o_proj.weight", split="row", dtype=dtype)
        spec.tensor(p + "mlp.gate_up_proj.weight",
                    [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], split="column",
                    dtype=dtype)
        spec.tensor(p + "mlp.down_proj.weight", split="row", dtype=dtype)
    return spec


def test_layout_spec_of_a_plain_pytorch_model():
    sd = TinyLlama().state_dict()
    spec = llama_spec(sd, layers=2, head_dim=8)
    lay = {t.name: t for t in spec.layout(tp=2, tp_rank=1)}
    qkv = lay["model.layers.1.self_attn.qkv_proj.weight"]
    assert (qkv.dtype, qkv.shape) == ("BF16", [32, 32])  # 2 q heads + 1 k + 1 v head of 8
    assert [s[:3] for s in qkv.sources] == [("model.layers.1.self_attn.q_proj.weight", 16, 32),
                                            ("model.layers.1.self_attn.k_proj.weight", 8, 16),
                                            ("model.layers.1.self_attn.v_proj.weight", 8, 16)]
    assert lay["model.layers.0.mlp.down_proj.weight"].sources[0][3:5] == (24, 48)
    assert lay["model.embed_tokens.weight"].shape == [50, 32]
    fp8 = {t.name: t for t in llama_spec(sd, 2, 8, dtype="fp8").layout(tp=1)}
    assert fp8["model.layers.0.self_attn.o_proj.weight.scale"].shape == [1, 1]
    again = wl.LayoutSpec.from_json(spec.to_json())
    assert [t.name for t in again.layout(tp=2, tp_rank=0)] == \
        [t.name for t in spec.layout(tp=2, tp_rank=0)]


@pytest.mark.parametrize("edit, needle", [
    (lambda s: s.tensor("x", ["nope"]), "tensor 'x': source 'nope' is not among"),
    (lambda s: s.tensor("y", ["model.layers.0.self_attn.q_proj.weight",
                              "model.layers.0.mlp.down_proj.weight"]),
     "sources do not concatenate along dim 0"),
    (lambda s: s.tensor("z", ["model.layers.0.self_attn.k_proj.weight"], split="heads",
                        head_dim=8), "has 2 heads, neither a multiple nor a divisor of tp 3"),
])
def test_wrong_layout_specs_raise_naming_the_tensor(edit, needle):
    sd = TinyLlama().state_dict()
    spec = wl.LayoutSpec("bad").params_from(sd)
    edit(spec)
    with pytest.raises(wl.Error, match=needle):
        spec.layout(tp=3 if "tp 3" in needle else 1)
    with pytest.raises(ValueError, match="split 'diagonal'"):
        spec.tensor("w", split="diagonal")
