"""scaletrain.batch: any batch layout and any model output, read without assuming a tensor."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.batch import (
    Batch,
    Batcher,
    backward_scalar,
    check_targets,
    collate,
    default_loss,
    logits_of,
    loss_of,
    one_sample,
)
from scaletrain.errors import CheckpointError, ConfigError, DataError, TrainingFailed, UserError
from scaletrain.observe.throughput import flops_per_sample


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Keywords(nn.Module):
    """A transformers-style forward: named inputs, labels optional, the loss computed inside."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.lin(features)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


@dataclasses.dataclass
class Output:  # a ModelOutput-like dataclass
    logits: torch.Tensor
    loss: torch.Tensor | None = None


X, Y = torch.randn(5, 4), torch.tensor([0, 1, 2, 1, 0])


def test_tuple_batches_of_any_length_put_the_target_last() -> None:
    split = Batcher(Plain())
    two = split((X, Y))
    assert two.args[0] is X and two.kwargs == {} and two.target is Y
    three = split([X, X * 2, Y])
    assert len(three.args) == 2 and three.args[1].equal(X * 2) and three.target is Y
    one = split((X,))
    assert one.args == (X,) and one.target is None
    bare = split(X)
    assert bare.args == (X,) and bare.target is None


class NanoGPTLike(nn.Module):
    """nanoGPT's convention: forward(idx, targets=None); without targets only the last position's logits."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(8, 8)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple:
        logits = self.table(idx)
        if targets is None:
            return logits[:, [-1], :], None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_a_tuple_target_goes_to_a_forward_parameter_named_for_it_that_the_inputs_leave_unfilled() -> None:
    ids = torch.randint(0, 8, (3, 5))
    nano = Batcher(NanoGPTLike())((ids[:, :-1], ids[:, 1:]))
    assert nano.args[0] is not None and nano.kwargs["targets"] is nano.target
    logits, _ = nano(NanoGPTLike())
    assert logits.shape == (3, 4, 8)  # the training output, not generation's last position

    class Filled(nn.Module):  # y is an input here: the tuple (x, y, target) fills it by position
        def forward(self, x: torch.Tensor, y: torch.Tensor, label: torch.Tensor | None = None) -> torch.Tensor:
            return x + y

    three = Batcher(Filled())((X, X, Y))
    assert len(three.args) == 2 and three.kwargs == {"label": Y}

    class KeywordOnly(nn.Module):
        def forward(self, x: torch.Tensor, *, labels: torch.Tensor | None = None) -> torch.Tensor:
            return x

    class Starred(nn.Module):  # *rest would take a target given by position: left alone
        def forward(self, x: torch.Tensor, *rest: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
            return x

    assert Batcher(KeywordOnly())((X, Y)).kwargs == {"labels": Y}
    assert Batcher(Starred())((X, Y)).kwargs == {} and Batcher(Plain())((X, Y)).kwargs == {}


def test_logits_that_do_not_match_the_class_targets_are_one_line() -> None:
    with pytest.raises(UserError) as exc:
        default_loss(torch.randn(3, 1, 8), torch.zeros(3, 4, dtype=torch.long))
    msg = str(exc.value)
    assert "\n" not in msg and "logits of shape (3, 1, 8) for class targets of shape (3, 4)" in msg and "fix:" in msg
    assert default_loss(torch.randn(3, 4, 8), torch.zeros(3, 4, dtype=torch.long)).shape == ()


@pytest.mark.parametrize("logits, target", [((5, 1), (5, 1)), ((5, 1), (5,)), ((5, 3), (5,)), ((5,), (5,))])
def test_float_targets_that_are_not_class_probabilities_are_one_line(logits, target) -> None:
    with pytest.raises(UserError) as exc:  # a regression given no loss: a cross-entropy over 1 class would be 0
        default_loss(torch.randn(*logits), torch.randn(*target))
    msg = str(exc.value)
    assert "\n" not in msg and f"float32 of shape {target}" in msg and "loss_fn=torch.nn.functional.mse_loss" in msg
    soft = torch.softmax(torch.randn(5, 3), dim=-1)  # class probabilities: the logits' shape, a real cross-entropy
    assert default_loss(torch.randn(5, 3), soft) > 0


def test_targets_the_default_loss_cannot_take_are_one_line_before_training() -> None:
    """check_targets, on the first sample's output: multi-hot rows are not class probabilities (they want a
    binary cross-entropy), class ids must fit the logits (every id, where the data are in memory); int32 ids
    (numpy's on Windows, a pandas column) are taken as int64."""
    logits = torch.randn(2, 4)
    with pytest.raises(UserError, match=r"not class probabilities \(the first sample's are \[1, 0, 1, 0\]: they sum "
                                        r"to 2\).*binary_cross_entropy_with_logits"):
        check_targets(logits, torch.tensor([[1.0, 0.0, 1.0, 0.0]]))
    check_targets(logits, torch.tensor([[0.7, 0.1, 0.1, 0.1]]))  # soft labels
    own = (logits, torch.tensor(1.0))  # nanoGPT's (logits, loss), given its targets: its loss, its targets
    check_targets(own, torch.tensor([[1.0, 0.0, 1.0, 0.0]]), own_in_tuple=True)
    check_targets({"logits": logits, "loss": torch.tensor(1.0)}, torch.tensor([[1.0, 0.0, 1.0, 0.0]]))  # its own loss
    with pytest.raises(UserError, match=r"class target 4 for logits of 4 classes \(targets are 0..3, or -100 to "
                                        r"ignore a position\); fix: a model with one output per class \(5 here\)"):
        check_targets(logits, torch.tensor([1]), targets=torch.tensor([0, 3, 4, -100]))
    check_targets(logits, torch.tensor([1]), targets=torch.tensor([0, 3, -100]))
    with pytest.raises(UserError, match=r"class target -1 for logits of 4 classes"):
        check_targets(logits, torch.tensor([-1]))
    ids = torch.tensor([0, 3, 1], dtype=torch.int32)
    three = logits.repeat(2, 1)[:3]
    assert default_loss(three, ids).item() == F.cross_entropy(three, ids.long()).item()
    with pytest.raises(UserError, match=r"loss: Target 7 is out of bounds. \(4 logits: class targets are 0..3"):
        default_loss(logits, torch.tensor([0, 7]))


def test_dict_batches_pass_the_keys_forward_takes_and_labels_are_the_target() -> None:
    batch = Batcher(Keywords())({"features": X, "labels": Y, "idx": torch.arange(5)})
    assert set(batch.kwargs) == {"features", "labels"}  # idx is not an argument of forward: left out
    assert batch.target is Y
    out = batch(Keywords())
    assert loss_of(out) is not None and logits_of(out).shape == (5, 3)


class Anything(nn.Module):
    """A forward as Hugging Face's: a few named arguments, the rest through **kwargs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, features: torch.Tensor, names: list[str] | None = None, **kwargs: torch.Tensor) -> torch.Tensor:
        assert all(isinstance(v, torch.Tensor) for v in kwargs.values()), kwargs
        return self.lin(features)


def test_fields_that_are_no_tensor_reach_a_kwargs_forward_only_by_name(caplog) -> None:
    """A dataset's string ids reached forward(**kwargs) and failed inside the model; now they are left out, said
    once, unless forward names them; tensors still go through **kwargs."""
    batcher = Batcher(Anything())
    with caplog.at_level("WARNING", logger="scaletrain"):
        for _ in range(2):
            batch = batcher({"features": X, "labels": Y, "mask": torch.ones(5), "id": ["a"] * 5, "names": ["n"] * 5})
    assert set(batch.kwargs) == {"features", "labels", "mask", "names"} and batch.target is Y
    said = [r.getMessage() for r in caplog.records]
    assert said == [("data: 'id' (list) in the batch: not a tensor, and Anything.forward does not name it: left out "
                     "of the model's inputs")]
    assert batch(Anything()).shape == (5, 3)


def test_dict_keys_that_forward_cannot_take_are_one_clear_error() -> None:
    with pytest.raises(UserError, match=r"keys \['a', 'b'\] has none that the model's forward takes.*batch_fn.*"
                       r"the whole dict: batch_fn=lambda b: \(\(b,\), None\)"):
        Batcher(Plain())({"a": X, "b": Y})


class WholeBatch(nn.Module):
    """Lightning's way: forward(batch) reads the dict itself and returns its loss."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, batch, scale: float = 1.0) -> dict:
        logits = self.lin(batch["features"]) * scale
        return {"loss": F.cross_entropy(logits, batch["label"]), "logits": logits}


class Annotated(Plain):
    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return self.lin(inputs["x"])


def test_a_forward_of_the_whole_batch_dict_is_given_it() -> None:
    """forward(batch), or one argument annotated as a dict, gets the dict whole (it names none of its keys);
    the target is still read from it, and the model is known to be given it (it computes its own loss)."""
    ids = torch.randint(0, 9, (5, 7))
    batch = Batcher(WholeBatch())({"features": X, "label": Y, "input_ids": ids})
    assert batch.args[0].keys() == {"features", "label", "input_ids"} and batch.kwargs == {}
    assert batch.target is Y and batch.target_given() and batch.tokens_per_sample() == 7
    out = batch.to(torch.device("cpu"))(WholeBatch())
    assert out["loss"].shape == () and out["logits"].shape == (5, 3)
    assert Batcher(Annotated())({"x": X}).args[0].keys() == {"x"}
    # a key the forward names goes by name, as before; a forward of a tensor stays a one-line error
    assert Batcher(Annotated())({"inputs": X}).kwargs.keys() == {"inputs"}
    with pytest.raises(UserError, match="has none that the model's forward takes"):
        Batcher(Plain())({"features": X})
    split = Batcher(WholeBatch(), batch_fn=lambda b: (b, b["label"]))({"features": X, "label": Y})
    assert split.args[0].keys() == {"features", "label"} and split.target is Y


def test_batch_fn_maps_any_layout_to_inputs_and_target() -> None:
    split = Batcher(Keywords(), batch_fn=lambda b: ({"features": b["img"]}, b["cls"]))
    batch = split({"img": X, "cls": Y})
    assert batch.kwargs.keys() == {"features"} and batch.target is Y
    with pytest.raises(UserError, match="batch_fn returned a Tensor; fix: return \\(inputs, target\\)"):
        Batcher(Plain(), batch_fn=lambda b: b[0])((X, Y))


def test_an_unknown_batch_type_is_one_clear_error() -> None:
    with pytest.raises(UserError, match="a batch of type str; fix:"):
        Batcher(Plain())("not a batch")


def test_default_loss_takes_the_models_own_loss_else_cross_entropy_of_its_logits() -> None:
    logits = torch.randn(5, 3)
    want = F.cross_entropy(logits, Y)
    assert default_loss(logits, Y).item() == want.item()
    assert default_loss((logits, torch.zeros(1)), Y).item() == want.item()  # a tuple: its first tensor
    assert default_loss({"logits": logits}, Y).item() == want.item()
    assert default_loss(Output(logits), Y).item() == want.item()
    own = torch.tensor(0.25)
    assert default_loss(Output(logits, own), Y) is own
    assert default_loss({"logits": logits, "loss": own}, None) is own
    with pytest.raises(UserError, match="with no loss, and the batch has no target; fix: pass loss_fn"):
        default_loss(logits, None)
    assert default_loss(own, None) is own and default_loss(own, Y) is own  # one number returned: the loss
    # torchvision's segmentation output: an OrderedDict of out and aux, a tensor target ("a OrderedDict ... fix:
    # ... batches (inputs, target) with a tensor target", which it had)
    from collections import OrderedDict

    with pytest.raises(UserError, match=r"^loss: the model returned an OrderedDict \(fields: out, aux\) with no loss "
                                        r"and no logits, .* fix: pass loss_fn="):
        default_loss(OrderedDict(out=torch.randn(5, 3, 4, 4), aux=torch.randn(5, 3, 4, 4)), torch.zeros(5, 4, 4))


def test_a_tuples_scalar_is_the_models_own_loss_only_when_it_was_given_the_targets() -> None:
    """nanoGPT's (logits, loss) and transformers' (loss, logits) with return_dict=False: the model's loss
    (its label smoothing, its ignore_index) when it was given the targets; a scalar beside the logits of a model
    given none is an auxiliary loss, and the cross-entropy of the logits stays the loss."""
    logits, own = torch.randn(5, 3), torch.tensor(0.25)
    want = F.cross_entropy(logits, Y)
    assert default_loss((logits, own), Y, own_in_tuple=True) is own
    assert logits_of((own, logits)) is logits  # transformers' (loss, logits): the scalar is not the prediction
    assert default_loss((own, logits), Y, own_in_tuple=True) is own
    assert default_loss((logits, own), Y).item() == want.item()
    assert default_loss((logits, None), Y, own_in_tuple=True).item() == want.item()  # no scalar: none computed

    class NanoGPTLike(nn.Module):
        def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple:
            return idx.float(), None

    given = Batcher(NanoGPTLike())((torch.zeros(2, 3), torch.ones(2, 3)))
    assert given.target_given()
    assert not Batcher(Plain())((torch.zeros(2, 3), torch.ones(2))).target_given()
    assert not Batcher(Plain())(torch.zeros(2, 3)).target_given()


def test_backward_scalar_reaches_every_differentiable_output() -> None:
    a = torch.ones(2, requires_grad=True)
    b = torch.ones(3, requires_grad=True)
    backward_scalar({"x": a * 2, "nested": [b * 3, torch.zeros(1)]}).backward()
    assert a.grad.tolist() == [2.0, 2.0] and b.grad.tolist() == [3.0, 3.0, 3.0]
    with pytest.raises(UserError, match="holds no tensor that requires grad"):
        backward_scalar((torch.zeros(1),))


def test_flops_are_counted_for_tuple_dict_and_dataclass_outputs_alike() -> None:
    """The FLOP counter crashed on any output but a tensor; the same linear layer counts the same FLOPs
    whatever the output's container: forward 2 x 4 x 3 = 24 per sample, backward 24 more for the weight's
    gradient (the input needs none)."""
    class Tupled(Plain):
        def forward(self, x: torch.Tensor):  # type: ignore[override]
            return self.lin(x), x.mean()

    class Dataclassed(Plain):
        def forward(self, x: torch.Tensor):  # type: ignore[override]
            return Output(self.lin(x))

    one = Batch((X[:1],), {}, None)
    counts = [flops_per_sample(m, one) for m in (Plain(), Tupled(), Dataclassed())]
    assert counts == [48.0, 48.0, 48.0]
    kw = one_sample(Batcher(Keywords()), [{"features": X[0], "labels": Y[0]}])
    assert flops_per_sample(Keywords(), kw) == 48.0  # the loss adds no matmul


def test_batches_move_to_a_device_and_repeat_to_a_batch_size() -> None:
    batch = Batcher(Keywords())({"features": X[:1], "labels": Y[:1]})
    moved = batch.to(torch.device("cpu"))
    assert moved.kwargs["features"].equal(X[:1])
    four = batch.repeat(4)
    assert four.kwargs["features"].shape == (4, 4) and four.target.shape == (4,) and four.size() == 4


def test_tokens_per_sample_only_for_integer_token_inputs() -> None:
    assert Batch((torch.zeros(2, 16, dtype=torch.long),), {}, None).tokens_per_sample() == 16
    assert Batch((), {"input_ids": torch.zeros(2, 8, dtype=torch.int32)}, None).tokens_per_sample() == 8
    assert Batch((torch.zeros(2, 16),), {}, None).tokens_per_sample() == 0  # float features, not tokens
    assert Batch((torch.zeros(2, dtype=torch.long),), {}, None).tokens_per_sample() == 0  # one id per sample


@pytest.mark.parametrize("err", [
    ConfigError("run.dir", "runs/x", "a new run directory", "--run.dir=runs/x-2", "command line"),
    DataError("data/train.bin", "not found", "point --data.path at it"),
    CheckpointError("runs/x/checkpoints/step-1", "damaged", "resume from another"),
    UserError("data: something; fix: this"),
    TrainingFailed("loss is nan at step 3; fix: lower --optim.lr"),
])
def test_errors_survive_pickling_between_ranks(err: Exception) -> None:
    """Rank 0 broadcasts its refusal as a pickled object; rank 1 could not rebuild a ConfigError before."""
    err.agreed = True  # type: ignore[attr-defined]
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err) and back.agreed is True
    assert back.__dict__ == err.__dict__


def test_a_batchnorm1d_model_is_counted_though_it_refuses_a_batch_of_one() -> None:
    """A training-mode BatchNorm1d raises on a single sample; the counter runs two and halves."""
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    assert flops_per_sample(model, Batch((X[:1],), {}, None)) == 48.0
    assert model[1].running_mean.abs().sum() == 0  # counting leaves the statistics as they were


def test_tied_weights_are_found_from_the_module() -> None:
    """A gathered FSDP state dict holds a copy per name; the tie comes from the module's own registrations."""
    from scaletrain.train.state import tied

    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    assert tied(model) == {"head.weight": "emb.weight"}
    assert tied(Plain()) == {}


def test_number_lists_as_unformatted_hugging_face_datasets_give_them_collate_to_tensors() -> None:
    rows = [{"input_ids": [1, 2, 3], "mask": [[1, 0], [0, 1]], "labels": 0, "text": "a"},
            {"input_ids": [4, 5, 6], "mask": [[1, 1], [0, 0]], "labels": 1, "text": "b"}]
    batch = collate(rows)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 5, 6]] and batch["mask"].shape == (2, 2, 2)
    assert batch["labels"].tolist() == [0, 1] and batch["text"] == ["a", "b"]
    pairs = collate([([0.5, 1.5], 1), ([2.5, 3.5], 0)])  # a tuple sample's list of floats too
    assert pairs[0].tolist() == [[0.5, 1.5], [2.5, 3.5]] and pairs[0].dtype == torch.float32
    assert collate([(X[0], Y[0]), (X[1], Y[1])])[0].equal(X[:2])  # tensors as default_collate gives them


def test_samples_of_unequal_length_in_one_batch_are_one_line_naming_the_field() -> None:
    with pytest.raises(UserError) as exc:
        collate([{"input_ids": [1, 2, 3], "labels": 0}, {"input_ids": [4, 5], "labels": 1}])
    msg = str(exc.value)
    assert "\n" not in msg and "field 'input_ids' has different shapes in one batch ((2,) and (3,))" in msg
    assert "fix: pad each batch with collate_fn=" in msg and "padding='max_length'" in msg


class Listed(nn.Module):
    """torchvision's detection interface: a list of images, a list of target dicts."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, images: list[torch.Tensor], targets: list[dict] | None = None) -> torch.Tensor:
        return self.lin(torch.stack([im.mean((1, 2)) for im in images]))


class Masked(Plain):
    def forward(self, x: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.lin(x @ mask)


def test_a_batch_of_one_grows_as_the_loader_collates_its_copies() -> None:
    """repeat(n) stacked every tensor along a batch dimension: a list of images (torchvision's detection
    batches) or a tensor a collate_fn gives once per batch (a shared mask) did not stack (a RuntimeError
    before step one). It now collates the copies where stacking is not what the loader does; the
    common case still stacks (no collate per measured batch)."""
    samples = [(torch.rand(3, 5 + i, 7), {"labels": torch.tensor([i])}) for i in range(3)]
    listed = one_sample(Batcher(Listed()), samples, lambda b: tuple(zip(*b)))
    assert listed.grow is not None and listed.size() == 1
    four = listed.repeat(4)
    assert four.size() == 4 and len(four.args[0]) == 4 and all(im.shape == (3, 5, 7) for im in four.args[0])
    assert [t["labels"].item() for t in four.target] == [0, 0, 0, 0] and four.kwargs["targets"] is four.target
    # a tuple of stacked inputs (samples of ((x1, x2), y)) keeps its batch dimension; a listed batch counts items
    pairs = [((torch.randn(5), torch.randn(2)), torch.tensor(0.5)) for _ in range(3)]
    paired = Batcher(Plain())
    assert one_sample(paired, pairs).size() == 1 and not paired.listed
    assert paired(collate(pairs)).size() == 3
    detector = Batcher(Listed())
    one_sample(detector, samples, lambda b: tuple(zip(*b)))
    assert detector.listed and detector(((samples[0][0], samples[1][0]), (samples[0][1], samples[1][1]))).size() == 2
    meta = listed.to(torch.device("meta")).repeat(2)  # a map carries over to the grown batch
    assert all(im.device.type == "meta" for im in meta.args[0])
    shared = lambda b: {"x": torch.stack([s[0] for s in b]), "mask": torch.ones(4, 4), "labels": torch.stack(
        [s[1] for s in b])}
    rows = [(torch.randn(4), torch.tensor(1)) for _ in range(2)]
    masked = one_sample(Batcher(Masked()), rows, shared)
    assert masked.repeat(3).kwargs["mask"].shape == (4, 4) and masked.repeat(3).kwargs["x"].shape == (3, 4)
    stacked = one_sample(Batcher(Plain()), [(torch.randn(4), torch.tensor(1))])
    assert stacked.grow is None and stacked.repeat(3).args[0].shape == (3, 4)
