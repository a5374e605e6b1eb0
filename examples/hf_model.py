"""A loop of your own under scaletrain.session() training a Hugging Face transformers model: a small Llama
(RoPE, RMSNorm, SwiGLU, grouped-query attention) built from a LlamaConfig, nothing downloaded, on the bytes of
a few modules of this Python's own standard library (vocabulary 256: one token per byte, no tokenizer).

    python examples/hf_model.py [--section.key=value ...]                       # one process
    torchrun --nproc_per_node 2 examples/hf_model.py [--section.key=value ...]  # two workers, torchrun itself
    scaletrain launch --nproc 2 examples/hf_model.py [--section.key=value ...]  # the same, through scaletrain
    scaletrain launch --nproc 2 examples/hf_model.py --parallel.tp=2  # tensor parallel, by its config's own plan

The batches are dicts, as transformers takes them (``model(**batch)``); the model computes its own loss from
``labels`` (it shifts them by one itself) and returns it in its ModelOutput. The sizes come from the session's
config (--model.n_layer, --model.n_head, --model.n_embd, --model.dropout for attention, --data.seq_len), the
peak learning rate from --optim.lr and its schedule from --schedule.* (scaletrain's warmup and cosine, a pure
function of the step, so a resumed run continues on the same curve). Checkpoints every checkpoint.every
steps hold the model, the optimizer, the loader's position and every rank's RNG: run the same command again
after a stop to resume bit for bit. The run directory (default runs/hf-llama, runs/hf-llama-2, ...) gets
metrics.jsonl, summary.json and model.safetensors.

Needs transformers (pip install transformers); without it this exits 2 with one line saying so.
"""

import sys
import sysconfig
from pathlib import Path

import torch

import scaletrain
from scaletrain.schedule import WarmupDecay

try:
    from transformers import AutoModelForCausalLM, LlamaConfig
except ModuleNotFoundError as err:  # one line and exit 2 (a usage error), not a traceback
    if err.name != "transformers":
        raise
    print("hf_model.py: error: this example trains a Hugging Face transformers model, and transformers is "
          "not installed; fix: pip install transformers", file=sys.stderr)
    sys.exit(2)

MODULES = ("argparse.py", "dataclasses.py", "functools.py", "difflib.py")  # about 280 KB of Python


class ByteWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len`` bytes as a transformers causal LM takes them: ``input_ids`` and
    the same as ``labels`` (the model predicts labels[t + 1] from input_ids[: t + 1])."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return len(self.data) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.data[i * self.seq_len : (i + 1) * self.seq_len].long()  # (seq_len,)
        return {"input_ids": ids, "labels": ids}


def stdlib_bytes(names: tuple[str, ...]) -> torch.Tensor:
    """The bytes of these standard-library modules (not site-packages), joined by newlines: 1-D, uint8."""
    root = Path(sysconfig.get_paths()["stdlib"])
    text = b"\n".join((root / name).read_bytes() for name in names)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def build_model(n_layer: int, n_head: int, n_embd: int, seq_len: int,
                dropout: float = 0.0) -> torch.nn.Module:
    """A Llama from a config: random weights, no download, no tokenizer."""
    config = LlamaConfig(vocab_size=256, hidden_size=n_embd, intermediate_size=4 * n_embd,
                         num_hidden_layers=n_layer, num_attention_heads=n_head,
                         num_key_value_heads=max(1, n_head // 2),  # grouped-query attention: 2 q per k/v head
                         max_position_embeddings=seq_len, attention_dropout=dropout,
                         use_cache=False)  # no KV cache: training only
    return AutoModelForCausalLM.from_config(config)


def main(argv: list[str]) -> None:
    config = {"run.name": "hf-llama", "train.max_steps": 300, "data.batch_size": 16, "data.seq_len": 64,
              "model.n_layer": 2, "model.n_head": 4, "model.n_embd": 64, "optim.lr": 3e-3,
              "optim.weight_decay": 0.1, "optim.grad_clip": 1.0, "schedule.warmup_steps": 20,
              "schedule.min_lr_ratio": 0.1, "log.every": 25, "checkpoint.every": 100}
    with scaletrain.session(config, argv=argv) as st:
        c = st.cfg  # the resolved config: the defaults above, then the command line
        adamw = lambda params: torch.optim.AdamW(params, lr=c.optim.lr, weight_decay=c.optim.weight_decay)
        # Built after the session started (it seeds every rank alike): the same initial weights on every rank.
        llama = build_model(c.model.n_layer, c.model.n_head, c.model.n_embd, c.data.seq_len, c.model.dropout)
        model, optimizer = st.setup(llama, adamw, name="llama")
        loader = st.loader(ByteWindows(stdlib_bytes(MODULES), c.data.seq_len))
        schedule = WarmupDecay(c.schedule, c.train.max_steps)  # step -> factor of the peak lr
        while not st.done:
            for batch in loader:  # {"input_ids": (B, T), "labels": (B, T)}
                with st.step():
                    for group in optimizer.param_groups:
                        group["lr"] = c.optim.lr * schedule(st.steps)
                    with st.autocast():
                        loss = model(**batch).loss  # a CausalLMOutputWithPast: logits, loss
                    st.backward(loss)
                    if c.optim.grad_clip > 0:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), c.optim.grad_clip)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    st.log(loss=loss)
                if st.done:
                    break
        if st.rank == 0:
            n_params = sum(p.numel() for p in llama.parameters())
            print(f"hf_model: {type(llama).__name__} ({n_params / 1e6:.2f}M parameters), {st.steps} steps, "
                  f"train loss {st.last_metrics['loss']:.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
