"""A loop of your own under scaletrain.session(): nanoGPT's GPT (Karpathy's model.py, abridged: attention,
MLP, block, weight tying, forward(idx, targets) -> (logits, loss)) and its training loop (AdamW with weight
decay on the matrices only, cosine LR with warmup computed in the loop, gradient clipping), on the bytes of a
few modules of this Python's own standard library. Nothing is downloaded.

    python examples/nanogpt_lm.py [--section.key=value ...]                       # one process
    torchrun --nproc_per_node 2 examples/nanogpt_lm.py [--section.key=value ...]  # two workers, by torchrun
    scaletrain launch --nproc 2 examples/nanogpt_lm.py [--section.key=value ...]  # the same, by scaletrain

The loop reads its knobs from the session's config, so the usual options reach it: --model.n_layer,
--model.n_head, --model.n_embd, --model.dropout, --data.seq_len (the block size), --data.batch_size (per
rank), --optim.lr (the peak), --optim.weight_decay, --optim.grad_clip, --schedule.warmup_steps,
--schedule.min_lr_ratio, --train.max_steps. The session gives every rank its shard of the windows, averages
the gradients (DDP; or shards the model, one unit per Block with the tied embedding in the root, under
--parallel.strategy=fsdp), checkpoints the model, the optimizer, the loader's position and every rank's RNG
every checkpoint.every steps, and resumes bit for bit when the same command runs again after a stop, under
DDP or FSDP whichever made the checkpoint. The run directory (default runs/nanogpt, runs/nanogpt-2, ...) gets
metrics.jsonl, summary.json and model.safetensors.
"""

import math
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import scaletrain
from scaletrain.data import TokenWindows

TRAIN_MODULES = ("argparse.py", "dataclasses.py", "functools.py", "difflib.py")  # about 280 KB of Python
HELD_OUT_MODULES = ("textwrap.py",)


# -- the model: nanoGPT's, abridged (no from_pretrained, no generate, no flops estimate) -------------------

@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 256  # bytes
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = False  # in the Linears and LayerNorms: GPT-2 has them; a little better and faster without


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v of all heads
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # batch, sequence length, embedding width
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        hs = C // self.n_head  # head size
        q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)  # flash attention where the device has it
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # the heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.vocab_size, config.n_embd),
            "wpe": nn.Embedding(config.block_size, config.n_embd),
            "drop": nn.Dropout(config.dropout),
            "h": nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            "ln_f": nn.LayerNorm(config.n_embd, bias=config.bias),
        })
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying: one matrix embeds and un-embeds
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor,
                targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, t = idx.size()
        assert t <= self.config.block_size, f"a sequence of {t} > block size {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)  # (t,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (b, t, n_embd)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:  # inference: only the last position's logits are needed
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)  # (b, t, vocab_size)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def configure_optimizers(params: list[nn.Parameter], weight_decay: float, lr: float,
                         betas: tuple[float, float]) -> torch.optim.AdamW:
    """nanoGPT's AdamW: weight decay on the matrices (Linear and Embedding weights), none on biases, norms."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


def get_lr(it: int, lr: float, warmup_iters: int, lr_decay_iters: int, min_lr: float) -> float:
    """nanoGPT's schedule: linear warmup, then cosine down to min_lr at lr_decay_iters (``it`` from 0)."""
    if it < warmup_iters:
        return lr * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # 1 -> 0
    return min_lr + coeff * (lr - min_lr)


# -- the data: this Python's own source, byte by byte -----------------------------------------------------

def stdlib_bytes(names: tuple[str, ...]) -> torch.Tensor:
    """The bytes of these standard-library modules (paths under the stdlib directory, not site-packages),
    joined by newlines: a 1-D uint8 tensor, one token per byte."""
    root = Path(sysconfig.get_paths()["stdlib"])
    text = b"\n".join((root / name).read_bytes() for name in names)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


@torch.no_grad()
def held_out_loss(model: nn.Module, data: TokenWindows, device: torch.device) -> float:
    """Mean loss per token over every window of ``data``. Every rank computes it on all of it: the same number
    everywhere, and the same forward passes (a DDP-wrapped model may sync buffers in forward)."""
    model.eval()
    total, count = 0.0, 0
    for x, y in torch.utils.data.DataLoader(data, batch_size=64):
        _, loss = model(x.to(device), y.to(device))
        total, count = total + loss.item() * x.shape[0], count + x.shape[0]
    model.train()
    return total / count


def main(argv: list[str]) -> None:
    config = {"run.name": "nanogpt", "train.max_steps": 300, "data.batch_size": 16, "data.seq_len": 64,
              "model.n_layer": 2, "model.n_head": 4, "model.n_embd": 64, "optim.lr": 3e-3,
              "optim.beta2": 0.95, "optim.weight_decay": 0.1, "optim.grad_clip": 1.0,
              "schedule.warmup_steps": 20, "schedule.min_lr_ratio": 0.1, "log.every": 25,
              "checkpoint.every": 100}
    with scaletrain.session(config, argv=argv) as st:
        c = st.cfg  # the resolved config: the defaults above, then the command line
        model_config = GPTConfig(block_size=c.data.seq_len, n_layer=c.model.n_layer, n_head=c.model.n_head,
                                 n_embd=c.model.n_embd, dropout=c.model.dropout)
        adamw = lambda params: configure_optimizers(params, c.optim.weight_decay, c.optim.lr,
                                                    (c.optim.beta1, c.optim.beta2))
        model, optimizer = st.setup(GPT(model_config), adamw, name="gpt")  # after the session: same init
        train = stdlib_bytes(TRAIN_MODULES)
        loader = st.loader(TokenWindows(train, c.data.seq_len, len(train)))  # windows of seq_len + 1 bytes
        while not st.done:
            for x, y in loader:  # (B, T) bytes and the same shifted by one
                with st.step():
                    lr = get_lr(st.steps, c.optim.lr, c.schedule.warmup_steps, c.train.max_steps,
                                c.optim.lr * c.schedule.min_lr_ratio)
                    for group in optimizer.param_groups:
                        group["lr"] = lr
                    with st.autocast():  # train.precision (fp32 unless --train.precision=bf16-mixed)
                        _, loss = model(x, y)
                    st.backward(loss)
                    st.optimizer_step(optimizer)  # clips to optim.grad_clip; a NaN step is not applied
                    optimizer.zero_grad(set_to_none=True)
                    st.log(loss=loss)
                if st.done:
                    break
        held_out = stdlib_bytes(HELD_OUT_MODULES)
        val = held_out_loss(model, TokenWindows(held_out, c.data.seq_len, len(held_out)), st.device)
        if st.rank == 0:
            print(f"nanogpt_lm: {st.steps} steps, train loss {st.last_metrics['loss']:.4f}, held-out loss "
                  f"{val:.4f} on {', '.join(HELD_OUT_MODULES)} ({val / math.log(2):.2f} bits per byte)")


if __name__ == "__main__":
    main(sys.argv[1:])
