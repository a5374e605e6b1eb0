"""A small GPT: pre-norm transformer blocks, causal self-attention through scaled_dot_product_attention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.init import Rule, draw_seed, init_params, place, standard_rules, unfilled
from scaletrain.models.losses import linear_cross_entropy


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool = True) -> None:
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C)
        # chunk and -1 heads rather than C and n_head: under tensor parallelism this rank's qkv output holds
        # its n_head / tp heads of each of q, k and v (parallel/tensor.py)
        q, k, v = self.qkv(x).chunk(3, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads)
        q, k, v = (z.view(b, t, -1, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, -1)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool = True) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=bias), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd, bias=bias), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def embed(owner: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """The residual stream entering the first block (B, T, C) from token ids (B, T), by ``owner``'s tok_emb,
    pos_emb, drop and bf16_residual: a GPT, or the first stage of one (parallel/pipeline.py)."""
    pos = torch.arange(idx.shape[1], device=idx.device)
    x = owner.drop(owner.tok_emb(idx) + owner.pos_emb(pos))  # (B, T, C)
    if owner.bf16_residual and torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))  # the adds keep it: x + bf16 stays bf16
    return x


class GPT(nn.Module):
    """Token ids (B, T) -> next-token logits (B, T, vocab). The output head shares the token embedding.

    ``bias=False`` drops the biases of linears and layer norms (as nanoGPT's option and Llama do): a little
    faster and no worse; the default keeps them, so the default state_dict keys stay as they were.
    ``fused_loss``: ``model(idx, targets)`` returns ``{"loss": ...}``, the head and the cross-entropy computed
    together chunk by chunk (models.losses.linear_cross_entropy): the (B, T, vocab) logits are never kept.
    ``bf16_residual``: under bf16 autocast the residual stream between blocks is bf16 (autocast leaves it fp32,
    the embeddings being fp32), as FSDP's bf16 policy has it. Neither changes the parameters.
    """

    fsdp_policy_casts = True  # under FSDP its mixed-precision policy alone casts (precision.policy_casts)

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                 dropout: float = 0.0, bias: bool = True, *, fused_loss: bool = False, loss_chunk_rows: int = 8192,
                 bf16_residual: bool = False) -> None:
        super().__init__()
        self.block_size, self.fused_loss, self.bf16_residual = block_size, fused_loss, bf16_residual
        self.loss_chunk_rows = loss_chunk_rows  # rows of logits the fused loss forms at a time
        # GPT-2's weights: normal(0, 0.02), the residual projections scaled by 1/sqrt(2 * layers); each drawn by
        # its name from this seed (models/init.py), so a model built on the meta device and split gets the same
        self.init_seed = draw_seed()
        with unfilled() as device:
            self.tok_emb = nn.Embedding(vocab_size, n_embd)
            self.pos_emb = nn.Embedding(block_size, n_embd)
            self.drop = nn.Dropout(dropout)
            self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
            self.ln_f = nn.LayerNorm(n_embd, bias=bias)
            self.head = nn.Linear(n_embd, vocab_size, bias=False)
            self.head.weight = self.tok_emb.weight  # weight tying
        place(self, device)  # the tie kept
        self.init_rules = standard_rules(self)
        for name in self.init_rules:
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                self.init_rules[name] = Rule("normal", 0.02 / math.sqrt(2 * n_layer))
        init_params(self, self.init_rules, self.init_seed)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        """The logits (B, T, vocab); with ``fused_loss`` and ``targets`` (B, T), in training,
        ``{"loss": mean cross-entropy}`` instead (the trainer passes the targets then: scaletrain.batch.Batcher's
        target_kwarg). In eval mode the logits, for the loss and token accuracy."""
        if self.fused_loss and targets is not None and self.training:
            return {"loss": linear_cross_entropy(self.hidden(idx), self.head.weight, targets,
                                                 chunk_rows=self.loss_chunk_rows)}
        return self.head(self.hidden(idx))  # (B, T, vocab)

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """The final layer norm's output (B, T, C), what the head projects: for a loss fused with the head
        (models.losses.linear_cross_entropy(model.hidden(x), model.head.weight, y))."""
        x = embed(self, idx)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def flops_per_sample(self) -> float:
        """Training FLOPs (forward + backward) for one sequence of block_size tokens, PaLM's count: per token
        6 x parameters (the tied head counted once, position table excluded) + 12 x layers x T x C for attention."""
        n_params = sum(p.numel() for p in self.parameters()) - self.pos_emb.weight.numel()
        layers, c, t = len(self.blocks), self.tok_emb.embedding_dim, self.block_size
        return t * (6 * n_params + 12 * layers * t * c)
