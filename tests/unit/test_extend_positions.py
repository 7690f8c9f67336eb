"""ForwardBatch positions: the vectorized computation equals the per-request aranges."""

from __future__ import annotations

import torch

from radixlm.runtime.model_executor.forward_batch import extend_positions


def test_extend_positions_matches_per_request_aranges() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        bs = int(torch.randint(1, 9, (1,), generator=gen))
        prefix = torch.randint(0, 50, (bs,), generator=gen)
        seq = prefix + torch.randint(0, 6, (bs,), generator=gen)          # zero-length extends included
        expected = torch.cat([torch.arange(int(p), int(s)) for p, s in zip(prefix, seq)])
        assert extend_positions(prefix, seq).tolist() == expected.tolist()
