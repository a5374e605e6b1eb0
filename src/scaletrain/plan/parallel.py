"""Plans beyond data parallelism: ZeRO stages, tensor (tp) and pipeline (pp) degrees, and a search over
dp x tp x pp layouts of a GPU count for the fastest and the cheapest that fit.

Model state (mixed-precision AdamW as the rest of the planner counts it: fp32 parameters 4 bytes, which are
the master copy, fp32 gradients 4, two fp32 moments 8: 16 bytes per parameter) per GPU, over ``n``
data-parallel ranks: ddp 16; zero1 (optimizer state sharded) 4 + 4 + 8/n; zero2 (and gradients) 4 + 12/n;
fsdp (ZeRO-3, and parameters) 16/n; hsdp ZeRO-3 over one machine's data-parallel ranks.

Tensor parallelism over t ranks (a Llama: parallel/tensor.py splits its matrices by heads and MLP units, the
embedding by vocabulary rows, the head by vocabulary columns) divides every parameter of 2 or more dimensions
by t; the norms' vectors stay whole on each rank. Pipeline parallelism over p stages gives stage i its share
of the blocks (the first n_layer % p stages one more, as parallel/pipeline.py splits them), the embeddings to
stage 0 and the final norm and head to the last (a GPT's tied head: a copy on the last stage when p > 1).

Activations are measured on fake tensors: what one block keeps and the rest (embeddings, head, logits and
loss, the block recomputed under full checkpointing), on the tensor-parallel step itself at each tp (plan/
estimate.py with_tp_activations: torch's fake process group, one process playing rank 0); a stage holds its
blocks' share of one micro-batch's step and, for each further micro-batch in flight (1F1B: stage i holds
p - i, GPipe all m), what forward keeps of its blocks until their backward (ModelFacts.block_kept: under
checkpointing the step's peak comes at its end and does not grow with depth, the inputs kept do), the rest
whole on every stage: exact at p = 1, an overestimate elsewhere; and what the stages' edges hold (stage_edges:
torch's receive buffers, outputs kept for backward, input gradients). Where the fake process group cannot be
had, Korthikanti et al. 2022's ratio ("Reducing Activation Recomputation in Large Transformer Models", table
2) at t to t = 1 (with sequence parallelism exactly 1/t) divides the block measured at t = 1; it is 7-20% low
for torch's tensor parallelism, which keeps the all-gathered inputs of the column-parallel matmuls whole for
backward (tests/dist/test_plan_memory_real.py). The largest stage is the layout's.

Time per step, at a global batch held fixed (the config's, as the data-parallel table plans it) in the
trainer's micro-batches (Setting.batch_size: data.batch_size, or under the config's pipeline data.batch_size /
parallel.microbatches, as the trainer splits it): n = global batch / (dp x micro-batch) per pipeline
(accumulation steps when p = 1). compute = FLOPs / (GPUs x peak x MFU), the stages assumed equal;
the pipeline bubble adds (p - 1) / (v m) of it (Narayanan et al. 2021, v = 1: no interleaving). Communication
per GPU: tensor parallelism 4 collectives per block per micro-batch (2 forward, 2 backward; 6 with full
checkpointing's second forward) of s x b x h elements in the compute dtype, each an all-reduce (or with
sequence parallelism an all-gather plus a reduce-scatter: the same bytes), 2 (t - 1)/t of them on the wire,
within a machine; pipeline point-to-point of one micro-batch's activations forward and their gradients back
per micro-batch (s x b x h / t elements each: sequence-parallel); data parallelism as the data-parallel table
plans it, over the stage's tensor-parallel shard of the parameters. Overlap: the data-parallel collectives
overlap compute (step = max, as in the data-parallel table), tensor- and pipeline-parallel ones are on the
critical path and add (exposed): step = max(compute x (1 + bubble), dp comm) + tp comm + pp comm.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from scaletrain.plan.estimate import AC_SEARCHED, RECOMPUTE, PerGpuBytes, compute_bytes, dp_comm_s

ZERO_KINDS = ("ddp", "zero1", "zero2", "fsdp", "hsdp")
ZERO_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3, "hsdp": 3}
MAX_TP = 8  # tensor parallelism stays within a machine (NVLink), at most 8 ways


@dataclass(frozen=True)
class Structure:
    """Where a block model's parameters are, counted on the meta device (elements)."""

    n_layer: int
    block_matrices: int  # parameters of >= 2 dimensions in one block (split by tensor parallelism)
    block_vectors: int  # 1-D parameters in one block (norms, biases: whole on every tensor-parallel rank)
    first_matrices: int  # outside the blocks, on the first stage: the embeddings
    last_matrices: int  # outside the blocks, on the last stage: the head (0 when tied to the embedding)
    last_vectors: int  # the final norm
    tied: int  # parameters the first and last stage share (a tied head): a copy on each when p > 1
    n_embd: int
    n_head: int
    seq_len: int
    tp_divides: tuple[int, ...]  # what a tensor-parallel degree must divide (heads, key/value heads, MLP, sequence)
    tp_why_not: str = ""  # why this model cannot be split by tensor parallelism ("" if it can)
    block_split_vectors: int = 0  # of block_vectors, those split with their matrix (the GPT's column-split biases)
    first_whole: int = 0  # of first_matrices, those whole on every tensor-parallel rank (the GPT's position table)

    @property
    def params(self) -> int:
        return (self.n_layer * (self.block_matrices + self.block_vectors) + self.first_matrices + self.last_matrices
                + self.last_vectors)


def structure(model: Any, seq_len: int) -> Structure:
    """The Structure of a built-in GPT or Llama (built on the meta device: no memory)."""
    from scaletrain.models import GPT, Llama

    blocks = model.blocks if isinstance(model, GPT) else model.layers
    block = blocks[0]
    mat = sum(p.numel() for p in block.parameters() if p.dim() >= 2)
    vec = sum(p.numel() for p in block.parameters() if p.dim() < 2)
    in_blocks = {id(p) for p in blocks.parameters()}
    first, last, last_vec = 0, 0, 0
    for name, p in model.named_parameters():  # a tied parameter once, under its first name (the embedding)
        if id(p) in in_blocks:
            continue
        if p.dim() < 2:
            last_vec += p.numel()
        elif "emb" in name:
            first += p.numel()
        else:
            last += p.numel()
    split_vectors, first_whole = 0, 0
    if isinstance(model, Llama):
        att, ffn = block.attention, block.feed_forward
        tied, n_head = 0, att.n_head
        # its sequence-parallel residual stream gives each rank seq_len / tp positions
        divides, why = (att.n_head, att.n_kv_head, ffn.w1.out_features, seq_len), ""
    else:
        tied = model.head.weight.numel() if model.head.weight is model.tok_emb.weight else 0
        # parallel/tensor.py splits its fused q, k, v part by part (their bias whole on every rank), the MLP's
        # first bias with its matrix, and keeps the position table whole
        n_head, divides, why = block.attn.n_head, (block.attn.n_head, block.mlp[0].out_features), ""
        split_vectors = block.mlp[0].bias.numel() if block.mlp[0].bias is not None else 0
        first_whole = model.pos_emb.weight.numel()
    return Structure(len(blocks), mat, vec, first, last, last_vec, tied, model.tok_emb.embedding_dim
                     if isinstance(model, GPT) else model.tok_embeddings.embedding_dim, n_head, seq_len,
                     divides, why, split_vectors, first_whole)


# --- the formulas, each as the paper or the module docstring states it --------------------------------------

def zero_state_bytes(params: int, kind: str, shard: int, *, optim_states: int = 2) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes per GPU of ``params`` fp32 parameters with fp32 gradients
    and ``optim_states`` fp32 states each, under ZeRO ``kind`` over ``shard`` ranks."""
    stage = ZERO_STAGE[kind]
    p, g, o = 4 * params, 4 * params, 4 * optim_states * params
    return (math.ceil(p / shard) if stage >= 3 else p, math.ceil(g / shard) if stage >= 2 else g,
            math.ceil(o / shard) if stage >= 1 else o)


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, *, t: int = 1, sp: bool = True,
                            recompute: str = "none") -> float:
    """Activation bytes one transformer layer keeps for backward in 16-bit (Korthikanti et al. 2022, table 2):
    s sequence, b micro-batch, h hidden, a heads, t tensor-parallel ranks, sp sequence parallelism;
    recompute none | selective (the attention's 5as/h term recomputed) | full (the layer's input only)."""
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / t if sp else 2 * sbh
    attention = 0.0 if recompute == "selective" else 5 * a * s / (h * t)
    return sbh * ((34 / t if sp else 10 + 24 / t) + attention)


def activation_ratio(s: int, h: int, a: int, t: int, recompute: str, *, sp: bool = True) -> float:
    """What t-way tensor parallelism leaves of one layer's activations per rank (Korthikanti's table 2 at t
    over at 1); with sequence parallelism exactly 1/t."""
    return korthikanti_layer_bytes(s, 1, h, a, t=t, sp=sp, recompute=recompute) / \
        korthikanti_layer_bytes(s, 1, h, a, t=1, sp=sp, recompute=recompute)


def bubble(pp: int, microbatches: int, virtual: int = 1) -> float:
    """The pipeline bubble as a share of the ideal (bubble-free) compute time: (p - 1) / (v m) (Narayanan et
    al. 2021). As a share of the step's wall time it is (p - 1) / (v m + p - 1) (parallel/pipeline.py)."""
    return (pp - 1) / (virtual * microbatches)


def in_flight(pp: int, stage: int, microbatches: int, schedule: str, virtual: int = 1) -> float:
    """Micro-batches whose activations pipeline rank ``stage`` holds at once, in units of its whole share of the
    blocks: 1F1B p - stage, GPipe all m; interleaved (``virtual`` stages per rank) the schedule's warm-up chunks
    and the one computing, (v - 1) p + 2 (p - 1 - stage) + 1 (torch's and Megatron-LM's warm-up), each a v-th of
    the rank's blocks: more than 1F1B's (Narayanan et al. 2021: the price of the smaller bubble)."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "interleaved" and virtual > 1:
        return min((virtual - 1) * pp + 2 * (pp - 1 - stage) + 1, microbatches * virtual) / virtual
    return min(pp - stage, microbatches)


def stage_edges(pp: int, stage: int, microbatches: int, schedule: str, virtual: int, edge: int) -> int:
    """Bytes pipeline rank ``stage`` holds at the stages' edges, ``edge`` the bytes of one micro-batch's tensor
    between two stages (s x b x h / t elements, sequence-parallel, in the compute dtype), as torch's
    PipelineStage holds them (tests/dist/test_plan_memory_real.py measures each):

    - receive buffers, allocated once and kept: per micro-batch, one for each local stage's input (all but the
      first stage) and one for its output's gradient (all but the last);
    - each micro-batch's output of a local stage before the last, kept from its forward to its backward (the
      schedule's cache; autograd alone would not keep a block's output);
    - the gradient of each micro-batch's input of a local stage after the first, kept until the step ends.
    """
    if pp == 1:
        return 0
    v = virtual if schedule == "interleaved" else 1
    receiving = v - (stage == 0)  # local stages with an input to receive (and keep its gradient of)
    sending = v - (stage == pp - 1)  # local stages with an output to send (and its gradient to receive)
    # in flight: in_flight's units of the rank's blocks, each a micro-batch of every local stage
    outputs = in_flight(pp, stage, microbatches, schedule, virtual) * sending
    return round(((2 * receiving + sending) * microbatches + outputs) * edge)


def stage_blocks(n_layer: int, pp: int) -> list[int]:
    """Blocks per stage: the first n_layer % pp stages one more (parallel/pipeline.py's split)."""
    base, extra = divmod(n_layer, pp)
    return [base + (i < extra) for i in range(pp)]


def tp_comm_bytes(s: int, b: int, h: int, tp: int, *, cbytes: int, blocks: int, microbatches: int,
                  checkpointing: str) -> float:
    """Bytes one GPU sends per step for tensor parallelism (module docstring)."""
    if tp == 1:
        return 0.0
    collectives = 4 if checkpointing == "none" else 6  # recompute runs the forward's two again
    return microbatches * blocks * collectives * 2 * (tp - 1) / tp * s * b * h * cbytes


def pp_comm_bytes(s: int, b: int, h: int, tp: int, pp: int, *, cbytes: int, microbatches: int) -> float:
    """Bytes one stage sends per step: each micro-batch's activations forward and their gradients back."""
    return 0.0 if pp == 1 else microbatches * 2 * s * b * h * cbytes / tp


# --- one layout ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Parallel(PerGpuBytes):
    """One dp x tp x pp layout: memory of its largest stage per GPU and time per step."""

    kind: str  # ddp | zero1 | zero2 | fsdp | hsdp
    checkpointing: str  # none | full
    gpus: int
    dp: int
    tp: int
    pp: int
    microbatches: int  # per pipeline (p > 1) or accumulation steps (p = 1) per optimizer step
    params_bytes: int
    grads_bytes: int
    optim_bytes: int
    activations_bytes: int
    fsdp_buffers_bytes: int
    compute_s: float
    bubble: float  # of the compute time
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    fits: bool
    flops_per_gpu_s: float = 0.0  # model FLOPs per step / (GPUs x peak): the step time at MFU 1

    @property
    def step_s(self) -> float:
        return max(self.compute_s * (1 + self.bubble), self.dp_comm_s) + self.tp_comm_s + self.pp_comm_s

    @property
    def step_mfu(self) -> float:
        """The MFU of the whole step, as a run measures it (and as published runs report it): the assumed MFU
        of the compute, less the bubble and the exposed communication (and full checkpointing's recompute)."""
        return self.flops_per_gpu_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def name(self) -> str:
        return f"{self.kind} dp{self.dp} tp{self.tp} pp{self.pp}"

    def efficiency_for(self, step_mfu: float) -> float:
        """The compute efficiency (the fraction of peak while computing, recompute included) at which this
        layout, planned at efficiency 1, runs whole steps at ``step_mfu`` as published runs count MFU: the
        bubble, the exposed tensor- and pipeline-parallel communication and full checkpointing's recompute
        taken out. At most 1 (the MFU given is then beyond this layout under the plan's model)."""
        room = self.flops_per_gpu_s / step_mfu - self.tp_comm_s - self.pp_comm_s
        return 1.0 if room <= 0 else min(1.0, self.compute_s * (1 + self.bubble) / room)

    def mfu_at(self, efficiency: float) -> float:
        """The whole-step MFU of this layout, planned at efficiency 1, when its GPUs compute at ``efficiency``."""
        step = max(self.compute_s * (1 + self.bubble) / efficiency, self.dp_comm_s) + self.tp_comm_s + self.pp_comm_s
        return self.flops_per_gpu_s / step


@dataclass(frozen=True)
class Setting:
    """What every layout of one plan shares: the run, the accelerator, the measured model."""

    facts: Any  # estimate.ModelFacts, with block_activations
    shape: Structure
    acc: Any  # catalog.Accelerator
    gpus_per_node: int
    precision: str
    tf32: bool
    batch_size: int  # samples per micro-batch
    global_batch: int  # samples per optimizer step, held fixed
    schedule: str  # 1f1b | gpipe
    optimizer: str
    mfu: float
    net_bytes_per_s: float
    usable_bytes: int
    virtual: int = 1  # pipeline stages per GPU (the interleaved schedule): the bubble / virtual
    per_schedule: int = 0  # micro-batches per pipeline schedule (the trainer runs one per accumulation step:
    #                        parallel.microbatches); 0: all of a step's in one


def stage_params(shape: Structure, tp: int, pp: int, stage: int) -> int:
    """Parameters one GPU of pipeline stage ``stage`` holds under t-way tensor parallelism."""
    blocks = stage_blocks(shape.n_layer, pp)[stage]
    whole_vectors = shape.block_vectors - shape.block_split_vectors
    n = blocks * (shape.block_matrices // tp + whole_vectors + shape.block_split_vectors // tp)
    if stage == 0:
        n += (shape.first_matrices - shape.first_whole) // tp + shape.first_whole
    if stage == pp - 1:
        n += shape.last_matrices // tp + shape.last_vectors + (shape.tied // tp if pp > 1 else 0)
    return n


def _stage_memory(st: Setting, kind: str, ac: str, dp: int, tp: int, pp: int, m: int, stage: int) -> tuple[int, ...]:
    from scaletrain.observe.memory import OPTIM_STATES

    shape, facts = st.shape, st.facts
    shard = {"ddp": 1, "zero1": dp, "zero2": dp, "fsdp": dp, "hsdp": min(dp, st.gpus_per_node // tp)}[kind]
    state = zero_state_bytes(stage_params(shape, tp, pp, stage), kind, shard,
                             optim_states=OPTIM_STATES.get(st.optimizer, 2))
    key = f"sharded-{ac}" if kind in ("fsdp", "hsdp") and shard > 1 else ac
    block = facts.block_activations[key]
    kept, rest_kept = facts.block_kept.get(key, block), facts.rest_kept.get(key, 0)
    rest = facts.activations[key] - shape.n_layer * block  # the ends and the transients, counted whole
    ratio = activation_ratio(shape.seq_len, shape.n_embd, shape.n_head, tp, ac)
    if tp in facts.tp_activations:  # measured on the tensor-parallel step itself
        (block, rest, kept, rest_kept), ratio = facts.tp_activations[tp][key], 1.0
    blocks = stage_blocks(shape.n_layer, pp)[stage]
    # one micro-batch's step (its blocks' share of the peak, and the rest), and what forward keeps of each
    # further micro-batch in flight until its backward: its blocks', and on the last stage its logits' and loss's
    more = in_flight(pp, stage, m, st.schedule, st.virtual) - 1
    held = more * (blocks * max(kept, 0) * ratio + (max(rest_kept, 0) if stage == pp - 1 else 0))
    edge = shape.seq_len * st.batch_size * shape.n_embd * compute_bytes(st.precision) // tp
    acts = round(blocks * block * ratio + held) + rest + stage_edges(pp, stage, m, st.schedule, st.virtual, edge)
    buffers = 0 if key == ac else math.ceil(facts.largest_unit / tp) * (2 * compute_bytes(st.precision) + 4)
    return (*state, acts, buffers)


def parallel_layout(st: Setting, kind: str, ac: str, *, gpus: int, tp: int, pp: int) -> Parallel:
    """Memory (the largest stage) and time per step of one layout (module docstring)."""
    dp = gpus // (tp * pp)
    m = st.global_batch // (dp * st.batch_size)
    sched = min(m, st.per_schedule) if st.per_schedule else m  # in flight at once, and what one bubble spans
    memory = max((_stage_memory(st, kind, ac, dp, tp, pp, sched, i) for i in range(pp)), key=sum)
    shape, cb = st.shape, compute_bytes(st.precision)
    flops = st.facts.flops_per_sample * st.global_batch
    peak = st.acc.peak(st.precision, tf32=st.tf32)
    at_peak = flops / (gpus * peak)  # seconds at MFU 1
    compute = flops * RECOMPUTE[ac] / (gpus * peak * st.mfu)  # as the data-parallel table
    link, net = st.acc.link_bytes_per_s, st.net_bytes_per_s
    per_node = st.gpus_per_node
    multi = gpus > per_node
    s, b, h = shape.seq_len, st.batch_size, shape.n_embd
    tp_s = tp_comm_bytes(s, b, h, tp, cbytes=cb, blocks=stage_blocks(shape.n_layer, pp)[0], microbatches=m,
                         checkpointing=ac) / link
    pp_link = min(link, net) if multi and dp * tp >= per_node else link  # stages dp x tp ranks apart
    pp_s = pp_comm_bytes(s, b, h, tp, pp, cbytes=cb, microbatches=m) / pp_link
    local = max(stage_params(shape, tp, pp, i) for i in range(pp))
    dp_s = dp_comm_s(kind, params=local, trainable=local, dp=dp, micro=m, cbytes=cb,
                     across=min(link, net) if multi and dp * tp > per_node else link, link=link, net=net,
                     within=max(1, min(dp, per_node // tp)))
    return Parallel(kind, ac, gpus, dp, tp, pp, m, *memory, compute, bubble(pp, sched, st.virtual), tp_s, pp_s, dp_s,
                    sum(memory) <= st.usable_bytes, at_peak)


# --- the search ---------------------------------------------------------------------------------------------

def tp_degrees(shape: Structure, gpus_per_node: int) -> list[int]:
    """Tensor-parallel degrees worth planning: divisors of a machine's GPUs up to MAX_TP that divide the heads,
    the key/value heads and the MLP (1 only for a model parallel/tensor.py cannot split)."""
    if shape.tp_why_not:
        return [1]
    return [t for t in range(1, min(MAX_TP, gpus_per_node) + 1)
            if gpus_per_node % t == 0 and all(n % t == 0 for n in shape.tp_divides)]


def kinds(dp: int, tp: int, gpus_per_node: int) -> list[str]:
    """The ZeRO kinds worth planning over ``dp`` data-parallel ranks: ddp always; the sharded ones with more
    than one rank; hsdp where the ranks span whole machines' data-parallel groups (sharded within each)."""
    within = gpus_per_node // tp
    return [k for k in ZERO_KINDS if k == "ddp" or (dp > 1 and k != "hsdp")
            or (k == "hsdp" and dp > within > 1 and dp % within == 0)]


def measured_modes(st: Setting) -> tuple[str, ...]:
    """The checkpointing modes of AC_SEARCHED whose activations were measured (ModelFacts.block_activations)."""
    return tuple(ac for ac in AC_SEARCHED if ac in st.facts.block_activations)


def candidates(st: Setting, gpus: int, checkpointing: tuple[str, ...] | None = None) -> list[Parallel]:
    """Every layout of ``gpus`` GPUs: ZeRO kind x tp x pp (pp dividing the blocks) x checkpointing, where the
    global batch splits into whole micro-batches."""
    checkpointing = measured_modes(st) if checkpointing is None else checkpointing
    out = []
    for tp in tp_degrees(st.shape, st.gpus_per_node):
        for pp in (p for p in range(1, st.shape.n_layer + 1) if st.shape.n_layer % p == 0):
            if gpus % (tp * pp) or st.global_batch % (gpus // (tp * pp) * st.batch_size):
                continue
            out += [parallel_layout(st, k, ac, gpus=gpus, tp=tp, pp=pp)
                    for k in kinds(gpus // (tp * pp), tp, st.gpus_per_node) for ac in checkpointing]
    return out


@dataclass
class Search:
    """The layouts of a GPU count (and of fewer whole machines), the fastest and the cheapest that fit."""

    gpus: int
    total_steps: int
    price_per_gpu_hour: float | None
    global_batch: int = 0  # samples per optimizer step, the same in every layout
    layouts: list[Parallel] = field(default_factory=list)
    fastest: Parallel | None = None
    cheapest: Parallel | None = None

    def run_hours(self, lay: Parallel) -> float:
        return self.total_steps * lay.step_s / 3600

    def gpu_hours(self, lay: Parallel) -> float:
        return self.run_hours(lay) * lay.gpus

    def cost(self, lay: Parallel) -> float | None:
        return None if self.price_per_gpu_hour is None else self.gpu_hours(lay) * self.price_per_gpu_hour

    def fitting(self) -> list[Parallel]:
        """The layouts that fit, fastest first (ties: the simpler, the order searched)."""
        return sorted((lay for lay in self.layouts if lay.fits), key=lambda lay: lay.step_s)

    def as_dict(self) -> dict[str, Any]:
        def row(lay: Parallel) -> dict[str, Any]:
            return {**asdict(lay), "name": lay.name, "total_bytes": lay.total_bytes, "step_s": lay.step_s,
                    "step_mfu": lay.step_mfu,
                    "run_hours": self.run_hours(lay), "gpu_hours": self.gpu_hours(lay), "cost": self.cost(lay)}

        def pick(lay: Parallel | None) -> dict[str, Any] | None:
            return None if lay is None else row(lay)

        return {"gpus": self.gpus, "total_steps": self.total_steps, "global_batch": self.global_batch,
                "layouts": [row(lay) for lay in self.layouts],
                "fastest": pick(self.fastest), "cheapest": pick(self.cheapest)}


def search(st: Setting, *, gpus: int, nodes: int, total_steps: int, price_per_gpu_hour: float | None,
           only: tuple[int, int] | None = None) -> Search:
    """The layouts of ``gpus`` GPUs, and of fewer whole machines where the global batch divides (for the
    cheapest); ``only``: (tp, pp) to plan that pair alone, on all the GPUs."""
    out = Search(gpus, total_steps, price_per_gpu_hour, st.global_batch)
    if only is not None:
        tp, pp = only
        out.layouts = [parallel_layout(st, k, ac, gpus=gpus, tp=tp, pp=pp)
                       for k in kinds(gpus // (tp * pp), tp, st.gpus_per_node) for ac in measured_modes(st)]
    else:
        for n in (k for k in range(1, nodes + 1) if nodes % k == 0):
            out.layouts += candidates(st, n * st.gpus_per_node)
    fits = out.fitting()
    full = [lay for lay in fits if lay.gpus == gpus]
    out.fastest = full[0] if full else None
    out.cheapest = min(fits, key=out.gpu_hours) if fits else None
    return out
