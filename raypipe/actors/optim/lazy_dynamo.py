"""Keeps a stage actor from importing torch's compiler just to build an optimizer.

torch marks some optimizer methods (`Optimizer.add_param_group`, `zero_grad`, `state_dict`,
`load_state_dict`) with `torch._disable_dynamo`, which imports `torch._dynamo` on their first
call to tell the compiler not to trace them: about 1.6 s of imports in every actor that builds an
optimizer (measured here: a 2-stage trainer's start 5.5 -> 3.9 s), though no stage compiles
anything unless `TrainConfig.compile` asks. Without `torch._dynamo` imported nothing can be
compiling, so "do not trace this" means nothing yet: `defer_dynamo_import` lets those methods run
as they are until something imports the compiler, and from then on as torch would have wrapped
them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

__all__ = ["defer_dynamo_import"]


def _inner_code() -> object:
    """The code object of the wrapper `torch._disable_dynamo` puts around a function."""
    return torch._disable_dynamo(lambda: None).__code__


def _until_compiler(fn: Callable, recursive: bool) -> Callable:
    """`fn` as such while torch._dynamo is not imported; torch's own disabled `fn` after."""

    def call(*args: object, **kwargs: object) -> object:
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None or not hasattr(dynamo, "disable"):
            return fn(*args, **kwargs)
        disabled = dynamo.disable(fn, recursive, wrapping=False)
        fn.__dynamo_disable = disabled  # what torch's wrapper caches, replacing this one
        return disabled(*args, **kwargs)

    return call


def defer_dynamo_import(classes: tuple[type, ...] = (torch.optim.Optimizer,)) -> int:
    """Lets the `torch._disable_dynamo` methods of `classes` run without importing the compiler
    while nothing has imported it. Returns how many methods it deferred (0 once the compiler is in,
    or on a torch whose wrapper differs: then torch's behaviour stays as it is)."""
    if "torch._dynamo" in sys.modules:
        return 0
    code, deferred = _inner_code(), 0
    for cls in classes:
        for method in vars(cls).values():
            if getattr(method, "__code__", None) is not code or not method.__closure__:
                continue
            cells = dict(zip(method.__code__.co_freevars, (c.cell_contents for c in method.__closure__)))
            fn = cells.get("fn")
            if fn is None or getattr(fn, "__dynamo_disable", None) is not None:
                continue
            fn.__dynamo_disable = _until_compiler(fn, bool(cells.get("recursive", True)))
            deferred += 1
    return deferred


def step_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.step()`, without the `import torch._dynamo` torch's step wrapper makes on every
    call (only to mark a graph break for the compiler) while nothing has imported the compiler.

    torch wraps each optimizer's `step` twice: `profile_hook_step` (a profiler label, the step
    hooks) around `_use_grad_for_differentiable` (grad mode = `differentiable`, the graph break).
    Without hooks, the profiler label and grad mode are kept here and the step itself is called;
    anything else (hooks, a compiler already in, another wrapping) takes torch's own path."""
    hooked = type(optimizer).step
    use_grad = getattr(hooked, "__wrapped__", None)
    step = getattr(use_grad, "__wrapped__", None)
    hooks = sys.modules["torch.optim.optimizer"]
    if (
        "torch._dynamo" in sys.modules
        or step is None
        or not getattr(hooked, "hooked", False)
        or getattr(use_grad, "__name__", None) != step.__name__
        or "step" in vars(optimizer)
        or optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or hooks._global_optimizer_pre_hooks
        or hooks._global_optimizer_post_hooks
    ):
        optimizer.step()
        return
    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step"):
        with torch.set_grad_enabled(bool(optimizer.defaults.get("differentiable", False))):
            step(optimizer)
        optimizer._optimizer_step_code()
