"""Every random number generator a training process draws from, as a tree of tensors and plain values.

Python's ``random``, NumPy's global generator, torch's CPU generator and, on a GPU, the device's generator.
Restoring all four makes dropout masks, augmentations and anything a user's code draws continue exactly.
A generator of the user's own (``torch.Generator(device).manual_seed(seed + rank)``, ``np.random.default_rng``)
is saved and put back by ``generator_state`` / ``set_generator_state`` when given to st.track().
"""

from __future__ import annotations

import random
import types
from typing import Any

import numpy as np
import torch


def capture(device: torch.device) -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore(state: dict[str, Any], device: torch.device) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    nps = state["numpy"]
    np.random.set_state((nps["name"], nps["keys"].numpy().astype(np.uint32), nps["pos"], nps["has_gauss"],
                         nps["cached"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def is_generator(obj: Any) -> bool:
    """A random number generator of the user's own (st.track() takes it): ``generator_state`` saves it unless
    it is ``stateless``."""
    return isinstance(obj, (torch.Generator, np.random.Generator, np.random.BitGenerator, np.random.RandomState,
                            random.Random))


def stateless(obj: Any) -> bool:
    """random.SystemRandom: it draws from the operating system and has no state to save."""
    return isinstance(obj, random.SystemRandom)


def _kind(obj: Any) -> str:
    if isinstance(obj, torch.Generator):
        return "torch"
    return "python" if isinstance(obj, random.Random) else "numpy"


def _plain(node: Any) -> Any:
    """NumPy's state values as a checkpoint tree holds them: an array as ("ndarray", dtype, values)."""
    if isinstance(node, np.ndarray):
        return ("ndarray", node.dtype.str, node.tolist())
    if isinstance(node, np.generic):
        return node.item()
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    return node


def _numpy(node: Any) -> Any:
    if isinstance(node, tuple) and len(node) == 3 and node[0] == "ndarray":
        return np.array(node[2], dtype=np.dtype(node[1]))
    if isinstance(node, dict):
        return {k: _numpy(v) for k, v in node.items()}
    return node


def generator_state(obj: Any) -> dict[str, Any]:
    """The state of one generator (``is_generator``) as a checkpoint tree: tensors and plain values."""
    if isinstance(obj, torch.Generator):
        return {"kind": "torch", "state": obj.get_state()}
    if isinstance(obj, random.Random):
        version, internal, gauss = obj.getstate()
        return {"kind": "python", "version": version, "state": torch.tensor(internal, dtype=torch.int64),
                "gauss": gauss}
    if isinstance(obj, np.random.RandomState):
        return {"kind": "numpy", "state": _plain(obj.get_state(legacy=False))}
    bits = obj.bit_generator if isinstance(obj, np.random.Generator) else obj
    return {"kind": "numpy", "state": _plain(bits.state)}


def set_generator_state(obj: Any, state: dict[str, Any]) -> None:
    """Put back what ``generator_state`` gave for this generator; ValueError for another kind's state (numpy's
    own for another bit generator's)."""
    kind = _kind(obj)
    if state.get("kind") != kind:
        raise ValueError(f"it holds a {state.get('kind')} generator's state, not a {kind} one's")
    if isinstance(obj, torch.Generator):
        obj.set_state(state["state"])
    elif isinstance(obj, random.Random):
        obj.setstate((state["version"], tuple(int(v) for v in state["state"].tolist()), state["gauss"]))
    elif isinstance(obj, np.random.RandomState):
        obj.set_state(_numpy(state["state"]))
    else:
        bits = obj.bit_generator if isinstance(obj, np.random.Generator) else obj
        bits.state = _numpy(state["state"])


def named_generators(names: dict[str, Any]) -> dict[str, Any]:
    """name -> generator for the generators among these variables (a loop's locals and its module's globals),
    and one attribute deep into the objects among them (a model's or a trainer's own ``self.rng``, named
    ``model.rng``; not into torch's, NumPy's or scaletrain's objects: a DataLoader's generator is its own): not
    the global ones ``capture`` saves, each generator once, by the first name found."""
    own = {id(random._inst), id(np.random.mtrand._rand), id(torch.default_generator)}  # capture()'s
    found: dict[str, Any] = {}

    def take(name: str, value: Any) -> None:
        if is_generator(value) and not stateless(value) and id(value) not in own and \
                not any(g is value for g in found.values()):
            found[name] = value

    for name, value in names.items():
        take(name, value)
    for name, value in names.items():
        attributes = getattr(value, "__dict__", None)
        library = type(value).__module__.partition(".")[0] in ("torch", "numpy", "scaletrain")  # their own
        if isinstance(attributes, dict) and not library and not isinstance(value, (type, types.ModuleType,
                                                                                    types.FunctionType)):
            for attr, inner in list(attributes.items()):
                take(f"{name}.{attr}", inner)
    return found
