"""Rotary position embedding (neox style: rotate the two halves of each head, as HF Llama does).

Supported `rope_type`s: "default", "linear", "llama3" (the Llama 3.1 frequency smoothing),
"freq_factors" (each frequency divided by its factor from `freq_factors`: a GGUF file's rope_freqs
tensor, which is how llama.cpp's converter stores Llama 3.1 scaling; runtime/models/gguf_config.py)
and "longrope" (Phi-3 "su"/LongRoPE: each frequency divided by its `short_factor` or `long_factor`,
cos and sin times the attention factor; `longrope_parameters` says which set and why).

`rotary_dim` (default head_dim; `partial_rotary_factor` * head_dim) is the part of each head that
is rotated: its first `rotary_dim` lanes, as two halves, the rest passed through (HF Phi-3).
The cos/sin table (rotary_dim/2 wide: both halves share one frequency) is computed once in
fp32 for every position up to `max_position`; `forward` gathers the rows of `positions` and
casts them to the activation dtype, as HF does. On CPU the fused C++ op (kernels/cpu_ops) rotates
q and k in place straight from the fp32 table, with the same rounding and no per-layer temporaries;
`forward_native` is the torch code, the fallback and the reference.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...kernels import cpu_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "longrope")


def default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """inv_freq[i] = base^(-2i/head_dim), i in [0, head_dim/2)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (base ** exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position: int) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths are divided by `factor`, short ones kept, the middle
    band interpolated smoothly between the two."""
    low_freq_wavelen = original_max_position / low_freq_factor
    high_freq_wavelen = original_max_position / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def longrope_parameters(rotary_dim: int, base: float, rope_scaling: dict, max_position: int
                        ) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention factor) of LongRoPE, as transformers' `_compute_longrope_parameters`:
    inv_freq[i] = 1 / (factor[i] * base^(2i/rotary_dim)); the attention factor is `attention_factor`
    when given, else sqrt(1 + ln(s) / ln(original)) with s = `factor` (ModelConfig sets it to
    max_position_embeddings / original_max_position_embeddings when config.json has none), 1 when s <= 1.

    Which factors: transformers switches per forward call on the sequence's length (long factors
    once it exceeds original_max_position_embeddings, recomputing the whole KV cache when a
    generation crosses it). Keys in a paged, shared radix cache cannot change under a request, so
    the choice is made once per server, as vLLM makes it: long factors when the served context
    (`max_position`, --context-length) exceeds original_max_position_embeddings, else short. Equal to
    transformers for every sequence when the context is at most the original length, and for
    sequences longer than it otherwise."""
    original = int(rope_scaling["original_max_position_embeddings"])
    key = "long_factor" if max_position > original else "short_factor"
    factors = torch.tensor([float(f) for f in rope_scaling[key]], dtype=torch.float32)
    if factors.numel() != rotary_dim // 2:
        raise ValueError(f"longrope {key} has {factors.numel()} values; rotary_dim {rotary_dim} needs {rotary_dim // 2}")
    shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (factors * base ** shape)
    attention = rope_scaling.get("attention_factor")
    if attention is None:
        factor = float(rope_scaling["factor"])
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq, float(attention)


def compute_inv_freq(head_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    """The inverse frequencies for `rope_scaling` (an HF rope-parameters dict, or None for default);
    `head_dim` is the rotated width. (LongRoPE: `longrope_parameters`.)"""
    inv_freq = default_inv_freq(head_dim, base)
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return llama3_inv_freq(inv_freq, float(rope_scaling["factor"]), float(rope_scaling["low_freq_factor"]),
                               float(rope_scaling["high_freq_factor"]),
                               int(rope_scaling["original_max_position_embeddings"]))
    if rope_type == "freq_factors":
        factors = torch.tensor([float(f) for f in rope_scaling["freq_factors"]], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"freq_factors has {factors.numel()} values; head_dim {head_dim} needs {inv_freq.numel()}")
        return inv_freq / factors
    raise ValueError(f"Unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies rope to flat q and k: `forward(positions, q, k) -> (q, k)`, shapes unchanged. The fused
    path rotates q and k in place and returns them; the torch path returns new tensors.
    The fused op (and the one-call decoder) take the rotated width from the table's: 2 * its columns."""

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None,
                 rotary_dim: int | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not (0 < self.rotary_dim <= head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim {head_dim}]")
        if (rope_scaling or {}).get("rope_type") == "longrope":
            inv_freq, attention = longrope_parameters(self.rotary_dim, base, rope_scaling, max_position)
        else:
            inv_freq, attention = compute_inv_freq(self.rotary_dim, base, rope_scaling), 1.0
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]          # [max_position, rotary_dim/2]
        cos, sin = freqs.cos(), freqs.sin()
        if attention != 1.0:                                    # HF: cos/sin * attention_scaling in fp32
            cos, sin = cos * attention, sin * attention
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        self._last: tuple | None = None     # (positions, its version, dtype, cos, sin) of this pass

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [n, heads*head_dim], k: [n, kv_heads*head_dim], positions: [n]
        if (q.dim() == 2 and k.dim() == 2 and self.cos_cache.dtype == torch.float32 and positions.dim() == 1
                and positions.dtype in (torch.int64, torch.int32) and positions.is_contiguous()
                and positions.device.type == "cpu" and self.cos_cache.device.type == "cpu" and cpu_ops.fits(q, k)):
            cpu_ops.call("rotary_embedding", positions, q, k, self.cos_cache, self.sin_cache, self.head_dim)
            return q, k
        return self.forward_native(positions, q, k)

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch code (new tensors, q and k unchanged)."""
        cos, sin = self._cos_sin(positions, q.dtype)                            # [n, 1, rotary_dim] each
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def new_pass(self) -> None:
        """Forgets the last pass's cos/sin: the model calls this at the start of every forward, so the
        reuse below never outlives one pass. (A CUDA graph replays no Python: a cos/sin kept from an
        earlier pass would be baked into the capture, and every replay would rotate by the capture's
        positions. Inference tensors have no version counter to notice an in-place refill either.)"""
        self._last = None

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of `positions`, both halves (rotary_dim wide), in `dtype`. Every layer of one forward
        pass passes the same `positions` tensor, so the gather is done once per pass (after `new_pass`)
        and reused by the other layers, unless `positions` changed in place (its version counter, where
        it has one). Side effect: keeps a reference to the last `positions`."""
        if torch.compiler.is_compiling():          # traced once; the compiler dedupes the gathers
            return self._gather(positions, dtype)
        last = self._last
        version = _version_of(positions)
        if last is not None and last[0] is positions and last[1:3] == (version, dtype):
            return last[3], last[4]
        cos, sin = self._gather(positions, dtype)
        self._last = (positions, version, dtype, cos, sin)
        return cos, sin

    def _gather(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_cache[positions].repeat(1, 2).to(dtype)[:, None, :]     # [n, 1, rotary_dim]
        sin = self.sin_cache[positions].repeat(1, 2).to(dtype)[:, None, :]
        return cos, sin

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shaped = x.view(x.shape[0], -1, self.head_dim)           # [n, heads, head_dim]
        if self.rotary_dim == self.head_dim:
            return (shaped * cos + rotate_half(shaped) * sin).view_as(x)
        rot, rest = shaped[..., :self.rotary_dim], shaped[..., self.rotary_dim:]
        return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1).view_as(x)


def _version_of(t: torch.Tensor) -> int | None:
    """The in-place version counter of `t` (None for inference tensors, which have none)."""
    return None if t.is_inference() else t._version
