"""The Llama-family decoder (Llama, Mistral; Qwen2 and Qwen3 are option presets in their own files).

    embed_tokens -> N x [x += attn(norm(x)); x += mlp(norm(x))] -> norm -> (lm_head in compute_logits)

Layers pass the residual stream along SGLang style: each RMSNorm takes (x, residual), adds them and
norms the sum, so on CPU the add fuses into the norm (kernels/cpu_ops); the rounding equals HF's.

Attention: fused qkv projection, optional per-head q/k RMSNorm (Qwen3), rope, RadixAttention over
the paged KV cache (a sliding window on the layers the config names: Mistral, Qwen2/3 with
use_sliding_window), row-parallel o_proj. Checkpoint names (q/k/v_proj, gate/up_proj) are remapped
onto the fused parameters in `load_weights`; `forward` is plain PyTorch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.parallel_state import get_tp_size
from ..layers.activation import SiluAndMul
from ..layers.attention.base import RadixAttention
from ..layers.layernorm import RMSNorm
from ..layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from ..layers.moe import MoEOptions, SparseMoeBlock
from ..layers.packed_linear import linear_silu_mul
from ..layers.rotary import RotaryEmbedding
from ..layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from ..model_executor.forward_batch import ForwardBatch
from .model_config import ModelConfig, ModelLoadError

logger = logging.getLogger(__name__)

# checkpoint name piece -> (fused parameter name piece, shard id)
STACKED_PARAMS: dict[str, tuple[str, object]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
SHARDS_PER_FUSED = {"qkv_proj": 3, "gate_up_proj": 2}


@dataclass(frozen=True)
class LlamaOptions:
    """The few ways the Llama-family models differ."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False      # RMSNorm over head_dim on q and k before rope (Qwen3)
    qk_norm_full: bool = False  # RMSNorm over the whole q and k projections instead (OLMo 2; TP=1)
    post_norms: bool = False   # x += norm(attn(x)); x += norm(mlp(x)), no input norm (OLMo 2)
    sandwich_norms: bool = False  # post_norms plus the input norms before attn and mlp (Gemma 3)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), in the model dtype (Gemma)
    moe: MoEOptions | None = None  # experts replace the MLP on moe.sparse_layers (models/moe.py)


class GeluTanhAndMul(nn.Module):
    """x: [..., 2*d] laid out [gate | up]; gelu(gate, tanh approximation) * up (GeGLU, Gemma)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


GATED_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, bias: bool):
        super().__init__()
        self.act = config.hidden_act
        if self.act not in GATED_ACTIVATIONS:
            raise ModelLoadError(f"Unsupported hidden_act {self.act!r}; supported: {', '.join(GATED_ACTIVATIONS)}")
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias)
        self.act_fn = GATED_ACTIVATIONS[self.act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = linear_silu_mul(x, self.gate_up_proj) if self.act == "silu" else None   # fused where it applies
        return self.down_proj(self.act_fn(self.gate_up_proj(x)) if h is None else h)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, options: LlamaOptions, layer_id: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        head_dim = config.head_dim
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_heads, config.num_kv_heads,
                                          bias=options.qkv_bias)
        self.o_proj = RowParallelLinear(config.num_heads * head_dim, config.hidden_size, bias=options.o_bias)
        if options.qk_norm_full and get_tp_size() > 1:
            raise ModelLoadError("q/k norm over the whole projection (OLMo 2) needs tensor parallel size 1")
        self.qk_norm_full = options.qk_norm_full
        q_dim, k_dim = (self.qkv_proj.q_size, self.qkv_proj.kv_size) if options.qk_norm_full else (head_dim, head_dim)
        has_norm = options.qk_norm or options.qk_norm_full
        self.q_norm = RMSNorm(q_dim, config.rms_norm_eps) if has_norm else None
        self.k_norm = RMSNorm(k_dim, config.rms_norm_eps) if has_norm else None
        self.rotary_emb = rotary_emb  # shared by every layer
        self.attn = RadixAttention(layer_id, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim,
                                   scaling=(config.query_pre_attn_scalar or head_dim) ** -0.5,
                                   sliding_window_size=config.sliding_window_size(layer_id),
                                   logit_cap=config.attn_logit_softcapping or 0.0)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [n, hidden] -> [n, hidden], or [len(keep), hidden]: o_proj of the rows `keep` only
        (every row's K/V is still written and attended over)."""
        # q: [n, heads*head_dim]; k, v: [n, kv_heads*head_dim] (this rank's heads)
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(hidden))
        if self.qk_norm_full:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        elif self.q_norm is not None:
            q = self._norm_per_head(q, self.q_norm)
            k = self._norm_per_head(k, self.k_norm)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, fb)
        return self.o_proj(out if keep is None else out[keep])

    def _norm_per_head(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return norm(x.reshape(x.shape[0], -1, self.head_dim)).reshape(x.shape)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, options: LlamaOptions, layer_id: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttention(config, options, layer_id, rotary_emb)
        moe = options.moe
        self.mlp = (SparseMoeBlock(config.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size,
                                   moe.renormalize, moe.shared_intermediate_size)
                    if moe is not None and layer_id in moe.sparse_layers else LlamaMLP(config, options.mlp_bias))
        self.post_norms = options.post_norms or options.sandwich_norms
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps)  # noqa: E731
        self.input_layernorm = None if options.post_norms else norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm() if options.sandwich_norms else None
        self.post_feedforward_layernorm = norm() if self.post_norms else None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch,
                residual: torch.Tensor | None, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream before it): the next layer adds them; with `keep`
        (the last layer, ForwardBatch.output_rows) for those rows only. May overwrite `hidden` and
        `residual` in place (the fused norm)."""
        if self.post_norms:
            x = hidden if residual is None else hidden + residual   # the residual stream
            h = x if self.input_layernorm is None else self.input_layernorm(x)
            x = (x if keep is None else x[keep]) + self.post_attention_layernorm(self.self_attn(positions, h, fb, keep))
            h = x if self.pre_feedforward_layernorm is None else self.pre_feedforward_layernorm(x)
            return self.post_feedforward_layernorm(self.mlp(h)), x
        if residual is None:                       # first layer: the residual stream is the embedding
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, fb, keep)
        if keep is not None:
            residual = residual[keep]
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, options: LlamaOptions):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size ** 0.5 if options.embed_scale else None
        rotary_emb = RotaryEmbedding(config.head_dim, config.context_len, config.rope_theta, config.rope_scaling,
                                     config.rotary_dim)
        # Gemma 3: the sliding-window layers have their own (plain) rope base
        local = (RotaryEmbedding(config.head_dim, config.context_len, config.local_rope_theta)
                 if config.local_rope_theta is not None else rotary_emb)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, options, i, local if i in config.sliding_window_layers else rotary_emb)
            for i in range(config.num_layers)
        )
        self.ropes = (rotary_emb,) if local is rotary_emb else (rotary_emb, local)   # not submodules: layers own them
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def dense_full_attention(self) -> bool:
        """Every layer is the plain pre-norm layer with full attention, a dense MLP and at most a
        per-head q/k norm: what the one-call CPU decoder runs."""
        return self.decoder_blocker() is None

    def decoder_blocker(self) -> str | None:
        """What keeps the one-call CPU decoder from running this model (None: nothing)."""
        if self.embed_scale is not None:
            return "embedding scaling (Gemma)"
        for layer in self.layers:
            if layer.self_attn.attn.sliding_window_size >= 0:
                return "sliding-window attention layers"
            if not isinstance(layer.mlp, (LlamaMLP, SparseMoeBlock)):
                return f"a {type(layer.mlp).__name__} MLP"
            if isinstance(layer.mlp, LlamaMLP) and layer.mlp.act != "silu":
                return f"a {layer.mlp.act} MLP"
            if layer.post_norms:
                return "post-attention / post-MLP norms"
            if layer.self_attn.qk_norm_full:
                return "a q/k norm over the whole projection"
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            for rope in self.ropes:
                rope.new_pass()
        hidden, residual = self.embed_tokens(input_ids), None
        if self.embed_scale is not None:
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, fb, residual, fb.output_rows if i == last else None)
        if residual is None:                       # no layers
            return self.norm(hidden if fb.output_rows is None else hidden[fb.output_rows])
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """`forward(input_ids [n], positions [n], forward_batch) -> hidden [n, hidden]` (final-normed; the
    rows `forward_batch.output_rows` only when it is set);
    `compute_logits(hidden [m, hidden]) -> [m, vocab] float32`."""

    @classmethod
    def options_for(cls, config: ModelConfig) -> LlamaOptions:
        return LlamaOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                            mlp_bias=config.mlp_bias)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.options_for(config))
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tied_to=tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, forward_batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies checkpoint tensors into the (fused, sharded) parameters.

        Returns the names of the parameters that are now fully loaded (a fused parameter counts
        once all its shards arrived). Unknown checkpoint names are logged and skipped.
        """
        params = dict(self.named_parameters())
        shards_seen: dict[str, set[object]] = {}
        for ckpt_name, tensor in weights:
            if "rotary_emb.inv_freq" in ckpt_name:
                continue
            if ckpt_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the lm head
            name, shard_id = remap_checkpoint_name(ckpt_name)
            param = params.get(name)
            if param is None:
                logger.warning("Skipping checkpoint tensor %s: the model has no such parameter", ckpt_name)
                continue
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor, shard_id)
            shards_seen.setdefault(name, set()).add(shard_id)
        return {name for name, seen in shards_seen.items() if len(seen) == _shards_needed(name)}


def remap_checkpoint_name(ckpt_name: str) -> tuple[str, object]:
    """'...self_attn.k_proj.weight' -> ('...self_attn.qkv_proj.weight', 'k'); others unchanged."""
    parts = ckpt_name.split(".")
    for i, part in enumerate(parts):
        if part in STACKED_PARAMS:
            fused, shard_id = STACKED_PARAMS[part]
            return ".".join([*parts[:i], fused, *parts[i + 1:]]), shard_id
    return ckpt_name, None


def _shards_needed(param_name: str) -> int:
    for fused, count in SHARDS_PER_FUSED.items():
        if f".{fused}." in param_name:
            return count
    return 1
