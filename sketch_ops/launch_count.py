"""Count the device kernels and host synchronisations a piece of torch code launches.

Contract: `with LaunchCounter() as count: ...` records, for the code inside the block,
- `count.kernels`: a `Counter` of the device kernels launched: every aten op that runs a kernel
  (views, allocations and other metadata-only ops excluded: `NO_KERNEL`, `func.is_view`), keyed
  `aten.<op>`, plus every Triton launch of `sketch_ops.kernels` / `sketch_ops.fused_kernels`,
  keyed `triton.<kernel>`; `count.total` is their sum;
- `count.syncs`: the ops that read a device value on the host (`aten._local_scalar_dense`:
  `.item()`, `int(t)`, `bool(t)`), which stall the host until the device catches up.
With `scopes` (qualified function names, e.g. `SKETCH_SCOPES`), kernels launched inside those
functions are counted apart, in `count.sketch_scoped`: `baton sketch-plan` counts a step on the
CPU, where sketches take the torch reference, and puts the fused path's launches in their place.
Tensors made from Python values (`torch.tensor(...)`, aten `lift_fresh`) live on the host in a
real run (the layers keep their seeds in such CPU tensors), so ops that only read such tensors
are neither kernels nor syncs. This lets a CPU-only test count what the same code launches on a
GPU: under `TRITON_INTERPRET=1` the Triton kernels run on CPU tensors, and each launch counts
once (the interpreter's own tensor copies are not counted).

It counts aten ops, as a `TorchDispatchMode` sees them: one aten op may be several CUDA kernels
(a `sort` is a few radix passes), and one Triton launch is one kernel.
"""

from __future__ import annotations

import sys
import weakref
from collections import Counter
from collections.abc import Callable
from types import ModuleType, TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

# Ops that allocate or describe tensors without running a kernel on the data.
NO_KERNEL = frozenset({
    "aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
    "aten.detach.default", "aten.alias.default", "aten.lift_fresh.default",
    "aten.promote_types.default", "aten.resolve_conj.default", "aten.resolve_neg.default",
    "aten.is_same_size.default", "aten.sym_size.int", "aten.sym_stride.int",
    "aten.sym_numel.default", "aten.sym_storage_offset.default",
})
SYNC_OPS = frozenset({"aten._local_scalar_dense.default"})
HOST_SOURCES = frozenset({"aten.lift_fresh.default", "aten.lift_fresh_copy.default"})


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


# Functions (qualified names) of the torch reference's sketch work: what the fused path replaces
# by its own launches (`sketch_scoped`).
SKETCH_SCOPES = frozenset({
    "make_plan", "input_sketch", "weight_grad_estimate", "saved_sketch_weight_grad",
    "BlockInputSketch.__init__", "BlockInputSketch.add", "BlockInputSketch.finish",
    "BlockInputSketch.block_plan", "BlockWeightGrad.finish",
})


def _in_scope(scopes: frozenset[str]) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_qualname in scopes:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class LaunchCounter(TorchDispatchMode):
    """Counts kernels and host syncs (module docstring)."""

    def __init__(self, scopes: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.kernels: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.scopes = scopes
        self.sketch_scoped = 0  # kernels launched inside `scopes` (not in `kernels`)
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> the tensor, weakly
        self._patched: list[tuple[Any, Callable[..., Any]]] = []

    @property
    def total(self) -> int:
        return sum(self.kernels.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func)
        inputs = _tensors((args, kwargs))
        host = name in HOST_SOURCES or (bool(inputs) and all(self._on_host(t) for t in inputs))
        if host:
            self._host.update((id(t), weakref.ref(t)) for t in _tensors(out))
        elif name in SYNC_OPS:
            self.syncs[name] += 1
        elif name not in NO_KERNEL and not getattr(func, "is_view", False):
            if self.scopes and _in_scope(self.scopes):
                self.sketch_scoped += 1
            else:
                self.kernels[name] += 1
        return out

    def _on_host(self, tensor: torch.Tensor) -> bool:
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def __enter__(self) -> LaunchCounter:
        for module in _kernel_modules():
            for attr in vars(module).values():
                if hasattr(attr, "run") and hasattr(attr, "fn"):  # a @triton.jit kernel
                    self._wrap(attr)
        super().__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 trace: TracebackType | None) -> None:
        super().__exit__(kind, value, trace)
        for kernel, run in self._patched:
            kernel.run = run
        self._patched.clear()

    def _wrap(self, kernel: Any) -> None:
        run = kernel.run
        name = f"triton.{kernel.fn.__name__}"

        def counted(*args: Any, **kwargs: Any) -> Any:
            if not kwargs.get("warmup", False):
                self.kernels[name] += 1
            with _disable_current_modes():  # the interpreter's own copies are not launches
                return run(*args, **kwargs)

        kernel.run = counted
        self._patched.append((kernel, run))


def _kernel_modules() -> list[ModuleType]:
    """The Triton kernel modules that import here (none without triton)."""
    modules = []
    for name in ("kernels", "fused_kernels"):
        try:
            modules.append(__import__(f"sketch_ops.{name}", fromlist=[name]))
        except ImportError:
            continue
    return modules
