"""The one owner of forward hooks: registered for a ``with`` block, removed when it ends.

TransformerLens's ``run_with_hooks`` in a context manager: callers never keep handle
lists, and an exception inside the block cannot leave a hook behind on the model (a left-
over hook would keep capturing, and holding tensors, on every later forward pass).

    with capture_outputs({(li, "q"): a.hook_q for li, a in enumerate(layers)}) as out:
        model(x)
    q0 = out[0, "q"]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from torch import Tensor, nn

K = TypeVar("K", bound=Hashable)
ForwardHook = Callable[[nn.Module, Any, Any], Any]  # torch's (module, inputs, output)


@contextlib.contextmanager
def hooked(pairs: Iterable[tuple[nn.Module, ForwardHook]]) -> Iterator[None]:
    """Within the block, each ``hook`` is a forward hook of its module; all are removed on
    exit, also when the block raises."""
    handles = []
    try:
        for module, hook in pairs:
            handles.append(module.register_forward_hook(hook))
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def capture_outputs(modules: Mapping[K, nn.Module]) -> Iterator[dict[K, Tensor]]:
    """Within the block, ``out[key]`` is the detached output of ``modules[key]``'s latest
    forward pass (the dict is filled as the model runs; a later pass overwrites)."""
    out: dict[K, Tensor] = {}

    def grab(key: K) -> ForwardHook:
        def hook(_module: nn.Module, _inputs: Any, output: Tensor) -> None:
            out[key] = output.detach()

        return hook

    with hooked((m, grab(key)) for key, m in modules.items()):
        yield out
