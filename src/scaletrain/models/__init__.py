"""Built-in models, built from the model config and what the data says about itself."""

from __future__ import annotations

from typing import Any

from torch import nn

from scaletrain.config import ModelConfig
from scaletrain.errors import ConfigError
from scaletrain.models.gpt import GPT
from scaletrain.models.llama import Llama
from scaletrain.models.vision import CNN, MLP

__all__ = ["CNN", "GPT", "MLP", "Llama", "build_model"]


def build_model(cfg: ModelConfig, task: str, info: dict[str, Any]) -> nn.Module:
    if cfg.name in ("gpt", "llama"):
        if task != "lm":
            raise ConfigError("model.name", cfg.name, "mlp or cnn for a classification data set",
                              "--model.name=cnn, or a text source (--data.source=stdlib)")
        vocab = cfg.vocab_size or info["vocab_size"]
        if cfg.name == "llama":
            return Llama(vocab, info["seq_len"], cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.n_embd, cfg.ffn_hidden,
                         cfg.rope_theta, dropout=cfg.dropout)
        return GPT(vocab, info["seq_len"], cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.dropout, cfg.bias,
                   fused_loss=cfg.loss == "fused", bf16_residual=cfg.residual == "bf16")
    if task != "classify":
        raise ConfigError("model.name", cfg.name, "gpt for a text source", "--model.name=gpt")
    shape, classes = info["input_shape"], info["num_classes"]
    if cfg.name == "cnn":
        if len(shape) != 3:
            raise ConfigError("model.name", "cnn", "mlp for inputs that are not images (C, H, W)",
                              "--model.name=mlp")
        return CNN(shape, classes, cfg.channels, cfg.hidden, cfg.dropout)
    return MLP(shape, classes, cfg.hidden, cfg.dropout)
