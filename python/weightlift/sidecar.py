"""Attach an inference engine to a receiver sidecar (``weightlift receiver serve``): the weights
the parameter server pushes appear as read-only torch tensors viewing the sidecar's shared
memory, with no copy, and a pinned version never changes under the engine.

This module is plain Python (socket, mmap, json, torch) and imports nothing else of weightlift:
an engine without the compiled extension can take this one file. The protocol is in
docs/formats.md ("Receiver sidecar").

    import weightlift as wl
    sidecar = wl.attach("/tmp/receiver-0.sock")
    sidecar.wait_for_version(1, timeout=60)
    with sidecar.pin() as weights:                  # version weights.version, held still
        qkv = weights["layers.0.attn.qkv_proj.weight"]   # torch.bfloat16, no copy
        ...                                         # generate
    # unpinned: the next update may write where qkv pointed; do not keep it
"""
from __future__ import annotations

import json
import mmap
import os
import socket
import time
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

__all__ = ["attach", "Attached", "Pinned", "AttachError"]

FORMAT = "weightlift-sidecar"
FORMAT_VERSION = 1


class AttachError(RuntimeError):
    """The sidecar refused, went away, did not answer in time, or spoke another format."""


def attach(socket_path: str, timeout: float = 10.0) -> "Attached":
    """Connects to the sidecar at `socket_path` and maps its weights read-only."""
    return Attached(socket_path, timeout)


class Attached:
    """One engine's connection to a sidecar. Not thread-safe: one thread talks to it."""

    def __init__(self, socket_path: str, timeout: float = 10.0) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._buf = b""
        self._pinned: Optional[Pinned] = None
        self._timeout = timeout
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(socket_path)
            self._open(self._next_message(time.monotonic() + timeout))
        except (OSError, KeyError, TypeError, ValueError) as e:
            self._sock.close()
            raise AttachError(f"sidecar {socket_path}: {e!r}") from None
        except AttachError as e:
            self._sock.close()
            raise AttachError(f"sidecar {socket_path}: {e}") from None

    def _open(self, hello: Dict[str, Any]) -> None:
        if "error" in hello:
            raise AttachError(f"refused: {hello['error']}")
        if hello.get("format") != FORMAT or hello.get("format_version") != FORMAT_VERSION:
            raise AttachError(f"expected {FORMAT} version {FORMAT_VERSION}, got "
                              f"{hello.get('format')!r} version {hello.get('format_version')!r}:"
                              f" attach with the weightlift of the sidecar's build")
        self._version = int(hello["version"])
        self._slot_bytes = int(hello["slot_bytes"])
        self._tensors = {t["name"]: t for t in hello["tensors"]}
        fd = os.open("/dev/shm" + hello["shm"], os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, int(hello["bytes"]), prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    # ---- what the sidecar holds -------------------------------------------------------------
    @property
    def version(self) -> int:
        """The newest version the sidecar has announced (0: nothing received yet)."""
        self._drain()
        return self._version

    @property
    def tensors(self) -> Dict[str, Tuple[str, List[int]]]:
        """name -> (safetensors dtype, shape) of every tensor, in memory order."""
        return {n: (t["dtype"], list(t["shape"])) for n, t in self._tensors.items()}

    def memory_range(self) -> Tuple[int, int]:
        """[begin, end) of the addresses of the mapping every tensor views."""
        import numpy as np

        begin = np.frombuffer(self._map, dtype=np.uint8).ctypes.data
        return begin, begin + len(self._map)

    def wait_for_version(self, version: int, timeout: float = 60.0) -> int:
        """Waits until the sidecar holds `version` or later; returns the version."""
        end = time.monotonic() + timeout
        self._drain()
        while self._version < version:
            if time.monotonic() >= end:
                raise AttachError(f"DeadlineExceeded: version {version} did not arrive within "
                                  f"{timeout} s (the sidecar holds {self._version})")
            self._next_message(end)
        return self._version

    # ---- pinning ----------------------------------------------------------------------------
    def pin(self, timeout: float = 10.0) -> "Pinned":
        """Pins the newest version: no update writes its memory until release(). Holding it
        across two updates makes the second fail for this receiver at its timeout."""
        if self._pinned is not None:
            raise AttachError(f"version {self._pinned.version} is pinned already; release it "
                              f"first")
        reply = self._request("pin", "pinned", timeout)
        self._pinned = Pinned(self, int(reply["pinned"]), int(reply["slot"]))
        return self._pinned

    def close(self) -> None:
        """Closes the connection (the sidecar drops any pin) and the mapping."""
        self._pinned = None
        self._sock.close()
        try:
            self._map.close()
        except BufferError:
            pass  # tensors still view it; the mapping goes with the last of them

    def __enter__(self) -> "Attached":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- the socket -------------------------------------------------------------------------
    def _unpin(self, timeout: float = 10.0) -> None:
        try:
            self._request("unpin", "unpinned", timeout)
        finally:
            self._pinned = None

    def _tensor(self, name: str, slot: int) -> Any:
        import torch

        t = self._tensors.get(name)
        if t is None:
            raise KeyError(name)
        fp8 = getattr(torch, "float8_e4m3fn", torch.uint8)  # torch 1.13 has no fp8: the codes
        dtype = {"BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": fp8}.get(t["dtype"],
                                                                                torch.uint8)
        count = int(t["bytes"]) // torch.empty((), dtype=dtype).element_size()
        with warnings.catch_warnings():
            # The mapping is read-only, which torch cannot mark: writing kills the process.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self._map, dtype=dtype, count=count,
                                    offset=slot * self._slot_bytes + int(t["offset"]))
        return flat.view(t["shape"])

    def _request(self, what: str, answer: str, timeout: float) -> Dict[str, Any]:
        end = time.monotonic() + timeout
        self._check_open()
        try:
            self._sock.settimeout(timeout)
            self._sock.sendall(what.encode() + b"\n")
        except OSError as e:
            raise AttachError(f"sidecar: sending {what!r}: {e}") from None
        while True:
            try:
                m = self._next_message(end)
            except AttachError:
                # A late answer would be taken for the next request's, and a pin granted
                # meanwhile held by no one: closing the connection drops both.
                self._sock.close()
                raise
            if "error" in m:
                raise AttachError(f"sidecar refused {what!r}: {m['error']}")
            if answer in m:
                return m

    def _check_open(self) -> None:
        if self._sock.fileno() < 0:
            raise AttachError("the connection to the sidecar is closed (close(), or a request "
                              "that timed out)")

    def _drain(self) -> None:
        """Takes the version announcements already waiting, without blocking."""
        self._check_open()
        while True:
            line = self._take_line()
            if line is None:
                self._sock.setblocking(False)
                try:
                    chunk = self._sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError as e:
                    raise AttachError(f"sidecar: {e}") from None
                finally:
                    if self._sock.fileno() >= 0:
                        self._sock.settimeout(self._timeout)
                if not chunk:
                    raise AttachError("sidecar closed the connection")
                self._buf += chunk
                continue
            try:
                self._note(json.loads(line))
            except ValueError:
                raise AttachError(f"sidecar sent a line that is not JSON: {line[:60]!r}") from None

    def _take_line(self) -> Optional[bytes]:
        nl = self._buf.find(b"\n")
        if nl < 0:
            return None
        line, self._buf = self._buf[:nl], self._buf[nl + 1:]
        return line

    def _note(self, m: Dict[str, Any]) -> Dict[str, Any]:
        if "version" in m and "format" not in m:
            self._version = max(getattr(self, "_version", 0), int(m["version"]))
        return m

    def _next_message(self, deadline: float) -> Dict[str, Any]:
        while True:
            line = self._take_line()
            if line is not None:
                try:
                    return self._note(json.loads(line))
                except ValueError:
                    raise AttachError(f"sidecar sent a line that is not JSON: "
                                      f"{line[:60]!r}") from None
            left = deadline - time.monotonic()
            if left <= 0:
                raise AttachError("DeadlineExceeded: the sidecar did not answer in time")
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(65536)
            except socket.timeout:
                continue
            except OSError as e:
                raise AttachError(f"sidecar: {e}") from None
            if not chunk:
                raise AttachError("sidecar closed the connection")
            self._buf += chunk


class Pinned:
    """One pinned version: tensors by name, valid until release() (or the end of a `with`
    block). They view the sidecar's memory read-only; do not keep them past the release."""

    def __init__(self, owner: Attached, version: int, slot: int) -> None:
        self._owner: Optional[Attached] = owner
        self.version = version
        self._slot = slot

    def keys(self) -> Iterator[str]:
        return iter(self._live()._tensors)

    def __getitem__(self, name: str) -> Any:
        return self._live()._tensor(name, self._slot)

    def release(self) -> None:
        if self._owner is not None:
            owner, self._owner = self._owner, None
            owner._unpin()

    def _live(self) -> Attached:
        if self._owner is None:
            raise AttachError(f"version {self.version} was released")
        return self._owner

    def __enter__(self) -> "Pinned":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
