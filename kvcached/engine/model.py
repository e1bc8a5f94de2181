"""A small decoder-only transformer whose results do not depend on where its KV came from.

The model (RMSNorm, rotary attention with grouped KV heads, gated-SiLU MLP)
has random weights drawn from a fixed seed: it exists to prove that a cached
prefix gives bitwise the same logits as a full recompute, not to say
anything sensible.

Exactness drives one choice: every position is computed on its own, with
the same tensor shapes whether it runs in a prefill, a decode step or a full
recompute. A batched prefill would be faster, but matrix-multiply kernels
pick different reduction orders for different batch sizes, so a token
computed in a chunk of 16 and the same token computed alone (during decode)
may differ in the last bit. Attention for position ``p`` always reads a
contiguous ``[n_kv_heads, p + 1, head_dim]`` K/V tensor from a ``KVStore``,
whatever filled it (a fresh computation, a GPU block, a swap-in).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvcached.layout import TORCH_DTYPES


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of the reference model; ``n_kv_heads`` counts the heads of all TP ranks."""

    vocab_size: int = 512
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 32
    ffn_dim: int = 256
    max_positions: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                     "head_dim", "ffn_dim", "max_positions"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                             f"({self.n_kv_heads}): each KV head serves a group of query heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    @classmethod
    def for_cache(cls, cfg, **overrides) -> ModelConfig:
        """The model whose KV fits ``cfg.layout`` on ``cfg.tp_size`` ranks."""
        if cfg.mla:
            raise ValueError("the reference model has K and V planes; mla=true is not supported")
        n_kv = cfg.num_kv_heads * cfg.tp_size
        base = dict(n_layers=cfg.num_layers, n_kv_heads=n_kv, n_heads=2 * n_kv,
                    head_dim=cfg.head_dim, dtype=cfg.dtype)
        return cls(**{**base, **overrides})

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]


class KVStore(Protocol):
    """Where attention keeps its keys and values: dense for recompute, paged for the engine."""

    def append(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V (``[n_kv_heads, head_dim]``, rotated K) of position ``pos``."""

    def keys_values(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K and V of positions ``0..length-1``: ``[n_kv_heads, length, head_dim]``."""


class DenseKV:
    """K/V of one sequence in growable contiguous buffers (no paging)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu",
                 capacity: int = 256):
        self.cfg = cfg
        shape = (cfg.n_layers, cfg.n_kv_heads, max(1, capacity), cfg.head_dim)
        self.k = torch.zeros(shape, dtype=cfg.torch_dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def _grow(self, need: int) -> None:
        cap = self.k.shape[2]
        if need <= cap:
            return
        new_cap = max(need, 2 * cap)  # doubling: O(1) amortized per position
        for name in ("k", "v"):
            old = getattr(self, name)
            buf = old.new_zeros((*old.shape[:2], new_cap, old.shape[3]))
            buf[:, :, :cap] = old
            setattr(self, name, buf)

    def append(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._grow(pos + 1)
        self.k[layer, :, pos] = k
        self.v[layer, :, pos] = v

    def load(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fill positions ``0..k.shape[1]-1`` of ``layer`` at once (a cached prefix)."""
        n = k.shape[1]
        self._grow(n)
        self.k[layer, :, :n] = k
        self.v[layer, :, :n] = v

    def keys_values(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        # .contiguous(): attention must see the same memory layout whatever the capacity.
        return (self.k[layer, :, :length].contiguous(),
                self.v[layer, :, :length].contiguous())


@dataclass(slots=True)
class Generation:
    """Greedy output: ``logits[i]`` is what chose ``tokens[i]``."""

    tokens: list[int]
    logits: torch.Tensor  # [len(tokens), vocab_size], float32 on CPU


class TinyTransformer:
    """The reference decoder. ``step`` computes one position; everything builds on it."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        self.group = cfg.n_heads // cfg.n_kv_heads  # query heads per KV head
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self._init_weights()
        self._init_rope()

    def _init_weights(self) -> None:
        """Gaussian weights scaled by 1/sqrt(fan_in), drawn in a fixed order from ``seed``."""
        c, g = self.cfg, torch.Generator().manual_seed(self.cfg.seed)

        def w(rows: int, cols: int) -> torch.Tensor:
            t = torch.randn(rows, cols, generator=g) / math.sqrt(rows)
            return t.to(self.device, c.torch_dtype)

        self.embed = (torch.randn(c.vocab_size, c.d_model, generator=g)
                      .to(self.device, c.torch_dtype))
        self.layers = []
        for _ in range(c.n_layers):
            self.layers.append({
                # Q, K and V in one matrix, gate and up in another: fewer, larger kernels.
                "wqkv": w(c.d_model, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim),
                "wo": w(c.n_heads * c.head_dim, c.d_model),
                "w_gate_up": w(c.d_model, 2 * c.ffn_dim),
                "w_down": w(c.ffn_dim, c.d_model),
                "norm1": torch.ones(c.d_model, dtype=c.torch_dtype, device=self.device),
                "norm2": torch.ones(c.d_model, dtype=c.torch_dtype, device=self.device),
            })
        self.norm_f = torch.ones(c.d_model, dtype=c.torch_dtype, device=self.device)
        self.lm_head = w(c.d_model, c.vocab_size)

    def _init_rope(self) -> None:
        c = self.cfg
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64)
                                      / c.head_dim))
        ang = torch.arange(c.max_positions, dtype=torch.float64)[:, None] * inv[None, :]
        self.cos = ang.cos().to(self.device, c.torch_dtype)
        self.sin = ang.sin().to(self.device, c.torch_dtype)

    # ------------------------------------------------------------- compute
    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps) * w

    def _rope(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        cos, sin = self.cos[pos], self.sin[pos]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One query position: q ``[n_kv_heads, group, hd]`` (the query heads that share
        a KV head), k/v ``[n_kv_heads, L, hd]``; returns ``[n_kv_heads, group, hd]``."""
        scores = torch.matmul(q, k.transpose(1, 2)) * self.scale
        if scores.dtype != torch.float32:  # softmax in fp32, as real kernels do
            return torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)
        return torch.matmul(torch.softmax(scores, dim=-1), v)

    def step(self, token: int, pos: int, kv: KVStore, logits: bool = True) -> torch.Tensor | None:
        """Compute position ``pos`` (token ``token``), store its K/V in ``kv``,
        and return its next-token logits (float32, ``[vocab]``) when asked."""
        c = self.cfg
        if not 0 <= pos < c.max_positions:
            raise ValueError(f"position {pos} is outside 0..{c.max_positions - 1} "
                             "(raise ModelConfig.max_positions)")
        if not 0 <= token < c.vocab_size:
            raise ValueError(f"token {token} is outside the vocabulary 0..{c.vocab_size - 1}")
        nq, nkv = c.n_heads, c.n_kv_heads
        x = self.embed[token].unsqueeze(0)  # [1, d_model]
        for i, lw in enumerate(self.layers):
            qkv = (self._norm(x, lw["norm1"]) @ lw["wqkv"]).view(nq + 2 * nkv, c.head_dim)
            qk = self._rope(qkv[:nq + nkv], pos)  # rotate Q and K in one go
            kv.append(i, pos, qk[nq:], qkv[nq + nkv:])
            keys, values = kv.keys_values(i, pos + 1)
            att = self._attention(qk[:nq].view(nkv, self.group, c.head_dim), keys, values)
            x = x + att.reshape(1, nq * c.head_dim) @ lw["wo"]
            gate, up = (self._norm(x, lw["norm2"]) @ lw["w_gate_up"]).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ lw["w_down"]
        if not logits:
            return None
        return (self._norm(x, self.norm_f) @ self.lm_head)[0].float()

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], start: int, kv: KVStore) -> torch.Tensor:
        """Compute positions ``start..len(tokens)-1``; K/V of earlier positions must
        already be in ``kv``. Returns the logits of the last position."""
        if not 0 <= start < len(tokens):
            raise ValueError(f"start must be in 0..{len(tokens) - 1}, got {start}")
        last = len(tokens) - 1
        for pos in range(start, last):
            self.step(int(tokens[pos]), pos, kv, logits=False)
        return self.step(int(tokens[last]), last, kv)

    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> Generation:
        """Greedy generation with a full recompute (no cache): the reference result."""
        if not prompt or max_new_tokens < 1:
            raise ValueError("generate needs a non-empty prompt and max_new_tokens >= 1")
        kv = DenseKV(self.cfg, self.device, capacity=len(prompt) + max_new_tokens)
        tokens = list(prompt)
        logits = self.forward(tokens, 0, kv)
        out, rows = [], []
        for i in range(max_new_tokens):
            tok = int(torch.argmax(logits))
            out.append(tok)
            rows.append(logits)
            if i + 1 < max_new_tokens:
                tokens.append(tok)
                logits = self.forward(tokens, len(tokens) - 1, kv)
        return Generation(out, torch.stack(rows).cpu())
