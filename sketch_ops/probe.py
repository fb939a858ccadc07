"""Which linear layers' sketches free memory: probe steps over what autograd keeps.

`plan_sketch(model, batch, *, rank, loss_fn=None, estimator="centered")` returns an `AutoPlan`
for the model as it is (fusions applied or not), with one `LayerPlan` per candidate layer (a
module of exactly type `nn.Linear`, what `sketch_model` swaps):
- `"sketch"`: sketching it (with the sibling layers that read the same input) lowers the step's
  activation bytes: its input is kept for weight gradients alone;
- `"keep"`: its input is kept anyway (by a norm, an activation, attention, a non-candidate
  layer), a sketch would cost more than it frees, or it did not run;
- `"recomputed"`: it runs inside a fused function (`norm_linear`, `gelu_mlp`, `swiglu_mlp`),
  where an exact weight gradient costs no memory;
with the bytes its input's storage holds and the bytes its sketch frees net of the sketch (0
unless sketched). `plan.exact_bytes` is the step's activation bytes as probed (distinct saved
storages, parameters excluded: `memory.saved_bytes`) and `plan.predicted_bytes` that minus
every sketched layer's freed bytes.

How (in full: docs/design.md, "How the probe decides"): one training step under
`saved_tensors_hooks` finds each layer's saved input storage, and layers sharing one form a
group (q/k/v, gate/up); the tentative plan is applied and probed again, and each class of groups
(the same names up to block indices) is reverted in turn to measure its saving. A class saving
under `min_saving` (`MIN_SAVING` = 0.10) of `exact_bytes` stays exact: a sketch costs gradient
quality on every layer of its class (what the classes free on a Llama and on the GPT:
benchmarks/reports/2026-12-05-sketch-llama.md). `min_saving=0` sketches all that frees anything.

The probe leaves the model as it was (no module swapped; every `.grad`, buffer and torch RNG
state, CPU and CUDA, put back; no optimizer runs), so it changes neither the trajectory nor a
resume (P1). Cost: one training step and (classes + 1) forward passes on `batch`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from .layer import SketchedLinear
from .seeds import effective_rank

Decision = Literal["sketch", "keep", "recomputed"]
LossFn = Callable[[nn.Module, Any], torch.Tensor]
SEED_BYTES = 8  # a sketched layer saves its seed as one int64
MIN_SAVING = 0.10  # least share of the probed activation bytes a class of groups must free
MEAN_BYTES = 4  # the centred estimator saves its input's fp32 row mean, one value per feature


@dataclass
class LayerPlan:
    name: str
    in_features: int
    out_features: int
    decision: Decision
    input_bytes: int  # bytes of the storage(s) holding its input (0: did not run as a module)
    freed_bytes: int  # what its sketch frees, net of the sketch; 0 unless sketched
    reason: str  # why, in a few words


@dataclass
class AutoPlan:
    layers: list[LayerPlan] = field(default_factory=list)
    exact_bytes: int = 0  # measured by the probe: activation bytes of the step as it ran
    rows: int = 0  # rows (tokens) of the largest linear input seen
    fused: list[str] = field(default_factory=list)  # modules patched before the probe
    speed: list[Any] = field(default_factory=list)  # speed_plan.SpeedChoice per judged class

    @property
    def sketched(self) -> list[str]:
        return [layer.name for layer in self.layers if layer.decision == "sketch"]

    @property
    def predicted_bytes(self) -> int:
        return self.exact_bytes - sum(layer.freed_bytes for layer in self.layers)

    def include(self, name: str, module: nn.Module) -> bool:
        """`sketch_model`'s `include=` for this plan: exactly the layers it sketches."""
        return name in self.sketched


def check_min_saving(min_saving: float) -> None:
    """Raise ValueError unless `min_saving` is a share in [0, 1)."""
    if isinstance(min_saving, bool) or not isinstance(min_saving, (int, float)) or not (
            0 <= min_saving < 1):
        raise ValueError(
            f"sketch probe: min_saving must be a share of the step's activation bytes in "
            f"[0, 1), got {min_saving!r} (e.g. 0.1; 0 sketches whatever frees anything)"
        )


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The sum of the model's output (a tensor, or an output object's `.logits`)."""
    out = model(batch)
    out = getattr(out, "logits", out)
    if not isinstance(out, torch.Tensor):
        raise ValueError(
            f"sketch probe: the model returned {type(out).__name__}, not a tensor; pass "
            "loss_fn=(model, batch) -> scalar loss"
        )
    return out.float().sum()


def sketch_cost(rank: int, rows: int, in_features: int, itemsize: int, estimator: str) -> int:
    """Bytes a sketched layer keeps for one call on `rows` rows (`function.py`'s saved set)."""
    mean = in_features * MEAN_BYTES if estimator == "centered" else 0
    return effective_rank(rank, rows) * in_features * itemsize + mean + SEED_BYTES


@dataclass
class _Call:
    """One run of a linear layer's forward: its input storage and what it saved."""

    layer: str
    storage: int  # data_ptr of the input's storage
    storage_bytes: int
    rows: int
    itemsize: int
    private: dict[int, int] = field(default_factory=dict)  # cast copies of the input it saved


@dataclass
class _Trace:
    """What one probe saw: linear calls, who saved each storage, whose weights were saved."""

    calls: list[_Call] = field(default_factory=list)
    savers: dict[int, set[str]] = field(default_factory=dict)  # "" = not a linear layer
    sizes: dict[int, int] = field(default_factory=dict)
    weights_saved: set[str] = field(default_factory=set)  # by a function, not their module

    @property
    def saved_bytes(self) -> int:
        return sum(self.sizes.values())


def _trace(model: nn.Module, batch: Any, loss_fn: LossFn, *, backward: bool) -> _Trace:
    """Run `loss_fn(model, batch)` (and its backward) recording what autograd saves."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights = {m.weight.untyped_storage().data_ptr(): name for name, m in linears.items()}
    trace = _Trace()
    active: list[_Call] = []
    keep_alive: list[torch.Tensor] = []  # no storage is freed and its address reused mid-probe

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        call = active[-1] if active else None
        if ptr in params:
            if ptr in weights and (call is None or call.layer != weights[ptr]):
                trace.weights_saved.add(weights[ptr])  # a fused function saves this weight
            return t
        trace.sizes[ptr] = t.untyped_storage().nbytes()
        trace.savers.setdefault(ptr, set()).add(call.layer if call else "")
        if (call is not None and ptr != call.storage and t.dim() > 0
                and t.numel() == call.rows * t.shape[-1]):
            call.private[ptr] = t.untyped_storage().nbytes()  # e.g. the input cast by autocast
        return t

    def before(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x = args[0] if args else kwargs["input"]  # nn.Linear.forward(input)
            keep_alive.append(x)
            storage = x.untyped_storage()
            call = _Call(name, storage.data_ptr(), storage.nbytes(),
                         x.numel() // max(1, x.shape[-1]), x.element_size())
            trace.calls.append(call)
            active.append(call)
        return hook

    def after(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        active.pop()

    with ExitStack() as stack:
        for name, module in linears.items():
            stack.callback(
                module.register_forward_pre_hook(before(name), with_kwargs=True).remove)
            stack.callback(module.register_forward_hook(after).remove)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(model, batch)
        if backward:
            loss.backward()
        del loss, keep_alive[:]
    return trace


def plan_sketch(
    model: nn.Module,
    batch: Any,
    *,
    rank: int | Mapping[str, int],
    loss_fn: LossFn | None = None,
    estimator: str = "centered",
    min_saving: float = MIN_SAVING,
) -> AutoPlan:
    """Probe `model` on `batch` and decide, per `nn.Linear`, sketch / keep / recomputed (module
    docstring). `rank` prices the sketches (a mapping: per layer, 1 for the others);
    `min_saving` is the least share of the probed bytes a class of groups must free."""
    check_min_saving(min_saving)
    loss = loss_fn or default_loss
    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear and name}

    def rank_of(name: str) -> int:
        return rank if isinstance(rank, int) else rank.get(name, 1)

    with _state_restored(model):
        first = _trace(model, batch, loss, backward=True)
        plan = AutoPlan(exact_bytes=first.saved_bytes,
                          rows=max((c.rows for c in first.calls), default=0))
        groups = _groups(first.calls)
        verdict: dict[str, tuple[Decision, str]] = {}
        tentative: list[list[str]] = []
        for members in groups:
            decision, reason = _static_verdict(members, first, set(linears), rank_of, linears,
                                               estimator)
            verdict.update({name: (decision, reason) for name in members})
            if decision == "sketch":
                tentative.append(members)
        for name in linears:
            if name not in verdict:
                verdict[name] = (("recomputed", "inside a fused function")
                                 if name in first.weights_saved
                                 else ("keep", "did not run in the probe"))
        input_bytes = {name: sum(c.storage_bytes for c in first.calls if c.layer == name)
                       for name in linears}
        freed = _refine(model, batch, loss, tentative, linears, input_bytes, verdict, rank_of,
                        estimator, plan.exact_bytes, min_saving)
    for name, module in linears.items():
        decision, reason = verdict[name]
        plan.layers.append(LayerPlan(name, module.in_features, module.out_features, decision,
                                     input_bytes[name], freed.get(name, 0), reason))
    return plan


def _groups(calls: list[_Call]) -> list[list[str]]:
    """Layers connected by a shared input storage, in call order (union-find)."""
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        parent.setdefault(name, name)
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    first_reader: dict[int, str] = {}
    for call in calls:
        root(call.layer)
        if call.storage in first_reader:
            parent[root(call.layer)] = root(first_reader[call.storage])
        first_reader.setdefault(call.storage, call.layer)
    groups: dict[str, list[str]] = {}
    for name in parent:
        groups.setdefault(root(name), []).append(name)
    return list(groups.values())


def _static_verdict(
    members: list[str],
    trace: _Trace,
    candidates: set[str],
    rank_of: Callable[[str], int],
    linears: Mapping[str, nn.Linear],
    estimator: str,
) -> tuple[Decision, str]:
    """Step (1) for one group: sketch when storages only it saves outweigh its sketches."""
    calls = [c for c in trace.calls if c.layer in members]
    storages = {c.storage: c.storage_bytes for c in calls}
    storages.update({p: b for c in calls for p, b in c.private.items()})
    own = set(members)
    freed = sum(b for ptr, b in storages.items() if ptr in trace.savers
                and trace.savers[ptr] <= own)
    cost = sum(sketch_cost(rank_of(c.layer), c.rows, linears[c.layer].in_features, c.itemsize,
                           estimator) for c in calls if c.layer in linears)
    others = sorted({saver or "another op" for c in calls
                     for saver in trace.savers.get(c.storage, ()) if saver not in own})
    if not own <= candidates:
        return "keep", "shares its input with a layer sketch_model does not swap"
    if not freed:
        return "keep", (f"input kept by {', '.join(others)}" if others
                        else "input not saved for backward")
    if freed <= cost:
        return "keep", "its sketch would cost more than it frees"
    return "sketch", "input kept for its weight gradient only"


def _refine(
    model: nn.Module,
    batch: Any,
    loss: LossFn,
    tentative: list[list[str]],
    linears: Mapping[str, nn.Linear],
    input_bytes: Mapping[str, int],
    verdict: dict[str, tuple[Decision, str]],
    rank_of: Callable[[str], int],
    estimator: str,
    exact_bytes: int,
    min_saving: float,
) -> dict[str, int]:
    """Steps (2) and (3): apply the tentative plan, revert each class of groups in turn, keep
    sketched the classes that free more than nothing and at least `min_saving` of
    `exact_bytes`. Updates `verdict`; returns each sketched layer's freed bytes."""
    classes: dict[str, list[str]] = {}
    for members in tentative:
        key = re.sub(r"\d+", "#", " ".join(members))  # every block's q/k/v, say
        classes.setdefault(key, []).extend(members)
    freed: dict[str, int] = {}
    swapped = {name: linears[name] for members in tentative for name in members}
    try:
        _swap(model, swapped, rank_of, estimator)
        baseline = _trace(model, batch, loss, backward=False)
        for names in classes.values():
            _unswap(model, {name: swapped[name] for name in names})
            reverted = _trace(model, batch, loss, backward=False)
            saving = reverted.saved_bytes - baseline.saved_bytes
            if saving <= 0 or saving < min_saving * exact_bytes:  # leave these layers exact
                ran = {c.layer for c in reverted.calls}
                for name in names:
                    if saving > 0:
                        verdict[name] = ("keep", f"frees {saving / exact_bytes:.1%} of the "
                                                 f"step's bytes, under min_saving {min_saving:g}")
                    elif name in ran:
                        verdict[name] = ("keep", "frees nothing once the plan is applied")
                    else:
                        verdict[name] = ("recomputed", "exact for free in a fused function "
                                                       "that keeps its input")
                    del swapped[name]
                baseline = reverted
                continue
            _swap(model, {name: swapped[name] for name in names}, rank_of, estimator)
            weights = [max(1, input_bytes[name]) for name in names]
            for name, weight in zip(names, weights, strict=True):
                freed[name] = saving * weight // sum(weights)
            freed[names[0]] += saving - sum(freed[n] for n in names)
    finally:
        _unswap(model, swapped)
    return freed


def _swap(model: nn.Module, layers: Mapping[str, nn.Linear], rank_of: Callable[[str], int],
          estimator: str) -> None:
    for name, linear in layers.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, SketchedLinear.from_linear(
            linear, rank=rank_of(name), name=name, estimator=estimator))


def _unswap(model: nn.Module, layers: Mapping[str, nn.Linear]) -> None:
    for name, linear in layers.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, linear)


@contextmanager
def _state_restored(model: nn.Module) -> Iterator[None]:
    """Run the probe steps, then put back every `.grad`, every buffer and torch's RNG."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        for p in params:
            p.grad = None
        try:
            yield
        finally:
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
