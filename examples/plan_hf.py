"""Plan a Hugging Face model before renting the GPUs: Llama 3.2 1B's shape, built from transformers' LlamaConfig
(nothing downloaded) on fake tensors, on one machine of 8 H100s at 2,048 tokens per sample.

    python examples/plan_hf.py                          # the table: memory per GPU per layout, time, cost, choice
    python examples/plan_hf.py --dist.nproc=4 --data.batch_size=8

scaletrain.plan_fit() takes what fit() takes (the model's class or a function that builds it, the training data,
config and argv) and plans what that fit() would run, as `scaletrain plan` plans a recipe (docs/plan.md).
"""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import scaletrain

LLAMA_3_2_1B = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                           num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                           rope_theta=500000.0, tie_word_embeddings=True)


def main(argv: list[str]) -> None:
    tokens = torch.zeros(2048, dtype=torch.long)  # one sample's shape is what the plan needs of the data
    data = [{"input_ids": tokens, "labels": tokens}] * 100_000
    scaletrain.plan_fit(lambda: LlamaForCausalLM(LLAMA_3_2_1B), data, gpu="h100", price_per_gpu_hour=2.5,
                        config={"dist.nproc": 8, "data.batch_size": 4, "train.precision": "bf16-mixed",
                                "train.epochs": 1}, argv=argv)


if __name__ == "__main__":
    main(sys.argv[1:])
