"""Count the collectives a step actually runs, and their bytes.

A dispatch mode (the technique of ``torch.distributed.tensor.debug.CommDebugMode``, which counts
calls only) that sees both kinds of collective PyTorch issues: the functional ones DTensor layers use
(``_c10d_functional.all_reduce`` ...) and the in-place ProcessGroup ones behind ``dist.all_reduce``
(flat groups, ZeRO, FSDP2, the vocabulary-parallel loss). Bytes are the payload per rank: the input
tensor's bytes for all-reduce / reduce-scatter / all-to-all, the output's for all-gather (what a
ring moves ~2(n-1)/n or (n-1)/n times; the factor is the reader's, the payload is measured).
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# op name (without namespace/overload) -> the kind it is counted under
KINDS = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "allreduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "all_to_all_single": "all_to_all", "alltoall_base_": "all_to_all", "alltoall_": "all_to_all",
    "broadcast": "broadcast", "broadcast_": "broadcast", "reduce_": "reduce",
    "send": "send", "recv_": "recv",  # point to point (pipeline stages, the parameter server's push and pull)
}


def _payload(namespace: str, kind: str, args, out):
    """The tensor(s) whose bytes count: all-gather's gathered output, the others' input."""
    if namespace == "c10d":  # ProcessGroup ops: (output, input, ...) for the out-of-place kinds
        return args[1] if kind in ("reduce_scatter", "all_to_all") else args[0]
    return out if kind == "all_gather" else args[0]  # functional ops: (input, ...) -> output


def _bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_bytes(t) for t in x)
    return 0


class CommCounter(TorchDispatchMode):
    """``with CommCounter() as c: ...`` then ``c.summary()``: {kind: {"count", "bytes"}} and the total."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
        self.max_call = 0  # the largest single call's payload (one collective buffer)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = KINDS.get(func._schema.name.split("::")[-1]) if func.namespace in ("_c10d_functional", "c10d") else None
        if kind is not None:
            rec = self.ops[kind]
            rec["count"] += 1
            payload = _bytes(_payload(func.namespace, kind, args, out))
            rec["bytes"] += payload
            self.max_call = max(self.max_call, payload)
        return out

    def summary(self) -> dict:
        ops = {k: dict(v) for k, v in sorted(self.ops.items())}
        return {"ops": ops, "bytes": sum(v["bytes"] for v in ops.values()),
                "count": sum(v["count"] for v in ops.values()), "max_call_bytes": self.max_call}
