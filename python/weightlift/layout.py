"""Layout specs from Python: which trainer tensors every inference tensor is made of and how
tensor parallelism splits it (docs/formats.md, "Layout spec"; the C++ side is
transfer/layout/layout_spec.h, which checks a spec and builds it for a TP rank).

    import weightlift as wl
    spec = wl.LayoutSpec("my-llama").params_from(model.state_dict())
    for l in range(n_layers):
        p = f"model.layers.{l}."
        spec.tensor(p + "self_attn.qkv_proj.weight",
                    [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                     p + "self_attn.v_proj.weight"], split="heads", head_dim=64)
        ...
    spec.layout(tp=2, tp_rank=1)       # raises weightlift.Error naming a wrong tensor
    open("layout.json", "w").write(spec.to_json())
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from . import _native

__all__ = ["LayoutSpec", "LayoutTensor"]

SPLITS = ("replicated", "column", "row", "heads")


class LayoutTensor:
    """One receiver tensor of a built layout: its name, dtype (safetensors spelling), shape on
    this TP rank, and the source slices (source, row_begin, row_end, col_begin, col_end,
    dst_row) it is made of."""

    def __init__(self, name: str, dtype: str, shape: List[int],
                 sources: List[Tuple[str, int, int, int, int, int]]) -> None:
        self.name, self.dtype, self.shape, self.sources = name, dtype, list(shape), sources

    def __repr__(self) -> str:
        return f"LayoutTensor({self.name!r}, {self.dtype}, {self.shape})"


class LayoutSpec:
    """A layout spec being written: the trainer's tensors (params) and the receiver's tensors,
    in the engine's order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.params: Dict[str, List[int]] = {}
        self.tensors: List[Dict[str, Any]] = []

    def param(self, name: str, shape: Sequence[int]) -> "LayoutSpec":
        """Declares trainer tensor `name` of `shape` ([n] or [rows, cols])."""
        self.params[name] = [int(d) for d in shape]
        return self

    def params_from(self, named_tensors: Mapping[str, Any]) -> "LayoutSpec":
        """Declares every tensor of a state dict (anything with a .shape)."""
        for name, t in named_tensors.items():
            self.param(name, list(t.shape))
        return self

    def tensor(self, name: str, sources: Optional[Sequence[str]] = None, *,
               split: str = "replicated", head_dim: int = 0, dtype: str = "bf16",
               block: int = 128, expert: bool = False) -> "LayoutSpec":
        """Adds receiver tensor `name`: `sources` (default: [name]) concatenated along rows,
        split over TP ranks by `split` (replicated, column, row, or heads of `head_dim` rows),
        held as `dtype` (bf16, or fp8 e4m3 with `block` x `block` scales)."""
        if split not in SPLITS:
            raise ValueError(f"tensor {name!r}: split {split!r}: expected one of "
                             f"{', '.join(SPLITS)}")
        t: Dict[str, Any] = {"name": name, "sources": list(sources or [name]), "split": split,
                             "dtype": dtype}
        if split == "heads":
            t["head_dim"] = int(head_dim)
        if dtype == "fp8":
            t["block"] = int(block)
        if expert:
            t["expert"] = True
        self.tensors.append(t)
        return self

    def to_json(self) -> str:
        return json.dumps({"format": "weightlift-layout", "format_version": 1,
                           "name": self.name, "params": self.params, "tensors": self.tensors},
                          indent=1)

    @classmethod
    def from_json(cls, text: str) -> "LayoutSpec":
        """A spec written by to_json (or by hand); checked when it is built by layout()."""
        j = json.loads(text)
        spec = cls(j.get("name", ""))
        spec.params = {n: list(s) for n, s in j.get("params", {}).items()}
        spec.tensors = list(j.get("tensors", []))
        return spec

    def layout(self, tp: int = 1, tp_rank: int = 0) -> List[LayoutTensor]:
        """What TP rank `tp_rank` of `tp` holds under this spec; weightlift.Error naming the
        tensor for a wrong spec (a missing source, sources that do not concatenate, a split
        that does not divide)."""
        return [LayoutTensor(n, d, s, [tuple(x) for x in src])  # type: ignore[misc]
                for n, d, s, src in _native.spec_layout(self.to_json(), tp, tp_rank)]
