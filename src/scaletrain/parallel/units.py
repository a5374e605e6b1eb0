"""Which submodules are a model's repeated blocks: the units FSDP shards one at a time, activation
checkpointing checkpoints and compile compiles, found once by one function for all three.

The first rule that finds any wins:

1. ``parallel.fsdp_units`` (class names, comma-separated): every module of those classes;
2. a ``blocks`` ModuleList or Sequential on the model (scaletrain's GPT, or any model that names its blocks
   so): its children;
3. transformers' ``_no_split_modules`` (class names a model declares indivisible: ``GPT2Block``,
   ``LlamaDecoderLayer``): every module of those classes, when the model or a submodule declares them, but a
   stage's blocks in place of the stage (ConvNext's, Swin's: most of its parameters in a list of blocks);
4. repeated blocks: of the classes that fill a ModuleList or Sequential on their own (two or more children in
   all such lists, wherever they are nested: nanoGPT's ``transformer.h``, Llama's ``model.layers``, Funnel's
   one list per stage), or that are blocks beside other modules in one (two or more there, more than a layer of
   leaf modules: torchvision's MobileNet ``features``, 15 InvertedResidual between a stem and a last
   convolution; DenseNet's _DenseBlock, a ModuleDict with a forward), the one with the most parameters and any
   other with at least a quarter as many (an encoder-decoder's two kinds of layer: torch's nn.Transformer left
   its encoder's in the root); every child of those classes in those lists, so a ResNet's ``layer1`` ..
   ``layer4`` give all its BasicBlocks or Bottlenecks, one unit each (per block rather than per stage: a late
   stage holds most of the parameters), and a stage class that chains blocks of another such class (timm's
   ConvNeXt, Swin, EfficientNet; DenseNet's _DenseBlock) gives way to all the blocks of its chain (a module of
   that class holding no chain stays a unit: SSDlite's heads are Sequentials as its stages are); a block that
   chains layers (MobileNet's InvertedResidual: Conv2dNormActivation, a Sequential of a convolution, a norm and
   an activation) stays the unit;
5. no repeated blocks: the model's direct children that hold parameters, when there are two or more (the
   built-in CNN's ``features`` and ``head``), else those of its one such child, as deep as it takes (a model
   whose layers are one ``nn.Sequential`` of different layers: its layers).

Then four rules for all: a container without a forward (a ModuleList) stands for its children, which
fully_shard can call; a module that may not run in every forward is no unit, nor is any module of the
container it is in (fit() marks idle those whose forward its first sample did not run: a mixture of experts'
experts, which each rank's batch picks its own of; a container named for experts counts so without it; a unit
run by some ranks only would gather its parameters on those ranks alone, and the collectives mismatch); a unit
inside another unit is not a unit of its own (the outer one covers it), and a
unit holding a parameter that a module outside it also holds (tied embedding and head across a unit's
border) is left to the root: fully_shard keeps a parameter tied only among the modules of one call, so a
unit would shard its own copy and the module outside would keep the old one (measured: two parameters where
there was one, trained apart). Embeddings tied to the head both outside the blocks (nanoGPT, GPT-2) stay
with the root as they are.
"""

from __future__ import annotations

import weakref
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from torch import nn

from scaletrain.errors import ConfigError
from scaletrain.sharded import fsdp_class

FIX = "--parallel.fsdp_units=MyBlock (the class names of its repeated layers, comma-separated)"


@dataclass(frozen=True)
class Units:
    """The units of one model: the modules, their qualified names, the rule that found them (parallel.fsdp_units,
    model.blocks, _no_split_modules, repeated, children or none), and the candidates left to the root because
    they share a parameter with a module outside them (as 'name (class; why)')."""

    modules: tuple[nn.Module, ...]
    names: tuple[str, ...]
    rule: str
    left_to_root: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.modules)

    def describe(self) -> str:
        """'12 x GPT2Block' (per class, in model order); by name for the children rule ('features, head');
        '' when there are none."""
        if self.rule == "children":
            return ", ".join(self.names)
        counts = Counter(class_of(m).__name__ for m in self.modules)
        return ", ".join(f"{n} x {name}" for name, n in counts.items())


def class_of(module: nn.Module) -> type:
    """The module's own class, also after fully_shard swapped in its subclass FSDP<Name>."""
    sharded = fsdp_class()
    return next(c for c in type(module).__mro__ if not issubclass(c, sharded))


def split_names(value: str) -> tuple[str, ...]:
    """'Block, MoEBlock' -> ('Block', 'MoEBlock'); '' -> ()."""
    return tuple(n.strip() for n in value.split(",")) if value.strip() else ()


_IDLE: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules a forward did not run (mark_idle)


def mark_idle(modules: Iterable[nn.Module]) -> None:
    """Modules whose forward a model's forward did not run: they and the modules of their container are no
    units (module docstring)."""
    _IDLE.update(modules)


def find_units(model: nn.Module, names: str = "") -> Units:
    """The model's units by the module docstring's rules; ``names``: parallel.fsdp_units."""
    named = [(n, m) for n, m in model.named_modules() if m is not model]
    wanted = split_names(names)
    if wanted:
        found = _of_classes(named, set(wanted))
        missing = sorted(set(wanted) - {class_of(m).__name__ for _, m in found})
        if missing:
            raise ConfigError("parallel.fsdp_units", names, f"class names of modules in {class_of(model).__name__} "
                              f"(none is a {', '.join(missing)}; classes here with parameters: "
                              f"{_param_classes(named)})", f"--parallel.fsdp_units={_suggest(named)}")
        return _settle(model, found, "parallel.fsdp_units")
    off = _may_not_run(model)
    for rule, search in (("model.blocks", _blocks), ("_no_split_modules", _no_split), ("repeated", _repeated),
                         ("children", _children)):
        found = [(n, m) for n, m in _opened(search(model, named)) if id(m) not in off]
        if found:
            units = _settle(model, found, rule)
            if units.modules or units.left_to_root:
                return units
    return Units((), (), "none")


def _may_not_run(model: nn.Module) -> set[int]:
    """The ids of the modules that may not run in every forward: the idle ones, the modules of a container
    holding an idle one or named for experts (``experts``, ``local_experts``: a first sample of many tokens may
    reach them all, and a later batch not), and what is inside them."""
    idle = {id(m) for m in model.modules() if m in _IDLE}
    off = set(idle)
    for name, m in model.named_modules():
        kids = list(m.children())
        if _container(class_of(m)) and ("expert" in name.rsplit(".", 1)[-1].lower()
                                        or any(id(k) in idle for k in kids)):
            off.update(id(k) for k in kids)
    return {id(sub) for m in model.modules() if id(m) in off for sub in m.modules()}


def _of_classes(named: list[tuple[str, nn.Module]], classes: set[str]) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in named if class_of(m).__name__ in classes]


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _size(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _blocks(model: nn.Module, named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        return []
    if len(blocks) and all(class_of(b) is nn.Sequential for b in blocks):  # stages named so (timm's EfficientNet,
        return []  # MobileNetV3): the repeated rule finds their blocks
    where = {id(m): n for n, m in named}
    return [(where[id(b)], b) for b in blocks if id(b) in where]


def _no_split(model: nn.Module, named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Modules of the classes the model declares indivisible, but a stage gives way to its blocks, as under rule
    4: a module whose lists hold others of the declared classes (transformers' ConvNext declares ConvNextLayer
    and ConvNextStage, a Sequential of layers: the stages were the units, the last 56% of ConvNeXt-T's
    parameters), or two or more of one class that are more than layers of leaf modules and hold at least 3/4
    of its parameters (Swin declares SwinStage only; a mixture of experts' MLPs are layers). A declared module
    holding another directly (Mamba's MambaBlock its MambaMixer) stays the unit."""
    classes = {c for m in (model, *(m for _, m in named)) for c in (getattr(m, "_no_split_modules", None) or ())
               if isinstance(c, str)}
    found = _of_classes(named, classes) if classes else []
    declared = {id(m) for _, m in found}

    def blocks(sub: nn.Module) -> list[tuple[str, nn.Module]]:  # a list's blocks, if it is a stage's chain
        kids = [(k, c) for k, c in sub.named_children() if not _leaf(c)]
        if sum(id(c) in declared for _, c in kids) > 1:  # declared ones (ConvNext's layers in its stages)
            return [(k, c) for k, c in kids if id(c) in declared]
        same = len(kids) > 1 and len(kids) == len(sub) and len({class_of(c) for _, c in kids}) == 1
        return kids if same and not any(_layer(c) for _, c in kids) else []  # Swin's layers; never experts

    out = []
    for name, m in found:
        inner = [(f"{name}.{path}.{key}", block) for path, sub in m.named_modules() if sub is not m
                 and isinstance(sub, (nn.ModuleList, nn.Sequential)) for key, block in blocks(sub)]
        # declared blocks win; others where they hold most of it (Swin's: 94%, the rest a downsampling layer): a
        # block whose list holds a part of it (HGNetV2's BasicLayer: its aggregation convolutions) stays whole
        stage = any(id(b) in declared for _, b in inner) or \
            4 * sum(_size(b) for b in {id(b): b for _, b in inner}.values()) >= 3 * _size(m)
        out += inner if inner and stage else [(name, m)]
    return out


Run = tuple[str, nn.Module, type, list[tuple[str, nn.Module]]]  # (container's name, container, class, children)

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _runs(named: list[tuple[str, nn.Module]]) -> list[Run]:
    """The runs of blocks in every ModuleList or Sequential, and every ModuleDict with a forward of its own
    (torchvision's IntermediateLayerGetter, DenseNet's _DenseBlock; not a parametrized layer's parametrizations):
    all its children when they are of one class and hold parameters (the children: a parametrized layer's
    ParametrizationList holds its weight itself, and its _SpectralNorm or _WeightNorm, none, were the units of a
    spectral-norm discriminator, sharding nothing); in a container of several classes, the children of each
    class that is more than a layer and has two or more in some container (MobileNet's 15 InvertedResidual
    blocks between a stem and a last convolution), never layers (VGG's convolutions between activations)."""
    found = []
    for name, m in named:
        listed = isinstance(m, (nn.ModuleList, nn.Sequential)) or (isinstance(m, nn.ModuleDict)
                                                                   and not _container(class_of(m)))
        if not listed or not len(m) or not any(_has_params(c) for c in m.children()):
            continue
        by_class: dict[type, list[tuple[str, nn.Module]]] = defaultdict(list)
        for key, child in m.named_children():
            by_class[class_of(child)].append((key, child))
        found.append((name, m, by_class))
    # blocks: more than layers, two or more in one container somewhere (EdgeNeXt's ConvBlocks, then one per stage)
    blocks = {cls for _, _, by_class in found for cls, kids in by_class.items()
              if len(kids) > 1 and not all(_layer(c) for _, c in kids)}
    out: list[Run] = []
    for name, m, by_class in found:
        if len(by_class) == 1:
            out.append((name, m, *by_class.popitem()))
        else:
            out += [(name, m, cls, kids) for cls, kids in by_class.items()
                    if cls in blocks and any(_has_params(c) for _, c in kids)]
    return out


def _leaf(module: nn.Module) -> bool:
    """A module that holds no others (a Linear, a Conv2d, an activation)."""
    return next(module.children(), None) is None


def _layer(module: nn.Module) -> bool:
    """A module of leaf modules or none (a Linear; torchvision's Conv2dNormActivation: a convolution, a norm and
    an activation): a layer rather than a block of layers."""
    return all(_leaf(c) for c in module.children())


def _repeated(model: nn.Module, named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    # the model itself may be the Sequential of blocks; a list of lists is not one of blocks (Funnel's
    # encoder.blocks holds a ModuleList of layers per stage): its lists are looked into instead
    runs_of = [run for run in _runs([("", model), *named]) if not _container(run[2])]
    # a class repeated: two or more of it over its runs (Funnel with one layer per stage has two lists of one)
    count, size = Counter(), Counter()
    for _, _, cls, kids in runs_of:
        count[cls] += len(kids)
        size[cls] += sum(_size(c) for _, c in kids)
    repeated = [cls for cls in count if count[cls] > 1]
    if not repeated:
        return []
    largest = max(size[cls] for cls in repeated)
    chosen = {cls for cls in repeated if 4 * size[cls] >= largest}  # an encoder's layers and a decoder's, both
    stages, chains = _stages(runs_of, chosen)
    # A stage gives way to all its chain's blocks, also those of a class it holds once (EfficientFormer's last
    # stage ends in one MetaBlock1d, EdgeNeXt's stages in one SplitTransposeBlock): else they fell to the root.
    # Other modules of a stage's class stay units (SSDlite's heads are Sequentials, as its stages are).
    return [(_joined(name, key), child) for name, _, cls, kids in runs_of if cls in chosen
            for key, child in kids if id(child) not in stages] + \
        [(_joined(name, key), child) for name, m, _, _ in runs_of if id(m) in chains
         for key, child in m.named_children() if _has_params(child) and not _layer(child)]


def _joined(name: str, key: str) -> str:
    """A child's qualified name: ``key`` under the container ``name`` ('' for the model itself)."""
    return f"{name}.{key}" if name else key


def _stages(runs: list[Run], chosen: set[type]) -> tuple[set[int], set[int]]:
    """The modules of the chosen classes that are stages of blocks, and the chains they hold: each holds an
    nn.Sequential of another chosen class, blocks run one after another (timm's ConvNeXtStage,
    SwinTransformerStage, EfficientNet's stages). Their blocks are the units, as a ResNet's are: a stage of
    ConvNeXt-T holds up to 9 blocks and 61% of the parameters, and checkpointed whole it recomputes all its
    blocks at once. A block holding a ModuleList of one class (a mixture of experts' experts, called by routing,
    not in a chain) is no stage, nor one whose Sequential chains layers (_block_class: MobileNet's
    InvertedResidual chains three Conv2dNormActivation). A container with a forward of its own that chains
    blocks (DenseNet's _DenseBlock, a ModuleDict of _DenseLayer) is a stage too. By id."""
    chain = {id(m): cls for _, m, cls, kids in runs if cls in chosen and _block_class(cls, kids)
             and (isinstance(m, nn.Sequential) or not _container(class_of(m)))}  # or its own forward: DenseNet's
    stages, chains = set(), set()
    for _, _, cls, kids in runs:
        for _, child in kids if cls in chosen else ():
            held = {id(sub) for sub in child.modules() if chain.get(id(sub), cls) is not cls}
            if held:
                stages.add(id(child))
                chains |= held
    return stages, chains


def _block_class(cls: type, kids: list[tuple[str, nn.Module]]) -> bool:
    """Whether modules of ``cls`` chained in a Sequential are blocks, not layers: they hold modules, and their
    class is no Sequential subclass (torchvision's Conv2dNormActivation is one: a convolution, a norm and an
    activation; a stage made a Sequential is not chained, it chains)."""
    return not issubclass(cls, nn.Sequential) and not all(_leaf(c) for _, c in kids)


def _container(cls: type) -> bool:
    """A module class that only holds others (ModuleList, ModuleDict): no forward of its own, so fully_shard
    refuses it as a unit ("does not support containers that do not implement forward")."""
    return cls.forward is nn.Module.forward


def _children(model: nn.Module, named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The children holding parameters of the first module, from the model down through wrappers of one such
    child (``self.net = nn.Sequential(...)``, a model wrapping another), that has two or more."""
    prefix, module = "", model
    while True:
        children = [(f"{prefix}{n}", c) for n, c in module.named_children() if _has_params(c)]
        if len(children) != 1:
            return children if len(children) > 1 else []
        prefix, module = f"{children[0][0]}.", children[0][1]


def _settle(model: nn.Module, found: list[tuple[str, nn.Module]], rule: str) -> Units:
    """Each module once, outermost only, and none that shares a parameter with a module outside it; a container
    found (a ModuleList among a model's children, or named in parallel.fsdp_units) stands for its children."""
    first: dict[int, tuple[str, nn.Module]] = {}
    for name, module in _opened(found):
        first.setdefault(id(module), (name, module))
    inner = {id(sub) for _, m in first.values() for sub in m.modules() if sub is not m}
    outer = [(n, m) for n, m in first.values() if id(m) not in inner]
    holders = _holders(model)
    where = {id(m): n for n, m in model.named_modules()}
    kept, left = [], []
    for name, unit in outer:
        shared = _shared_outside(unit, holders, where)
        if shared:
            left.append(f"{name} ({class_of(unit).__name__}; {shared})")
        else:
            kept.append((name, unit))
    return Units(tuple(m for _, m in kept), tuple(n for n, _ in kept), rule, tuple(left))


def _opened(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Containers replaced by their children that hold parameters, as deep as containers nest."""
    out = []
    for name, module in found:
        if _container(class_of(module)):
            out += _opened([(f"{name}.{key}", child) for key, child in module.named_children() if _has_params(child)])
        else:
            out.append((name, module))
    return out


def _holders(model: nn.Module) -> dict[int, set[int]]:
    """id(parameter) -> the ids of the modules holding it as their own (more than one when tied)."""
    holders: dict[int, set[int]] = defaultdict(set)
    for m in model.modules():
        for p in m.parameters(recurse=False):
            holders[id(p)].add(id(m))
    return holders


def _shared_outside(unit: nn.Module, holders: dict[int, set[int]], where: dict[int, str]) -> str:
    """'' or which of the unit's parameters a module outside it also holds."""
    inside = {id(m) for m in unit.modules()}
    for sub_name, sub in unit.named_modules():
        for p_name, p in sub.named_parameters(recurse=False):
            outside = holders[id(p)] - inside
            if outside:
                other = where.get(next(iter(outside)), "?")
                own = f"{sub_name}.{p_name}" if sub_name else p_name
                return f"its {own} is tied to {other or 'the root'}"
    return ""


def _param_classes(named: list[tuple[str, nn.Module]]) -> str:
    classes = dict.fromkeys(class_of(m).__name__ for _, m in named
                            if _has_params(m) and not isinstance(m, CONTAINERS))
    return ", ".join(list(classes)[:12]) or "none"


def _suggest(named: list[tuple[str, nn.Module]]) -> str:
    """A class name to suggest: the repeated blocks this model has, else the class of its largest layer with
    parameters that is not a container (a fix that runs as typed; "MyBlock" was refused again)."""
    runs = _runs(named)
    if runs:
        return max(runs, key=lambda r: sum(_size(c) for _, c in r[3]))[2].__name__
    layers = [m for _, m in named if _has_params(m) and not isinstance(m, CONTAINERS)]
    return class_of(max(layers, key=_size)).__name__ if layers else "MyBlock"


def units_line(model: nn.Module, names: str = "", *, sharded: bool, blocks: bool) -> str:
    """What the header says about units: 'FSDP: 12 x GPT2Block + root' when sharded, 'blocks: 12 x Block' when
    only activation checkpointing or compile use them (``blocks``), '' when nothing does."""
    if not (sharded or blocks):
        return ""
    what = find_units(model, names).describe()
    if sharded:
        return f"FSDP: {what} + root" if what else "FSDP: the root only (no blocks found)"
    return f"blocks: {what}" if what else "blocks: none found, the whole model is one"


def unit_warnings(model: nn.Module, units: Units, *, sharded: bool, checkpointing: str) -> list[str]:
    """The warnings to say once: candidates left to the root, and no units where FSDP or activation
    checkpointing needs them (compile alone is as good on the whole model)."""
    costs = {}
    if sharded:
        costs["FSDP"] = "FSDP gathers the whole model for every forward and backward (only the state between " \
                        "steps stays sharded)"
    if checkpointing != "none":
        costs["activation checkpointing"] = "activation checkpointing recomputes the whole forward at once in " \
                                            "backward (little memory saved)"
    said = []
    if costs and units.left_to_root:
        said.append(f"{' and '.join(costs)}: left to the root, as a tied parameter must live in one unit: "
                    + "; ".join(units.left_to_root))
    if costs and not units.modules:
        said.append(f"no repeated blocks found in {class_of(model).__name__}: {'; '.join(costs.values())}; "
                    f"fix: {FIX}")
    return said
