"""The repeated blocks of models other than scaletrain's own, found and sharded one unit per block.

Three shapes written here as their sources lay them out (no download, no transformers): nanoGPT's GPT (blocks
in transformer.h, lm_head tied to transformer.wte, forward returning (logits, loss)), a transformers-style
causal LM (layers in model.layers, ``_no_split_modules``, a dataclass output), and a torchvision-style ResNet
(BasicBlocks in layer1..layer3 Sequentials, BatchNorm). On 2 Gloo ranks each trains 5 AdamW steps under DDP
and under FSDP with the same global batch: FSDP must shard one unit per block with the tied weight in the
root, and end with DDP's parameters (fp32; only the summation order of the gradients differs, so 1e-5).
Then fit() trains models returning a tuple, a dict and a dataclass under DDP and FSDP alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import math
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from spawn_ranks import run_ranks
from test_fsdp import _full, _max_diff
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import scaletrain
from scaletrain import runtime
from scaletrain.config import DistConfig, ParallelConfig
from scaletrain.errors import ConfigError
from scaletrain.parallel import find_units, parallelize
from scaletrain.parallel.units import mark_idle, unit_warnings
from scaletrain.train.state import full_model_state

V, T, C, GLOBAL, STEPS = 32, 8, 16, 8, 5


# ---------------------------------------------------------------------------------------- nanoGPT's layout


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, 2, C // 2).transpose(1, 2) for z in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, C))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(C), CausalSelfAttention(), nn.LayerNorm(C), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, n_layer: int = 2) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(V, C), wpe=nn.Embedding(T, C), drop=nn.Dropout(0.0),
            h=nn.ModuleList([Block() for _ in range(n_layer)]), ln_f=nn.LayerNorm(C)))
        self.lm_head = nn.Linear(C, V, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # nanoGPT's weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple:
        tr = self.transformer
        x = tr.drop(tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1])))
        for block in tr.h:
            x = block(x)
        logits = self.lm_head(tr.ln_f(x))  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1)) if targets is not None else None
        return logits, loss


# ------------------------------------------------------------------------------- a transformers-style LM


@dataclasses.dataclass
class CausalLMOutput:
    logits: torch.Tensor


class MyDecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = nn.RMSNorm(C), CausalSelfAttention()
        self.post_attention_layernorm, self.mlp = nn.RMSNorm(C), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class MyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(V, C)
        self.layers = nn.ModuleList([MyDecoderLayer() for _ in range(3)])
        self.norm = nn.RMSNorm(C)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class MyForCausalLM(nn.Module):
    _no_split_modules = ["MyDecoderLayer"]  # as transformers' PreTrainedModel subclasses declare

    def __init__(self) -> None:
        super().__init__()
        self.model, self.lm_head = MyModel(), nn.Linear(C, V, bias=False)

    def forward(self, input_ids: torch.Tensor) -> CausalLMOutput:
        return CausalLMOutput(self.lm_head(self.model(input_ids)))


# ------------------------------------------------------------------------------ a torchvision-style ResNet


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)) \
            if stride != 1 or cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(out + (self.downsample(x) if self.downsample is not None else x))


class ResNet(nn.Module):
    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(3, 4, 3, 1, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU()
        self.layer1 = nn.Sequential(BasicBlock(4, 4, 1), BasicBlock(4, 4, 1))
        self.layer2 = nn.Sequential(BasicBlock(4, 8, 2), BasicBlock(8, 8, 1))
        self.layer3 = nn.Sequential(BasicBlock(8, 16, 2), BasicBlock(16, 16, 1))
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, 8, 8) -> (B, classes)
        x = self.layer3(self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x))))))
        return self.fc(self.avgpool(x).flatten(1))


# -------------------------------------------------------------------------------------------- the runs

# name -> (build, a batch of n for step s, the loss of an output and a target)
def _tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, V, (n, T + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def _images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


MODELS = {
    "nanogpt": (NanoGPT, _tokens, lambda m, x, y: m(x, y)[1]),
    "hf": (MyForCausalLM, _tokens, lambda m, x, y: F.cross_entropy(m(x).logits.reshape(-1, V), y.reshape(-1))),
    "resnet": (ResNet, _images, lambda m, x, y: F.cross_entropy(m(x), y)),
}


def _train(name: str, strategy: str, rank: int, world: int) -> tuple[nn.Module, dict]:
    build, batch, loss_of = MODELS[name]
    torch.manual_seed(0)
    model = build()
    wrapped = parallelize(model, torch.device("cpu"), world, ParallelConfig(strategy=strategy), compile=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    per_rank = GLOBAL // world
    for step in range(STEPS):
        x, y = batch(GLOBAL, step)
        loss_of(wrapped, x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]).backward()
        opt.step()
        opt.zero_grad()
    return model, {"params": {k: v for k, v in _full(model).items() if "running_" not in k and "batches" not in k}}


def _sharding(model: nn.Module) -> dict:
    """Which modules fully_shard made units, and what holds the tied weight."""
    units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule) and m is not model]
    out = {"units": units, "n_params": len(list(model.parameters()))}
    if isinstance(model, NanoGPT):
        wte, head = model.transformer.wte.weight, model.lm_head.weight
        out["tied"] = wte is head and isinstance(head, DTensor)
    return out


def _reload_tied(model: NanoGPT, trained: dict[str, torch.Tensor], other: dict[str, torch.Tensor],
                 rank: int, world: int) -> dict:
    """The sharded tied model's full weights as the trainer saves them (rank 0 gets them), loaded into a plain
    model; and other full weights (DDP's) loaded into a fresh sharded one, as a DDP -> FSDP resume does."""
    saved = full_model_state(model, sharded=True)  # collective
    plain = NanoGPT()
    if rank == 0:
        plain.load_state_dict(saved)
    torch.manual_seed(1)
    fresh = NanoGPT()
    parallelize(fresh, torch.device("cpu"), world, ParallelConfig(strategy="fsdp"), compile=False)
    set_model_state_dict(fresh, dict(sorted(other.items())), options=StateDictOptions(full_state_dict=True))
    loaded = _full(fresh)
    return {"saved_equal": rank != 0 or (saved.keys() == trained.keys()
                                        and all(torch.equal(saved[k], trained[k]) for k in trained)),
            "plain_tied": plain.lm_head.weight is plain.transformer.wte.weight,
            "loaded_equal": all(torch.equal(loaded[k], other[k]) for k in other),
            "sharded_tied": fresh.lm_head.weight is fresh.transformer.wte.weight}


def _stages_in_blocks() -> nn.Module:
    """A model's ``blocks`` that are stages, each a Sequential of blocks, the first of one block of a class the
    model holds once (an MLP here; EfficientNet-B0's DepthwiseSeparableConv), which makes that stage a unit itself
    (timm's EfficientNet: 1 x Sequential, 15 x InvertedResidual)."""
    model = Staged()
    model.blocks = nn.Sequential(nn.Sequential(MLP()), nn.Sequential(*(Layer() for _ in range(3))))
    return model


def _units_ranks(rank: int, world: int) -> dict:
    runtime.init(DistConfig(device="cpu"))
    out: dict = {}
    staged = _stages_in_blocks()
    parallelize(staged, torch.device("cpu"), world, ParallelConfig(strategy="fsdp"), compile=False)
    out["staged"] = find_units(staged).names  # as the header finds them again, on the sharded model
    for name in MODELS:
        _, ddp = _train(name, "ddp", rank, world)
        model, fsdp = _train(name, "fsdp", rank, world)
        out[name] = {"diff": _max_diff(fsdp["params"], ddp["params"]), **_sharding(model),
                     "found_again": find_units(model).names == find_units(MODELS[name][0]()).names}
        if name == "nanogpt":
            out[name]["reload"] = _reload_tied(model, fsdp["params"], ddp["params"], rank, world)
    return out


def _described(model: nn.Module) -> tuple[str, str]:
    units = find_units(model)
    return units.rule, units.describe()


def test_blocks_of_three_model_shapes_are_found_named_and_sharded_one_unit_each():
    assert _described(NanoGPT()) == ("repeated", "2 x Block")  # transformer.h, not the tied children
    assert _described(MyForCausalLM()) == ("_no_split_modules", "3 x MyDecoderLayer")
    # per block in every stage: layer3 is the largest run, and its class is also layer1's and layer2's
    assert _described(ResNet()) == ("repeated", "6 x BasicBlock")
    assert find_units(ResNet(), "BasicBlock,Linear").describe() == "6 x BasicBlock, 1 x Linear"
    with pytest.raises(ConfigError, match=r"none is a GPT2Block.*fix: --parallel.fsdp_units=BasicBlock"):
        find_units(ResNet(), "GPT2Block")
    lstm = nn.Sequential(nn.Embedding(50, 8), nn.LSTM(8, 64, num_layers=2), nn.Linear(64, 5))  # no repeated layers
    with pytest.raises(ConfigError, match=r"none is a Block.*fix: --parallel.fsdp_units=LSTM$"):
        find_units(lstm, "Block")  # the largest layer's class, which the same call then takes
    assert find_units(lstm, "LSTM").describe() == "1 x LSTM"
    with pytest.raises(ConfigError, match=r"parallel.fsdp_units = 'Block,': expected class names separated"):
        ParallelConfig(fsdp_units="Block,")

    ranks = run_ranks(_units_ranks, 2)
    for r in ranks:
        # measured: 0.0 for all three (2 ranks: each gradient element is the same sum of two either way)
        assert {name: r[name]["diff"] < 1e-5 for name in MODELS} == dict.fromkeys(MODELS, True), r
        assert r["nanogpt"]["units"] == ["transformer.h.0", "transformer.h.1"]
        assert r["nanogpt"]["tied"] and r["nanogpt"]["n_params"] == len(list(NanoGPT().parameters()))
        assert r["hf"]["units"] == [f"model.layers.{i}" for i in range(3)]
        assert r["resnet"]["units"] == [f"layer{s}.{i}" for s in (1, 2, 3) for i in (0, 1)]
        assert all(r["nanogpt"]["reload"].values()), r["nanogpt"]["reload"]
        # the units found again on a sharded model (the header's line, a second fit() on it) are the ones it was
        # sharded by: a stage fully_shard made an FSDPSequential was taken for a block ("7 x Sequential" for
        # timm's EfficientNet-B0, sharded as 1 x Sequential and 15 x InvertedResidual)
        assert all(r[name]["found_again"] for name in MODELS), r
        assert r["staged"] == find_units(_stages_in_blocks()).names, r["staged"]
        assert {"blocks.0", "blocks.1.0", "blocks.1.2"} <= set(r["staged"]) and "blocks.1" not in r["staged"], \
            r["staged"]


class TiedAcross(nn.Module):
    """A tie across a block's border: the head shares the first block's projection."""

    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList([MLP(), MLP()])
        self.head = nn.Linear(4 * C, C)
        self.head.weight = self.h[0].c_fc.weight


def test_a_tie_across_a_block_leaves_the_block_to_the_root_and_no_blocks_is_a_warning_with_the_fix():
    units = find_units(TiedAcross())
    assert units.names == ("h.1",)
    assert units.left_to_root == ("h.0 (MLP; its c_fc.weight is tied to head)",)
    said = unit_warnings(TiedAcross(), units, sharded=True, checkpointing="none")
    assert said == ["FSDP: left to the root, as a tied parameter must live in one unit: h.0 (MLP; its c_fc.weight "
                    "is tied to head)"]
    lone = nn.Sequential(nn.Linear(4, 4))
    said = unit_warnings(lone, find_units(lone), sharded=True, checkpointing="full")
    assert len(said) == 1 and said[0].startswith("no repeated blocks found in Sequential: FSDP gathers the whole")
    assert said[0].endswith("fix: --parallel.fsdp_units=MyBlock (the class names of its repeated layers, "
                            "comma-separated)")
    assert unit_warnings(lone, find_units(lone), sharded=False, checkpointing="none") == []  # compile alone


# ------------------------------------------------------------------------------ fit() and model outputs


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    aux: torch.Tensor


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


class Shaped(nn.Module):
    """(B, 8) -> 4 classes, returned as a tuple, a dict or a dataclass, with a second output beside the logits."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.stem, self.head = kind, nn.Linear(8, 16), nn.Linear(16, 4)
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, x: torch.Tensor) -> tuple | dict | Out:
        h = self.stem(x)
        for layer in self.layers:
            h = layer(h)
        logits, aux = self.head(h), h.mean()
        return {"tuple": (logits, aux), "dict": {"logits": logits, "aux": aux}, "dataclass": Out(logits, aux)}[self.kind]


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.gate(x))


class Listed(nn.Module):
    """Blocks in lists fully_shard cannot take as units (containers without a forward): one list per stage
    (transformers' Funnel: encoder.blocks), or one list of layers of two classes in turn (a model's children
    are then the units, the list standing for its layers)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        if kind == "stages":
            self.stages = nn.ModuleList([nn.ModuleList([Layer()]), nn.ModuleList([Layer()])])
        else:
            self.stages = nn.ModuleList([nn.ModuleList([Layer(), Gate(), Layer(), Gate()])])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for stage in self.stages:
            for layer in stage:
                h = layer(h)
        return self.head(h)


def test_lists_of_lists_and_of_mixed_layers_give_their_layers_as_units():
    """fully_shard refused the ModuleLists these gave as units (a traceback from inside torch)."""
    assert _described(Listed("stages")) == ("repeated", "2 x Layer")
    assert _described(Listed("mixed")) == ("children", "stem, head, stages.0.0, stages.0.1, stages.0.2, stages.0.3")
    assert find_units(Listed("mixed"), "ModuleList").describe() == "2 x Layer, 2 x Gate"


class Staged(nn.Module):
    """Stages of blocks as timm's ConvNeXt, Swin and EfficientNet nest them (``stages`` a Sequential of stages,
    each a downsampling layer and a Sequential of blocks), or, ``experts``, blocks each holding a ModuleList of
    experts it routes between (a mixture of experts of one's own)."""

    def __init__(self, experts: bool = False) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        if experts:
            self.stages = nn.Sequential(*(Routed() for _ in range(3)))
        else:
            self.stages = nn.Sequential(Stage(2), Stage(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


class Stage(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.downsample, self.blocks = nn.Linear(16, 16), nn.Sequential(*(Layer() for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router, self.experts = nn.Linear(16, 2), nn.ModuleList(Layer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.router(x).softmax(-1)
        return sum(w[..., None] * e(x) for w, e in zip(weights.unbind(-1), self.experts))


def test_stages_give_way_to_their_blocks_and_experts_to_their_block():
    """Before, a stage (the larger of two repeated classes, one nested in the other) was the unit: 2 x Stage
    here, 4 x ConvNeXtStage for timm's ConvNeXt-T, whose third stage holds 61% of its parameters."""
    assert _described(Staged()) == ("repeated", "5 x Layer")
    assert find_units(Staged()).names == ("stages.0.blocks.0", "stages.0.blocks.1", "stages.1.blocks.0",
                                          "stages.1.blocks.1", "stages.1.blocks.2")
    assert _described(Staged(experts=True)) == ("repeated", "3 x Routed")
    named = Staged()  # a model's ``blocks`` that are stages, each a Sequential of blocks (timm's EfficientNet)
    named.blocks = nn.Sequential(*(nn.Sequential(*(Layer() for _ in range(n))) for n in (2, 3)))
    assert _described(named) == ("repeated", "10 x Layer")


class ConvNormAct(nn.Sequential):
    """torchvision's Conv2dNormActivation: a layer made a Sequential (a convolution, a norm, an activation)."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())


class InvertedResidual(nn.Module):
    """torchvision's MobileNet block: a Sequential of ConvNormAct layers, with a residual."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.block = nn.Sequential(ConvNormAct(c, 2 * c), ConvNormAct(2 * c, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


class MobileNet(nn.Module):
    """torchvision's MobileNetV2/V3 layout: ``features`` is one Sequential of a stem, the blocks and a last
    convolution; the layers inside each block come in Sequentials of ConvNormAct."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(ConvNormAct(3, 4), *(InvertedResidual(4) for _ in range(3)), ConvNormAct(4, 8))
        self.classifier = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean((2, 3)))


class DenseLayer(nn.Module):
    """torchvision's _DenseLayer: leaf modules only (norm, activation, convolution), a block all the same."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm, self.conv = nn.BatchNorm2d(c), nn.Conv2d(c, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.relu(self.norm(x)))


class DenseBlock(nn.ModuleDict):
    """torchvision's _DenseBlock: a ModuleDict with a forward that chains its layers, each fed all before it."""

    def __init__(self, c: int, n: int) -> None:
        super().__init__({f"layer{i}": DenseLayer(c + 2 * i) for i in range(n)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.values():
            x = torch.cat([x, layer(x)], 1)
        return x


class DenseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), DenseBlock(4, 2), nn.Conv2d(8, 4, 1), DenseBlock(4, 3))
        self.classifier = nn.Linear(10, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean((2, 3)))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Sequential(nn.Linear(16, 16), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mix(x)


class EndedStage(nn.Module):
    """timm's EdgeNeXt / EfficientFormer stage: a Sequential of blocks that ends in one block of another class."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Routed() for _ in range(depth)), Attention())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def test_blocks_beside_other_layers_and_in_a_dict_with_a_forward_are_units_and_layers_are_not():
    """torchvision's MobileNetV3 had 2.5% of its parameters in units (20 x Conv2dNormActivation, found inside
    its blocks, which were taken for stages of them), MobileNetV2 and DenseNet-121 had their two children as
    units (the features 99%); a detection model's MobileNet backbone gave 4 x Conv2d. EdgeNeXt's stages gave way
    to their repeated blocks only, its SplitTransposeBlocks (one per stage) falling to the root."""
    units = find_units(MobileNet())
    assert (units.rule, units.describe()) == ("repeated", "3 x InvertedResidual")
    assert units.names == ("features.1", "features.2", "features.3")
    assert _described(DenseNet()) == ("repeated", "5 x DenseLayer")
    ended = nn.Sequential(nn.Linear(8, 16), nn.Sequential(EndedStage(2), EndedStage(1)), nn.Linear(16, 4))
    assert find_units(ended).names == ("1.0.blocks.0", "1.0.blocks.1", "1.1.blocks.0", "1.0.blocks.2",
                                       "1.1.blocks.1")
    assert find_units(ended).describe() == "3 x Routed, 2 x Attention"
    # stages that are plain Sequentials give way to their blocks; heads that are Sequentials too stay units
    # (SSDlite: its 18 Sequentials were the units, then only its blocks, the heads falling to the root)
    ssd = nn.Module()
    ssd.features = nn.Sequential(nn.Sequential(Routed(), Routed()), nn.Sequential(Routed(), Routed()))
    ssd.heads = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)) for _ in range(2))
    assert find_units(ssd).names == ("features.0.0", "features.0.1", "features.1.0", "features.1.1", "heads.0",
                                     "heads.1")
    vgg = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(), nn.MaxPool2d(2))
    assert _described(nn.Sequential(vgg, nn.Flatten(), nn.Linear(4, 2))) == ("children", "0, 2")


def test_declared_stages_give_way_to_declared_layers_in_their_lists_and_blocks_keep_what_they_hold():
    """transformers' ConvNext declares _no_split_modules = ["ConvNextLayer", "ConvNextStage"]: the outermost
    were kept, so its 4 stages were the units (the last 56% of ConvNeXt-T's parameters); now its 18 layers.
    Mamba declares MambaBlock and the MambaMixer each holds directly: the blocks stay the units."""
    staged = Staged()
    staged._no_split_modules = ["Layer", "Stage"]
    assert _described(staged) == ("_no_split_modules", "5 x Layer")
    held = nn.Sequential(Attention(), Attention())
    held._no_split_modules = ["Attention", "Linear"]  # the Linear directly in each Attention's Sequential
    assert _described(held) == ("_no_split_modules", "2 x Attention")
    # Swin declares SwinStage only: its blocks (in a list, 86% of it here) are the units; HGNetV2 declares its
    # BasicLayer, whose list of conv blocks holds a part of it (22% here, beside its aggregation): it stays whole
    swin = nn.Sequential(DeclaredStage(16, 3), DeclaredStage(16, 2))
    swin._no_split_modules = ["DeclaredStage"]
    assert _described(swin) == ("_no_split_modules", "5 x Routed")
    hgnet = nn.Sequential(DeclaredStage(64, 2), DeclaredStage(64, 2))
    hgnet._no_split_modules = ["DeclaredStage"]
    assert _described(hgnet) == ("_no_split_modules", "2 x DeclaredStage")


class DeclaredStage(nn.Module):
    """A module of blocks in a ModuleList beside one Linear of width x width (downsampling, or aggregating)."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Routed() for _ in range(depth))
        self.other = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.other(x) if self.other.in_features == x.shape[-1] else x


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
def test_an_encoder_decoders_two_kinds_of_layer_are_both_units():
    """torch's nn.Transformer: the decoder's layers (the larger class) were the units, and the encoder's six stayed
    in the root, gathered whole for every forward. A class with a quarter of the largest's parameters counts too;
    a run of small layers beside the blocks (heads of an eighth) does not."""
    model = nn.Transformer(d_model=32, nhead=4, num_encoder_layers=3, num_decoder_layers=2, dim_feedforward=64)
    units = find_units(model)
    assert (units.rule, units.describe()) == ("repeated", "3 x TransformerEncoderLayer, 2 x TransformerDecoderLayer")
    assert units.names == ("encoder.layers.0", "encoder.layers.1", "encoder.layers.2", "decoder.layers.0",
                           "decoder.layers.1")
    with_heads = nn.Module()
    with_heads.blocks_of = nn.ModuleList([MLP(), MLP()])
    with_heads.heads = nn.ModuleList([nn.Linear(C, C // 2) for _ in range(2)])
    assert _described(with_heads) == ("repeated", "2 x MLP")


class Wrapped(nn.Module):
    """A model whose layers are one nn.Sequential of different layers, as users write an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_a_model_in_one_sequential_or_wrapped_has_its_layers_as_units():
    """Its one child was no unit and the model went unsharded ('no repeated blocks found' with a placeholder
    fix); the layers are the units now, through any number of one-child wrappers, and no warning is said."""
    assert _described(Wrapped()) == ("children", "net.0, net.1, net.3")
    assert find_units(Wrapped()).names == ("net.0", "net.1", "net.3")
    outer = nn.Module()
    outer.inner = Wrapped()
    assert find_units(outer).names == ("inner.net.0", "inner.net.1", "inner.net.3")
    assert unit_warnings(outer, find_units(outer), sharded=True, checkpointing="full") == []
    lone = nn.Module()
    lone.only = nn.Sequential(nn.Linear(4, 4))  # one layer all the way down: nothing to split
    assert _described(lone) == ("none", "")


def test_parametrized_layers_are_units_not_their_parametrizations():
    """A spectral-norm discriminator: each parametrized Linear keeps its weight in a ParametrizationList of one
    _SpectralNorm, which holds no parameter; those lists were taken for lists of blocks, and FSDP's units were
    the _SpectralNorm modules, sharding nothing (everything in the root)."""
    sn = nn.utils.parametrizations.spectral_norm
    disc = nn.Sequential(sn(nn.Linear(2, 32)), nn.LeakyReLU(0.2), sn(nn.Linear(32, 32)), nn.LeakyReLU(0.2),
                         nn.utils.parametrizations.weight_norm(nn.Linear(32, 1)))
    assert _described(disc) == ("children", "0, 2, 4")


def _fit_ranks(rank: int, world: int, root: str) -> dict:
    runtime.init(DistConfig(device="cpu"))  # fit() joins this group and leaves it open
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    y = x[:, :4].argmax(dim=1)
    out: dict = {}
    for kind in ("tuple", "dict", "dataclass", "stages", "mixed"):
        for strategy in ("ddp", "fsdp"):
            said = io.StringIO()
            model = functools.partial(Listed if kind in ("stages", "mixed") else Shaped, kind)
            with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                summary = scaletrain.fit(model, (x, y), config={
                    "run.dir": f"{root}/{kind}-{strategy}", "parallel.strategy": strategy, "dist.device": "cpu",
                    "data.batch_size": 16, "train.max_steps": 6, "optim.lr": 1e-2, "train.progress": False,
                    "train.eval_batches": 1})
            out[f"{kind}-{strategy}"] = {"loss": summary["train_loss"], "steps": summary["steps"],
                                         "said": said.getvalue()}
    return out


def test_tuple_dict_and_dataclass_outputs_train_under_fit_with_ddp_and_fsdp(tmp_path: Path):
    ranks = run_ranks(_fit_ranks, 2, str(tmp_path))
    units = {"stages": "2 x Layer", "mixed": "stem, head, stages.0.0, stages.0.1, stages.0.2, stages.0.3"}
    for kind in ("tuple", "dict", "dataclass", "stages", "mixed"):
        ddp, fsdp = ranks[0][f"{kind}-ddp"], ranks[0][f"{kind}-fsdp"]
        assert ddp["steps"] == fsdp["steps"] == 6 and math.isfinite(fsdp["loss"])
        assert f"parallel: fsdp | FSDP: {units.get(kind, '2 x Layer')} + root" in fsdp["said"], fsdp["said"]
        assert "warning" not in fsdp["said"] + ddp["said"]
        weights = [safetensors.torch.load_file(tmp_path / f"{kind}-{s}" / "model.safetensors") for s in ("ddp", "fsdp")]
        assert _max_diff(weights[1], weights[0]) < 1e-5, kind
    assert ranks[1]["tuple-fsdp"]["said"] == ""  # rank 0 speaks for all


def test_experts_that_may_not_run_in_every_forward_are_no_units():
    """A ModuleList of experts beside the layers that always run was found as 4 x Linear, and a rank whose
    batch skipped an expert never all-gathered its unit (the ranks waited until the timeout). Experts are not
    units when fit()'s first sample left one of them idle (mark_idle), or when their list is named for experts;
    a list named otherwise, all run, still gives its layers."""
    def model(list_name: str) -> nn.Module:
        m = nn.Module()
        m.inp, m.head = nn.Linear(8, 16), nn.Linear(16, 2)
        setattr(m, list_name, nn.ModuleList(nn.Linear(16, 16) for _ in range(4)))
        return m

    assert _described(model("layers")) == ("repeated", "4 x Linear")
    assert find_units(model("experts")).names == ("inp", "head")
    assert find_units(model("local_experts")).names == ("inp", "head")
    idle = model("layers")
    mark_idle([idle.layers[2]])
    assert find_units(idle).names == ("inp", "head")
    assert _described(model("layers")) == ("repeated", "4 x Linear")  # another model's lists: not idle
