"""CompiledDecode: the decode forward under torch.compile, the CPU counterpart of CUDA graphs.

    decode = CompiledDecode(model, enabled=server_args.enable_torch_compile)
    hidden = decode(fb)            # only for ForwardMode.DECODE batches; eager when disabled

One `torch.compile(model.forward, dynamic=True)`: the batch dimension is symbolic, so one
compiled graph serves every batch size (batch 1 gets its own, as torch specializes sizes 0/1).
Inductor fuses the elementwise work between the matmuls (RMSNorm, residual adds, rotary,
SiLU*mul) into generated C++ loops; the paged attention kernels are registered custom ops, so the
graph stays whole. Compiling costs minutes on a 2-core machine, paid by the first decode pass of
each new batch-size class; each such pass logs its wall time. Extends (prefill) always run eager.
"""

from __future__ import annotations

import logging
import time

import torch

from .forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


class CompiledDecode:
    def __init__(self, model: torch.nn.Module, enabled: bool):
        """Wraps `model.forward`; compiles nothing until the first call."""
        self.model = model
        self.enabled = enabled
        if enabled:
            # round to the model dtype where eager would, inside fused kernels (bf16 tokens then
            # follow the eager path instead of drifting from it)
            import torch._inductor.config as inductor_config

            inductor_config.emulate_precision_casts = True
        self._fn = torch.compile(model.forward, dynamic=True) if enabled else None
        self._seen: set[bool] = set()          # batch-size classes run so far: (batch_size == 1)

    def __call__(self, fb: ForwardBatch) -> torch.Tensor:
        """hidden [bs, hidden] for a DECODE batch. Side effects: the model's forward side effects
        (K/V written at fb.out_cache_loc); the first call of a batch-size class compiles."""
        if self._fn is None:
            return self.model(fb.input_ids, fb.positions, fb)
        size_class = fb.batch_size == 1
        if size_class in self._seen:
            return self._fn(fb.input_ids, fb.positions, fb)
        start = time.perf_counter()
        hidden = self._fn(fb.input_ids, fb.positions, fb)
        self._seen.add(size_class)
        logger.info("torch.compile: first decode pass at batch %d took %.1f s (includes compiling)",
                    fb.batch_size, time.perf_counter() - start)
        return hidden
