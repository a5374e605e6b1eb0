"""A Llama-family decoder (Llama 2 and 3's architecture): RMSNorm before attention and before the MLP,
rotary position embeddings (RoPE), grouped-query attention (n_kv_head key/value heads shared by n_head query
heads), a SwiGLU MLP, no biases, an output head not tied to the embedding.

Shapes come from the config (model.n_layer, n_head, n_kv_head, n_embd, ffn_hidden, rope_theta, vocab_size);
the published ones are recipes (``llama3-8b``, ``llama3-70b``, ``llama3-405b``; ``llama-tiny`` trains on a CPU
in seconds). The layout of the weights and of RoPE (the two halves of each head rotated, as Hugging Face's
LlamaForCausalLM has them) is transformers' own: tests/unit/test_llama.py copies a LlamaForCausalLM's weights
in and gets its logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.init import draw_seed, init_params, place, standard_rules, unfilled


def ffn_hidden_for(n_embd: int, multiple_of: int = 256) -> int:
    """Llama's MLP width when none is given: 8/3 of the model width, rounded up to a multiple of 256."""
    return multiple_of * -(-(8 * n_embd // 3) // multiple_of)


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's rotation angles, (seq_len, head_dim): frequency i of the head's first
    half repeated for its second half."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    both = torch.cat([angles, angles], dim=-1)
    return both.cos(), both.sin()


def reset_rope(owner: nn.Module, device: torch.device | None = None) -> None:
    """Recompute ``owner``'s rope_cos/rope_sin buffers from its ``rope`` (head_dim, seq_len, theta), on ``device``
    (default: where they are): a Llama or a pipeline stage of one built on the meta device gets its tables here."""
    cos, sin = rope_tables(*owner.rope)
    device = device or owner.rope_cos.device
    owner.rope_cos, owner.rope_sin = cos.to(device), sin.to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's (first half, second half) pairs of ``x`` (batch, heads, T, head_dim) by position."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, n_kv_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, n_embd // n_head
        self.wq = nn.Linear(n_embd, n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(n_head * self.head_dim, n_embd, bias=False)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Heads counted from the projections' outputs (-1), not n_head: under tensor parallelism each rank
        # holds n_head / tp query heads and n_kv_head / tp key/value heads (parallel/tensor.py).
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if q.shape[1] != k.shape[1]:  # grouped-query attention: each key/value head serves a group
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, n_embd: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(n_embd, hidden, bias=False)  # gate
        self.w3 = nn.Linear(n_embd, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, n_embd, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, n_kv_head: int, hidden: int, eps: float, dropout: float) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(n_embd, eps=eps)
        self.attention = Attention(n_embd, n_head, n_kv_head, dropout)
        self.ffn_norm = nn.RMSNorm(n_embd, eps=eps)
        self.feed_forward = FeedForward(n_embd, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """``forward(idx) -> logits`` (batch, T, vocab) for token ids ``idx`` (batch, T), T <= seq_len."""

    fsdp_policy_casts = True  # under FSDP its mixed-precision policy alone casts (precision.policy_casts)

    def __init__(self, vocab_size: int, seq_len: int, n_layer: int, n_head: int, n_kv_head: int, n_embd: int,
                 ffn_hidden: int = 0, rope_theta: float = 10000.0, norm_eps: float = 1e-5,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.init_seed = draw_seed()  # every weight drawn by its name from it (models/init.py)
        with unfilled() as device:
            self.tok_embeddings = nn.Embedding(vocab_size, n_embd)
            self.layers = nn.ModuleList(Block(n_embd, n_head, n_kv_head or n_head,
                                              ffn_hidden or ffn_hidden_for(n_embd), norm_eps, dropout)
                                        for _ in range(n_layer))
            self.norm = nn.RMSNorm(n_embd, eps=norm_eps)
            self.output = nn.Linear(n_embd, vocab_size, bias=False)
        place(self, device)
        self.rope = (n_embd // n_head, seq_len, rope_theta)  # what the RoPE tables are computed from
        cos, sin = rope_tables(*self.rope)
        # Not in the state dict: rebuilt from the config, as the shapes are.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_rules = standard_rules(self)  # normal(0, 0.02) weights, norms one
        init_params(self, self.init_rules, self.init_seed)

    def reset_buffers(self, device: torch.device | None = None) -> None:
        """Recompute the RoPE tables (a model built on the meta device gets them here, models/init.py)."""
        reset_rope(self, device)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))
