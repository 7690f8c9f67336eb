"""The tensor-parallel process group and the two collectives the model layers use.

Without `init_tp_group` (or with size 1) the rank is 0, the size is 1 and every collective is a
no-op, so single-device code never touches torch.distributed. One process holds one TP rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1
_TP_GROUP: dist.ProcessGroup | None = None
_CPU_GROUP: dist.ProcessGroup | None = None   # gloo group for Python objects (scheduler messages)


def gpu_index(dp_rank: int, tp_rank: int, tp_size: int, device_count: int, nnodes: int = 1) -> int:
    """The local GPU of one scheduler process: `dp_rank * tp_size + tp_rank`, so DP replicas and
    TP ranks each get their own GPU (with nnodes > 1, the TP ranks are split evenly over the nodes
    and the index counts this node's share). Raises ValueError when the machine has too few GPUs."""
    local_tp = max(tp_size // max(nnodes, 1), 1)
    index = dp_rank * local_tp + tp_rank % local_tp
    if index >= device_count:
        raise ValueError(f"Scheduler dp{dp_rank} tp{tp_rank} needs GPU {index}, but this machine has "
                         f"{device_count}; --dp-size x --tp-size (per node) must not exceed the GPU count")
    return index


def init_tp_group(rank: int, size: int, backend: str = "gloo", init_method: str = "env://") -> None:
    """Joins the TP group of `size` ranks (NCCL on CUDA, gloo on CPU). Call once per process; for
    NCCL, after `torch.cuda.set_device` (ModelRunner does it when it picks the GPU)."""
    global _TP_RANK, _TP_SIZE, _TP_GROUP
    if not 0 <= rank < size:
        raise ValueError(f"TP rank {rank} is outside [0, {size})")
    if size > 1:
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=size)
        _TP_GROUP = dist.group.WORLD
        global _CPU_GROUP
        _CPU_GROUP = _TP_GROUP if backend == "gloo" else dist.new_group(backend="gloo")
    _TP_RANK, _TP_SIZE = rank, size


def is_initialized() -> bool:
    return _TP_SIZE > 1 and dist.is_initialized()


def broadcast_objects(objs: list) -> list:
    """Rank 0's list of picklable objects, on every rank (identity at size 1)."""
    if _TP_SIZE == 1:
        return objs
    box = [objs if _TP_RANK == 0 else None]
    dist.broadcast_object_list(box, src=0, group=_CPU_GROUP)
    return box[0]


def destroy_tp_group() -> None:
    """Leaves the TP group; afterwards the process acts as a single rank again."""
    global _TP_RANK, _TP_SIZE, _TP_GROUP
    if _TP_GROUP is not None and dist.is_initialized():
        dist.destroy_process_group()
    global _CPU_GROUP
    _TP_RANK, _TP_SIZE, _TP_GROUP, _CPU_GROUP = 0, 1, None, None


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def _needs_fp32_transport(t: torch.Tensor) -> bool:
    # gloo does not reduce half-precision tensors everywhere; widen them for the wire.
    return t.device.type == "cpu" and t.dtype in (torch.float16, torch.bfloat16)


def tp_all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sums `t` over the TP ranks. Returns the reduced tensor (`t` itself, reduced in place)."""
    if _TP_SIZE == 1:
        return t
    if _needs_fp32_transport(t):
        wide = t.float()
        dist.all_reduce(wide, group=_TP_GROUP)
        t.copy_(wide)
        return t
    dist.all_reduce(t, group=_TP_GROUP)
    return t


def tp_all_gather(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenates every rank's `t` (same shape on all ranks) along `dim`, in rank order."""
    if _TP_SIZE == 1:
        return t
    send = t.float().contiguous() if _needs_fp32_transport(t) else t.contiguous()
    parts = [torch.empty_like(send) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, send, group=_TP_GROUP)
    return torch.cat(parts, dim=dim).to(t.dtype)
