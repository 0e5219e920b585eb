"""weightlift from Python: process groups and collectives on CPU tensors, and the weight
transfer engine's parameter server and receivers.

Every process of the job is started by a launcher that sets RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and WEIGHTLIFT_JOB_TOKEN (``weightlift launch -n 3 -- python3 script.py``; torchrun,
mpirun and srun work too, with the token exported). Rank 0 hosts the job's rendezvous store, so
it leaves last: ``job.close()`` waits for every rank first.

    import weightlift as wl
    job = wl.init()
    if job.rank == 0:                                  # the trainer serves its weights
        server = wl.ParameterServer(job)
        server.register_checkpoint("policy", model="tiny", named_tensors=model.state_dict())
        server.wait_for_receivers(job.size - 1)
        server.update("policy")                        # every receiver that joined gets it
    else:                                              # a rollout process receives them
        receiver = wl.Receiver(job, id=job.rank - 1, model="tiny")
        receiver.serve_one(timeout=60)
        with receiver.acquire() as weights:            # pinned: no update writes under it
            q = weights["layers.0.attn.qkv_proj.weight"]   # a torch.Tensor, no copy
    job.close()

An inference engine that should not link weightlift attaches to a receiver running as its own
process (``weightlift receiver serve --id 0 --socket /tmp/r0.sock``) with ``wl.attach(path)``
(weightlift/sidecar.py, plain Python).

Tensors are CPU torch tensors or numpy arrays, contiguous; nothing is copied on the way in or
out. Errors are raised as ``weightlift.Error`` whose message starts with the status code
("DeadlineExceeded: ..."). Every blocking call releases the GIL.
"""
from __future__ import annotations

import collections.abc
import itertools
import os
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from . import _native
from ._native import Error
from .layout import LayoutSpec, LayoutTensor
from .sidecar import Attached, AttachError, Pinned, attach

Error.__module__ = __name__  # tracebacks say weightlift.Error, the name users catch

__all__ = ["Error", "Job", "ProcessGroup", "ParameterServer", "Receiver", "Weights", "init",
           "parameters", "attach", "Attached", "AttachError", "Pinned", "LayoutSpec",
           "LayoutTensor"]

# safetensors spellings of the dtypes collectives and checkpoints take.
_TORCH_DTYPES = {
    "float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64", "int32": "I32",
    "uint8": "U8",
}
_NUMPY_DTYPES = {"float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32",
                 "uint8": "U8"}


def _buffer(x: Any, what: str, writable: bool) -> _native.Buffer:
    """(address, count, dtype, shape) of a contiguous CPU torch tensor or numpy array."""
    module = type(x).__module__
    if module.startswith("torch"):
        if x.device.type != "cpu":
            raise Error(f"InvalidArgument: {what} is on {x.device}; weightlift takes CPU tensors")
        if not x.is_contiguous():
            raise Error(f"InvalidArgument: {what} is not contiguous")
        name = str(x.dtype).replace("torch.", "")
        if name not in _TORCH_DTYPES:
            raise Error(f"InvalidArgument: {what} is {x.dtype}; expected one of "
                        f"{', '.join('torch.' + n for n in _TORCH_DTYPES)}")
        return _native.Buffer(x.data_ptr(), x.numel(), _TORCH_DTYPES[name], list(x.shape))
    if module == "numpy":
        if not x.flags.c_contiguous:
            raise Error(f"InvalidArgument: {what} is not C-contiguous")
        if writable and not x.flags.writeable:
            raise Error(f"InvalidArgument: {what} is read-only")
        name = str(x.dtype)
        if name not in _NUMPY_DTYPES:
            raise Error(f"InvalidArgument: {what} is {x.dtype}; expected one of "
                        f"{', '.join(_NUMPY_DTYPES)}")
        return _native.Buffer(x.ctypes.data, x.size, _NUMPY_DTYPES[name], list(x.shape))
    raise Error(f"InvalidArgument: {what} is a {type(x).__name__}; expected a torch.Tensor or "
                "a numpy.ndarray")


class Job:
    """This process's place in the job and the job's rendezvous store (`weightlift launch`
    hosts it; under another launcher, rank 0 does)."""

    def __init__(self, timeout: float = 60.0) -> None:
        self._native = _native.Job(timeout=timeout)
        self._timeout = timeout
        self._closes = itertools.count()

    @property
    def rank(self) -> int:
        return self._native.rank

    @property
    def size(self) -> int:
        return self._native.size

    @property
    def local_rank(self) -> int:
        return self._native.local_rank

    def process_group(self, name: str = "world", timeout: Optional[float] = None) -> ProcessGroup:
        """Every rank of the job connected for collectives (collective: every rank calls it
        with the same name)."""
        return ProcessGroup(self, name, self._timeout if timeout is None else timeout)

    def barrier(self, name: str, timeout: Optional[float] = None,
                ranks: Optional[int] = None) -> None:
        """Waits until every rank (or `ranks` of them) has reached the barrier `name`, through
        the store: no process group needed. Each name is used once."""
        self._native.wait_all(f"barrier/{name}", self._timeout if timeout is None else timeout,
                              ranks or 0)

    def close(self, timeout: Optional[float] = None, ranks: Optional[int] = None) -> None:
        """Waits until every rank (or `ranks` of them, when some have gone for good) has
        called close(): a store that rank 0 hosts then stays up until no rank needs it."""
        self._native.wait_all(f"close-{next(self._closes)}",
                              self._timeout if timeout is None else timeout, ranks or 0)


def parameters(model: str) -> List[Tuple[str, List[int]]]:
    """(name, shape) of every parameter of weightlift's model `model` (a preset name or a
    config.json path), in the order the model keeps them: the names a state dict given to
    ParameterServer.register_checkpoint must use."""
    return [(n, list(s)) for n, s in _native.parameters(model)]


def init(timeout: float = 60.0) -> Job:
    """The job this process belongs to, from the launcher's variables (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, WEIGHTLIFT_JOB_TOKEN). `timeout` bounds the rendezvous and is
    the default of every later wait."""
    return Job(timeout)


class ProcessGroup:
    """Collectives on CPU tensors, in place and without copies. `timeout` (seconds) bounds
    each call; 0 means the group's default."""

    def __init__(self, job: Job, name: str, timeout: float) -> None:
        self._job = job
        self._native = _native.ProcessGroup(job._native, timeout=timeout, name=name)

    @property
    def rank(self) -> int:
        return self._native.rank

    @property
    def size(self) -> int:
        return self._native.size

    def allreduce(self, tensor: Any, op: str = "sum", timeout: float = 0) -> None:
        """tensor := op over ranks of tensor (sum, prod, max, min, avg)."""
        self._native.allreduce(_buffer(tensor, "allreduce's tensor", True), op, timeout)

    def broadcast(self, tensor: Any, root: int = 0, timeout: float = 0) -> None:
        """tensor := root's tensor."""
        self._native.broadcast(_buffer(tensor, "broadcast's tensor", True), root, timeout)

    def allgather(self, output: Any, input: Any, timeout: float = 0) -> None:
        """output (size x input's elements) := every rank's input, in rank order."""
        self._native.allgather(_buffer(input, "allgather's input", False),
                               _buffer(output, "allgather's output", True), timeout)

    def barrier(self, timeout: float = 0) -> None:
        self._native.barrier(timeout)


def _named_buffers(named_tensors: Mapping[str, Any]) -> Dict[str, _native.Buffer]:
    out = {}
    for name, t in named_tensors.items():
        if type(t).__module__.startswith("torch"):
            t = t.detach()
        out[name] = _buffer(t, f"tensor '{name}'", False)
    return out


def _layout_json(layout: Any) -> str:
    """A LayoutSpec, its JSON text, or the path of a file holding it (os.PathLike), as JSON
    text."""
    if isinstance(layout, os.PathLike):
        with open(layout) as f:
            return f.read()
    return layout if isinstance(layout, str) else layout.to_json()


class ParameterServer:
    """Named checkpoints held by the server ranks and moved on request to the receivers that
    joined (the transfer engine's fleet). Every call is collective over the server ranks.

    A checkpoint is weightlift's own model (`model`: a preset name such as "tiny", or the path
    of a config.json; tensors named as `weightlift model-info` names them) or any other
    model's, described by a `layout` (a LayoutSpec, its JSON text, or a pathlib.Path to a
    file of it: which of your tensors each receiver tensor is made of). Tensors are f32 or
    bf16."""

    def __init__(self, job: Job, rank: int = 0, size: int = 1, mode: str = "p2p",
                 prefix: str = "fleet", timeout: Optional[float] = None,
                 shard_dtype: str = "F32") -> None:
        self._job = job
        self._native = _native.ParameterServer(
            job._native, rank=rank, size=size, mode=mode, prefix=prefix,
            timeout=job._timeout if timeout is None else timeout, shard_dtype=shard_dtype)

    def register_checkpoint(self, name: str, model: Optional[str] = None, *,
                            layout: Any = None, files: Optional[Sequence[str]] = None,
                            named_tensors: Optional[Mapping[str, Any]] = None,
                            model_dir: Optional[str] = None) -> None:
        """Holds checkpoint `name` of `model`, or of the model `layout` describes, from
        safetensors `files` (a Hugging Face checkpoint's, for a layout) or `named_tensors` (a
        state dict; its values are copied into the servers' shards). Another model's
        checkpoint moves in p2p mode only. `model_dir` alone: a Hugging Face checkpoint
        directory (Mixtral, Qwen3-MoE, Qwen3, Llama), its config and its weights; receivers
        hold it with ``Receiver(job, id, model=model_dir)``."""
        if model_dir is not None:
            if model is not None or layout is not None or files is not None or \
                    named_tensors is not None:
                raise Error("InvalidArgument: register_checkpoint takes model_dir alone")
            self._native.register_model_dir(name, str(model_dir))
            return
        if (model is None) == (layout is None):
            raise Error("InvalidArgument: register_checkpoint takes a model or a layout, "
                        "exactly one of them")
        if (files is None) == (named_tensors is None):
            raise Error("InvalidArgument: register_checkpoint takes files or named_tensors, "
                        "exactly one of them")
        if layout is not None and files is not None:
            self._native.register_layout_files(name, _layout_json(layout),
                                               [str(f) for f in files])
        elif layout is not None:
            self._native.register_layout_tensors(name, _layout_json(layout),
                                                 _named_buffers(named_tensors))
        elif files is not None:
            self._native.register_files(name, model, [str(f) for f in files])
        else:
            self._native.register_tensors(name, model, _named_buffers(named_tensors))

    def refresh(self, name: str, named_tensors: Mapping[str, Any]) -> None:
        """New values for checkpoint `name` (a training step happened); the next update sends
        them. Local to this server rank. Each tensor's rows of this rank's shards are copied
        straight from it (bf16 into bf16 shards is a memcpy; only a dtype that differs from
        `shard_dtype` is converted). A refused state dict (a tensor missing, unknown, of the
        wrong shape or dtype) leaves the held values as they were."""
        self._native.refresh(name, _named_buffers(named_tensors))

    def unregister(self, name: str) -> None:
        self._native.unregister(name)

    @property
    def checkpoints(self) -> List[str]:
        return self._native.checkpoints()

    def update(self, name: str, receivers: Optional[Sequence[int]] = None) -> Dict[str, Any]:
        """Moves checkpoint `name` to `receivers` (ids; None: every receiver that joined).
        Returns {"version", "round", "replay", "generation", "receivers", "dropped",
        "bytes", "seconds"} ("replay": 0 for an update posted in the store, n for the
        generation's n-th one sent over the receivers' group instead); raises if a receiver
        failed mid-update (every receiver then keeps its last complete version)."""
        return self._native.update(name, list(receivers or []))

    def wait_for_receivers(self, count: int, timeout: Optional[float] = None) -> List[int]:
        """Waits until `count` receivers have joined (an update before any has joined has no
        one to send to); returns the ids of those that have."""
        return self._native.wait_for_receivers(
            count, self._job._timeout if timeout is None else timeout)

    def serve_for(self, seconds: float) -> None:
        """Progresses the server between updates, so restarted receivers can heal from it."""
        self._native.serve_for(seconds)


class Weights(collections.abc.Mapping):
    """One version of a receiver's weights, pinned until release() (or the end of a `with`
    block) and until every tensor taken from it is gone: an update never writes under it.
    Holding a version past the next update makes the update after that wait, and fail at its
    timeout. A read mapping of tensor names to tensors (`in`, `len`, iteration, `items()`);
    reading it after release() raises weightlift.Error."""

    def __init__(self, native: _native.Weights, specs: Mapping[str, Tuple[str, List[int]]]):
        self._native = native
        self._specs = specs

    @property
    def version(self) -> int:
        return self._native.version

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __getitem__(self, name: str) -> Any:
        """Tensor `name` as a torch.Tensor viewing the receiver's memory (fp8 tensors as
        torch.uint8: torch 1.13 has no fp8 dtype)."""
        import torch

        if name not in self._specs:
            raise KeyError(name)
        dtype, shape = self._specs[name]
        torch_dtype = {"BF16": torch.bfloat16, "F32": torch.float32}.get(dtype, torch.uint8)
        view = self._native.view(name)
        return torch.frombuffer(view, dtype=torch_dtype).view(shape)

    def release(self) -> None:
        """Drops this object's pin (tensors taken from it keep theirs until they are gone)."""
        self._native.release()

    def __enter__(self) -> Weights:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class Receiver:
    """A rollout process's weights, received from the parameter server into double-buffered
    memory. Call serve_one() to take part in the next round (an update, or the forming of a
    new membership); read with acquire() from any thread meanwhile."""

    def __init__(self, job: Job, id: int, model: Optional[str] = None, format: str = "bf16",
                 prefix: str = "fleet", timeout: Optional[float] = None,
                 heal: bool = True, *, layout: Any = None) -> None:
        """Holds `model`'s inference layout (a preset, a config.json or a Hugging Face
        checkpoint directory), or what `layout` (a LayoutSpec or its JSON) makes of another
        model's tensors, in `format` (bf16, or fp8 for the tensors the layout marks fp8)."""
        if (model is None) == (layout is None):
            raise Error("InvalidArgument: a Receiver takes a model or a layout, exactly one")
        self._job = job
        self._native = _native.Receiver(
            job._native, id=id, model=model or "",
            layout="" if layout is None else _layout_json(layout), format=format, prefix=prefix,
            timeout=job._timeout if timeout is None else timeout, heal=heal)
        self._specs = {n: (d, list(s)) for n, d, s in self._native.tensors()}

    def serve_one(self, timeout: float = 30.0) -> Dict[str, Any]:
        """Handles the next round, waiting up to `timeout` seconds for it. Returns {"round",
        "replay", "kind", "took_part", "left_behind", "version"} ("left_behind": an update left
        this receiver out, for it missed an odd number of updates; a later one brings it the
        whole next version); raises weightlift.Error (DeadlineExceeded if no round came). A
        failed update raises and leaves the last complete version in place."""
        return self._native.serve_one(timeout)

    def wait_for_version(self, version: int, timeout: float = 60.0) -> int:
        """Serves rounds until the receiver holds `version` or later; returns the version."""
        import time

        end = time.monotonic() + timeout
        while self.version < version:
            left = end - time.monotonic()
            if left <= 0:
                raise Error(f"DeadlineExceeded: version {version} did not arrive within "
                            f"{timeout} s (holding {self.version})")
            self._native.serve_one(left)
        return self.version

    @property
    def version(self) -> int:
        """The last complete version (0: nothing received yet)."""
        return self._native.version

    @property
    def healed_version(self) -> int:
        return self._native.healed_version

    @property
    def tensors(self) -> Dict[str, Tuple[str, List[int]]]:
        """name -> (dtype, shape) of every tensor held."""
        return dict(self._specs)

    def memory_range(self) -> Tuple[int, int]:
        """[begin, end) of the receiver's buffers: every tensor acquire() gives lies inside."""
        return self._native.memory_range()

    def acquire(self) -> Weights:
        return Weights(self._native.acquire(), self._specs)

    def leave(self) -> None:
        """Tells the servers this receiver leaves; later updates do not name it."""
        self._native.leave()
