"""Cheaper calls into model layers.

A decode step of a small model on a CPU is short and makes ~300 layer calls. torch's ``nn.Module.__call__``
(hook and tracing checks) and ``nn.Module.__getattr__`` (submodules and parameters live in ``_modules`` /
``_parameters``, reached only after the normal attribute lookup fails) took a noticeable share of it (figures:
docs/performance.md). The layers here take neither path: ``DirectCall`` makes calling a layer run its ``forward``,
and ``promote_attributes`` puts each module's submodules and parameters in its instance ``__dict__``.

What that gives up: forward hooks (``register_forward_hook`` and friends) do not fire on these layers. The
engine uses none; a tool that needs them can call ``module._call_impl`` itself.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class DirectCall:
    """Mixin for ``nn.Module`` subclasses: ``layer(x)`` is ``layer.forward(x)``, with no hook dispatch.

    Put it first among the bases (``class RMSNorm(DirectCall, nn.Module)``) so this ``__call__`` wins.
    ``forward`` is looked up on the instance, so a ``forward`` patched onto one layer (tests, wrappers) runs.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)


def promote_attributes(model: nn.Module) -> None:
    """Copy every module's submodules and parameters into its instance ``__dict__`` (plain attribute reads).

    Call once the weights are final (``load_model`` does, after ``process_weights_after_loading``):
    assigning a new submodule or parameter later through ``nn.Module.__setattr__`` replaces the copy, but
    setting a registered one to None, deleting it, or a ``model.to(...)`` that rebuilds parameters would leave
    the copy stale. Buffers are left alone: ``nn.Module`` reassigns those in place of the registry entry.
    """
    for module in model.modules():
        for registry in (module._modules, module._parameters):
            for name, value in registry.items():
                module.__dict__[name] = value
