"""A loop of one's own over pipeline stages: the same script on one process and as a pipeline of stages.

    python examples/pipeline_loop.py                                      # one process
    scaletrain launch --nproc 2 examples/pipeline_loop.py --parallel.pp=2  # two stages (1F1B)
    scaletrain launch --nproc 4 examples/pipeline_loop.py --parallel.pp=2 --parallel.strategy=fsdp

With parallel.pp > 1, st.setup() returns this rank's stage of the built-in Llama (its blocks, under the
model's own parameter names) and the optimizer built on it; a PipelineRunner runs the stages over
micro-batches, and st.pipeline_step() is the step's forward and backward (st.backward()'s counterpart: timed,
its loss watched). Everything else is the session's as usual: clipping by the whole model's norm in
st.optimizer_step(), checkpoints that resume at another layout, the final weights gathered from the stages.
The data: sequences counting up by a step of their own modulo the vocabulary, which the model learns to
continue (the loss falls well below log(vocabulary)).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import scaletrain
from scaletrain.models import Llama
from scaletrain.parallel.pipeline import PipelineRunner, is_stage

VOCAB, T = 64, 32


def sequences(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    start, step = torch.randint(0, VOCAB, (n, 1), generator=g), torch.randint(1, 8, (n, 1), generator=g)
    tokens = (start + step * torch.arange(T + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def main(argv: list[str]) -> None:
    config = {"run.name": "pipeline-loop", "train.max_steps": 60, "log.every": 10, "optim.grad_clip": 1.0}
    with scaletrain.session(config, argv=argv) as st:
        model, opt = st.setup(Llama(VOCAB, T, n_layer=4, n_head=4, n_kv_head=2, n_embd=64),
                              lambda params: torch.optim.AdamW(params, lr=3e-3))
        runner = PipelineRunner(model, model.mesh, device=st.device, microbatches=st.cfg.parallel.microbatches,
                                schedule=st.cfg.parallel.pp_schedule, loss_fn=loss_of) if is_stage(model) else None
        loader = st.loader(sequences(2048), batch_size=8)
        while not st.done:
            for x, y in loader:
                with st.step():
                    if runner is not None:  # every stage is given the batch: the first reads x, the last y
                        loss = st.pipeline_step(runner, x, y)
                    else:
                        loss = loss_of(model(x), y)
                        st.backward(loss)
                    st.optimizer_step(opt)
                    opt.zero_grad(set_to_none=True)
                    st.log(loss=loss)
                if st.done:
                    break


if __name__ == "__main__":
    main(sys.argv[1:])
