"""RotaryEmbedding's torch path gathers cos/sin once per forward pass: reuse must never give stale values.
(The fused CPU op reads the fp32 table directly and caches nothing: tests/unit/test_cpu_fused_ops.py.)"""

from __future__ import annotations

import torch

from radixlm.runtime.layers.rotary import RotaryEmbedding


def test_cos_sin_reused_only_for_the_same_unchanged_positions() -> None:
    rope, fresh = RotaryEmbedding(64, 128, 10000.0), RotaryEmbedding(64, 128, 10000.0)
    q = torch.randn(3, 4 * 64, dtype=torch.bfloat16)
    k = torch.randn(3, 2 * 64, dtype=torch.bfloat16)
    pos = torch.tensor([3, 5, 7])
    first = rope.forward_native(pos, q, k)
    assert all(torch.equal(a, b) for a, b in zip(first, rope.forward_native(pos, q, k)))      # reused: same values
    pos.add_(1)                                                                 # in place: recomputed
    assert all(torch.equal(a, b) for a, b in zip(rope.forward_native(pos, q, k), fresh.forward_native(pos, q, k)))
    other = torch.tensor([0, 1, 2])                                             # another tensor: recomputed
    assert all(torch.equal(a, b) for a, b in zip(rope.forward_native(other, q, k), fresh.forward_native(other, q, k)))
    assert all(torch.equal(a, b) for a, b in zip(rope.forward_native(other, q.float(), k.float()), fresh.forward_native(other, q.float(), k.float())))
