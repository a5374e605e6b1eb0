"""A loop of your own under scaletrain.session(): a GAN on the 8x8 digits, two models, two optimizers, and an
R1 gradient penalty (a second derivative through the discriminator), with DDP on N ranks.

    python examples/gan.py [--section.key=value ...]                          # one process
    torchrun --nproc_per_node 2 examples/gan.py [--section.key=value ...]     # two workers, torchrun itself
    scaletrain launch --nproc 2 examples/gan.py [--section.key=value ...]     # the same, through scaletrain

The session gives every rank its shard of the data, averages both models' gradients across ranks, times every
step per rank (a slow rank is named), checkpoints both models, both optimizers, the loader's position and
every rank's RNG, and resumes bit for bit: run the same command again after a stop (Ctrl-C, preemption, a
killed worker with --max-restarts). The run directory (default runs/gan, runs/gan-2, ...) gets metrics.jsonl,
summary.json and the final weights of both models in model.safetensors (names G.* and D.*).

FSDP: not for this GAN. A session shards any model (--parallel.strategy=fsdp; see examples/nanogpt_lm.py), but
the R1 penalty is a second derivative through D, and FSDP frees D's gathered parameters after the first
backward: under FSDP st.backward() stops with one line that says so. Use DDP, as here.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

import scaletrain
from scaletrain.data import digits

Z = 16  # noise dimensions


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(Z, 128), nn.LeakyReLU(0.2), nn.Linear(128, 64), nn.Sigmoid())

    def forward(self, z: torch.Tensor) -> torch.Tensor:  # (B, Z) -> (B, 1, 8, 8) pixels in [0, 1]
        return self.net(z).view(-1, 1, 8, 8)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.LeakyReLU(0.2), nn.Dropout(0.1),
                                 nn.Linear(128, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 1, 8, 8) -> (B,) logits, real vs generated
        return self.net(x).squeeze(-1)


def r1_penalty(logits_real: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Mescheder et al. 2018: the squared gradient norm of D at real data (a graph for a second backward)."""
    (grad,) = torch.autograd.grad(logits_real.sum(), real, create_graph=True)
    return grad.pow(2).flatten(1).sum(1).mean()


def main(argv: list[str]) -> None:
    config = {"run.name": "gan", "train.max_steps": 300, "data.batch_size": 64, "log.every": 25,
              "checkpoint.every": 50}
    with scaletrain.session(config, argv=argv) as st:
        adam = lambda params: torch.optim.Adam(params, lr=2e-3, betas=(0.5, 0.99))
        G, opt_g = st.setup(Generator(), adam, name="G")
        D, opt_d = st.setup(Discriminator(), adam, name="D")
        loader = st.loader(digits(0.2).train)  # (images, labels); the labels are not used
        while not st.done:
            for real, _ in loader:
                with st.step():
                    z = torch.randn(real.shape[0], Z, device=st.device)
                    with torch.no_grad():  # no graph through G: its DDP wrapper expects no backward here
                        fake = G(z)
                    real = real.requires_grad_(True)
                    logits = D(torch.cat([real, fake]))  # one forward of D per backward (DDP)
                    real_logits, fake_logits = logits[: real.shape[0]], logits[real.shape[0]:]
                    loss_d = F.softplus(-real_logits).mean() + F.softplus(fake_logits).mean()
                    penalty = r1_penalty(real_logits, real)
                    opt_d.zero_grad(set_to_none=True)
                    st.backward(loss_d + 5.0 * penalty)
                    opt_d.step()

                    loss_g = F.softplus(-D(G(z))).mean()  # non-saturating generator loss
                    opt_g.zero_grad(set_to_none=True)
                    st.backward(loss_g)
                    opt_g.step()
                    st.log(loss_d=loss_d, loss_g=loss_g, r1=penalty)
                if st.done:
                    break


if __name__ == "__main__":
    main(sys.argv[1:])
