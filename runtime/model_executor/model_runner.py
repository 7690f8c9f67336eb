"""ModelRunner: owns the model weights, the K/V buffers and the attention backend of one TP rank.

    runner = ModelRunner(server_args)
    fb = runner.make_forward_batch(mode, input_ids, rows, prefix_lens, seq_lens, out_cache_loc,
                                   req_to_token_pool)
    out = runner.forward(fb, extra_logit_rows)      # LogitsOutput

The runner sizes the KV pool (it knows the weights and the device memory) and holds the buffers;
the scheduler's KVManager owns every slot and the req->token table. The runner only computes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...kernels.cpu_amx import prepare_onednn_isa
from ...kernels.cpu_attention import load_cpu_attention
from ...kernels.cpu_build import planned_builds, start_builds
from ...kernels.cpu_decoder import load_cpu_decoder
from ...kernels.cpu_gemm import load_cpu_gemm
from ...kernels.cpu_moe import load_cpu_moe
from ...kernels.cpu_ops import load_cpu_ops
from ...kernels.cpu_quant import load_cpu_quant
from ..layers.attention.base import create_backend
from ..layers.moe_grouped import grouped_mm_supported
from ..layers.packed_linear import pack_linear_weights, packed_weight_bytes
from ..mem_cache.memory_pool import KVCache, ReqToTokenPool
from ..models.model_config import ModelConfig
from ..server_args import ServerArgs
from .compiled_decode import CompiledDecode
from .cpu_decoder import CpuDecoder
from .cuda_graph_runner import DEFAULT_MAX_BS as DEFAULT_GRAPH_MAX_BS
from .cuda_graph_runner import CudaGraphRunner
from .fast_paths import fast_paths
from .forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

CPU_KV_CAP_BYTES = 4 << 30       # never take more than this for KV on CPU by default
CPU_MAX_TOTAL_TOKENS = 1 << 18   # nor more slots than this
CPU_FULL_CONTEXT_REQS = 64       # nor more than this many requests at full context length
MAX_RUNNING_CAP = 256            # default --max-running-requests is at most this


@dataclass
class LogitsOutput:
    next_token_logits: torch.Tensor          # [bs, vocab] float32, at each request's last new token
    extra_logits: torch.Tensor | None        # [len(extra_logit_rows), vocab] float32


class ModelRunner:
    def __init__(self, server_args: ServerArgs, tp_rank: int = 0, dp_rank: int = 0):
        self.server_args = server_args
        self.tp_rank = tp_rank
        self.device = self._pick_device(dp_rank)
        torch.manual_seed(server_args.random_seed)
        self.model_config = ModelConfig.from_path(server_args.model_path, dtype=server_args.dtype,
                                                  context_length=server_args.context_length,
                                                  device=self.device.type,
                                                  overrides=server_args.model_overrides)
        self._init_distributed()
        from ..models.weight_loader import load_model

        if self.device.type == "cpu":
            prepare_onednn_isa()          # AMX tile permission (or oneDNN's ISA cap) before any matmul
            if self.tp_rank == 0:
                self._start_cpu_kernel_builds()
        self.model = load_model(self.model_config, self.device, disable_gguf_quant=server_args.disable_gguf_quant)
        if not (server_args.disable_packed_weights or server_args.enable_torch_compile):
            pack_linear_weights(self.model)
        self.dtype = self.model_config.dtype
        self.page_size = server_args.page_size
        self._init_memory()
        self.attn_backend = create_backend(
            self._pick_backend(), num_heads=self.num_local_heads, num_kv_heads=self.num_local_kv_heads,
            head_dim=self.model_config.head_dim, page_size=self.page_size, device=self.device, dtype=self.dtype,
            sliding_window_sizes=self._window_sizes(), logit_cap=self.model_config.attn_logit_softcapping or 0.0)
        self.decode_forward = self._pick_decode_forward()
        self.extend_forward = self._pick_extend_forward()
        self.graph_runner = self._make_graph_runner()

    def _start_cpu_kernel_builds(self) -> None:
        """Compiles the C++ CPU extensions this runner will load (the ones not cached yet), in parallel
        child processes while the weights load: a first start waits for about one build per core
        instead of one after another (kernels/cpu_build.py). Other tensor-parallel ranks
        wait on the same builds' locks."""
        args = self.server_args
        loaders: list[Callable[[], object]] = []   # what this process loads last goes first: it builds the
        if not (args.disable_cpu_decoder or args.enable_torch_compile):   # ones it needs before a child
            loaders.append(load_cpu_decoder)                               # has started them itself
        loaders.append(load_cpu_attention)
        if self.model_config.moe is not None:
            loaders.append(load_cpu_moe)
        if self.model_config.gguf_file and not args.disable_gguf_quant:
            loaders.append(load_cpu_quant)
        start_builds(planned_builds([*loaders, load_cpu_gemm, load_cpu_ops]))

    def _window_sizes(self) -> tuple[int, ...]:
        """The distinct sliding windows of the layers (FlashInfer plans one wrapper pair per window
        up front, so CUDA-graph capture finds them)."""
        cfg = self.model_config
        return tuple(sorted({w for w in (cfg.sliding_window_size(i) for i in range(cfg.num_layers)) if w >= 0}))

    def _pick_decode_forward(self) -> CompiledDecode | CpuDecoder:
        """torch.compile when asked for; on CPU the one-call C++ decoder where it applies; else eager."""
        args = self.server_args
        if args.enable_torch_compile:
            logger.info("torch.compile on: decode passes compile on first use of each batch-size class")
            return CompiledDecode(self.model, True)
        if self.device.type == "cpu" and not args.disable_cpu_decoder:
            decoder = CpuDecoder.create(self.model, self.kv_cache, self.attn_backend, args.tp_size)
            if decoder is not None:
                return decoder
        return CompiledDecode(self.model, False)

    def _pick_extend_forward(self) -> Callable[[ForwardBatch], torch.Tensor]:
        """Prefill, extend and mixed passes: the one-call C++ decoder where it takes them, else eager."""
        if isinstance(self.decode_forward, CpuDecoder) and self.decode_forward.takes_extend:
            return self.decode_forward.extend
        return lambda fb: self.model(fb.input_ids, fb.positions, fb)

    def _make_graph_runner(self) -> CudaGraphRunner | None:
        """CUDA graphs for decode: on CUDA with FlashInfer, unless --disable-cuda-graph or
        --enable-torch-compile, or for mixture-of-experts models without grouped matmuls (their layers
        then read per-expert counts on the host, which a graph cannot capture). Captures every bucket
        now (logged)."""
        args = self.server_args
        if self.device.type != "cuda" or args.disable_cuda_graph or args.enable_torch_compile:
            return None
        if self.model_config.moe is not None and not grouped_mm_supported(self.device, self.dtype):
            logger.info("CUDA graphs off: without grouped matmuls (bf16 on sm90+) mixture-of-experts layers "
                        "read per-expert counts on the host")
            return None
        from ..layers.attention.flashinfer_backend import FlashInferAttnBackend

        if not isinstance(self.attn_backend, FlashInferAttnBackend):
            return None
        max_bs = args.cuda_graph_max_bs or min(self.max_running_requests, DEFAULT_GRAPH_MAX_BS)
        return CudaGraphRunner(self.model, self.kv_cache, self.attn_backend, max_bs)

    # ------------------------------------------------------------- setup
    def _pick_device(self, dp_rank: int) -> torch.device:
        """CPU, or this scheduler's own GPU (`parallel_state.gpu_index`), made the current CUDA
        device before anything is allocated or NCCL starts."""
        args = self.server_args
        if args.device != "cuda":
            return torch.device(args.device)
        from ..distributed.parallel_state import gpu_index

        device = torch.device("cuda", gpu_index(dp_rank, self.tp_rank, args.tp_size,
                                                torch.cuda.device_count(), args.nnodes))
        torch.cuda.set_device(device)
        return device

    def _pick_backend(self) -> str:
        name = self.server_args.attention_backend
        if name == "flashinfer":
            from ..layers.attention.flashinfer_backend import flashinfer_unsupported_reason

            reason = flashinfer_unsupported_reason(self.model_config.head_dim, self.dtype)
            if reason:
                logger.warning("flashinfer cannot run this model (%s); using torch_native", reason)
                return "torch_native"
        return name

    def _init_distributed(self) -> None:
        from ..distributed import parallel_state as ps

        tp = self.server_args.tp_size
        cfg = self.model_config
        cfg.check_tp_size(tp)
        if tp > 1 and not ps.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            ps.init_tp_group(self.tp_rank, tp, backend, f"tcp://{self.server_args.dist_init_addr}")
        self.num_local_heads = cfg.num_heads // tp
        self.num_local_kv_heads = cfg.num_kv_heads_per_rank(tp)

    def _init_memory(self) -> None:
        """Sizes the KV pool and allocates the K/V buffers (page 0 reserved for padding writes)."""
        cfg, args = self.model_config, self.server_args
        self.context_len = cfg.context_len
        self.kv_bytes_per_token = KVCache.bytes_per_token(cfg.num_layers, self.num_local_kv_heads,
                                                          cfg.head_dim, self.dtype)
        total = args.max_total_tokens or self._profile_kv_tokens()
        self.num_pages = max(total // self.page_size, 2)
        self.max_total_tokens = self.num_pages * self.page_size
        self.max_running_requests = args.max_running_requests or min(
            MAX_RUNNING_CAP, max(self.max_total_tokens // 8, 4))
        start = time.perf_counter()
        self.kv_cache = KVCache(self.num_pages, self.page_size, cfg.num_layers, self.num_local_kv_heads,
                                cfg.head_dim, self.dtype, self.device)
        if self.device.type == "cpu":     # its size is in the server's "KV cache:" line
            logger.info("KV cache mapped in %.1f s (every page touched now, not in a forward pass)",
                        time.perf_counter() - start)

    def _profile_kv_tokens(self) -> int:
        """Default pool size: what memory allows, and no more than the model can use at once:
        max running requests x context length (by default 64 requests on CPU, 256 on CUDA)."""
        frac = self.server_args.mem_fraction_static
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        weight_bytes += packed_weight_bytes(self.model)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * frac - (total - free)
            tokens = int(budget // self.kv_bytes_per_token)
        else:
            avail = _available_ram_bytes()
            budget = min(avail * frac - weight_bytes, CPU_KV_CAP_BYTES)
            tokens = min(int(budget // self.kv_bytes_per_token), CPU_MAX_TOTAL_TOKENS)
        full_context_reqs = self.server_args.max_running_requests or (
            MAX_RUNNING_CAP if self.device.type == "cuda" else CPU_FULL_CONTEXT_REQS)
        tokens = min(tokens, full_context_reqs * self.context_len)
        if tokens < self.page_size * 16:
            raise RuntimeError(f"Not enough memory for the KV cache (room for {tokens} tokens). "
                               "Lower the context length or raise --mem-fraction-static / --max-total-tokens.")
        return tokens

    def info(self) -> dict:
        cfg = self.model_config
        return {
            "model_path": self.server_args.model_path, "tokenizer_path": self.server_args.tokenizer_path,
            "architecture": cfg.architecture, "context_len": self.context_len, "vocab_size": cfg.vocab_size,
            "max_total_tokens": self.max_total_tokens, "max_running_requests": self.max_running_requests,
            "page_size": self.page_size, "kv_bytes_per_token": self.kv_bytes_per_token,
            "eos_token_ids": list(cfg.eos_token_ids), "is_generation": True, "dtype": str(self.dtype),
            "device": str(self.device), "attention_backend": self.server_args.attention_backend,
            "max_concurrent_requests_at_context_len": self.max_total_tokens / self.context_len,
            "fast_paths": fast_paths(self),
        }

    # ----------------------------------------------------------- forward
    def make_forward_batch(self, mode: ForwardMode, input_ids: list[int], rows: list[int],
                           prefix_lens: list[int], seq_lens: list[int], out_cache_loc: torch.Tensor,
                           req_to_token_pool: ReqToTokenPool) -> ForwardBatch:
        """A ForwardBatch over this runner's K/V buffers; `req_to_token_pool` is only read."""
        fb = ForwardBatch.build(mode, input_ids, rows, prefix_lens, seq_lens, out_cache_loc,
                                req_to_token_pool, self.kv_cache, self.device)
        fb.attn_backend = self.attn_backend
        return fb

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, extra_logit_rows: list[int] | None = None) -> LogitsOutput:
        """Runs the model; returns logits at each request's last new token, plus at `extra_logit_rows`
        (flat token rows of this batch, for input logprobs). A prefill / extend pass computes the final
        hidden states of those rows only (ForwardBatch.output_rows)."""
        extra = extra_logit_rows or []
        rows = None                                                    # decode: one row per request already
        if not fb.forward_mode.is_decode or extra:
            rows = torch.tensor(fb.extend_lens_cpu + extra, device=self.device)
            rows[:fb.batch_size] = rows[:fb.batch_size].cumsum(0) - 1  # each request's last, then `extra`
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            hidden = self.graph_runner(fb)                             # [bs, hidden]; plans itself
        elif fb.forward_mode.is_decode:
            self.attn_backend.init_forward_metadata(fb)
            hidden = self.decode_forward(fb)                           # [bs, hidden]
        else:
            self.attn_backend.init_forward_metadata(fb)
            fb.output_rows = rows
            hidden = self.extend_forward(fb)                           # [len(rows), hidden]
        if rows is not None and fb.output_rows is None:
            hidden = hidden[rows]
        logits = self.model.compute_logits(hidden).float()
        if not extra:
            return LogitsOutput(logits, None)
        bs = fb.batch_size
        return LogitsOutput(logits[:bs], logits[bs:])


def _available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
