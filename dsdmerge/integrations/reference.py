"""The reference state dict: what a fresh model and optimizer hold.

A fresh optimizer's own ``state_dict()`` has no state; DSD's
``get_optimizer_state_dict`` runs a zero-gradient step first, so every parameter
has state (Adam's ``step == 1``), as a merge's reference needs. ``dsdmerge
reference`` writes what :func:`reference_state_dict` returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsdmerge.errors import StateDictTypeError

__all__ = ["reference_state_dict"]


def reference_state_dict(built: Any, /, *, optimizer_layout: str = "fqn") -> dict[str, Any]:
    """The state dicts a fresh model and optimizer hold, as ``dsdmerge reference`` writes them.

    ``built`` is a model, ``(model, optimizer)``, or a dict of parts (models, optimizers,
    other values kept as they are). A model gives ``model.state_dict()``; an optimizer
    gives DSD's ``get_optimizer_state_dict(model, optimizer)`` (flattened with
    ``optimizer_layout="flat"``; ``"ids"``: ``optimizer.state_dict()`` after it), whose
    zero-gradient step gives every parameter its state: a fresh optimizer's own
    ``state_dict()`` has none. That step changes the (fresh, throwaway) optimizer.

    Args:
        built: What the builder returned.
        optimizer_layout: ``"flat"``, ``"fqn"`` or ``"ids"``.

    Returns:
        The state dict to save (``{"model": ..., "optim": ...}`` for a pair).

    Raises:
        StateDictTypeError: ``built`` is none of the above, or holds an optimizer next
            to more or fewer than one model.

    Examples:
        >>> import torch
        >>> from dsdmerge.integrations.reference import reference_state_dict
        >>> model = torch.nn.Linear(2, 1)
        >>> sd = reference_state_dict((model, torch.optim.Adam(model.parameters())))
        >>> sorted(sd), float(sd["optim"]["state"]["weight"]["step"])
        (['model', 'optim'], 1.0)
    """
    import torch

    if isinstance(built, torch.nn.Module):
        return dict(built.state_dict())
    if isinstance(built, (tuple, list)) and len(built) == 2:
        built = {"model": built[0], "optim": built[1]}
    if not isinstance(built, Mapping):
        raise StateDictTypeError(
            f"a {type(built).__name__}, not a model, (model, optimizer) or a dict such as "
            '{"model": model, "optim": optimizer}'
        )
    models = [v for v in built.values() if isinstance(v, torch.nn.Module)]
    out: dict[str, Any] = {}
    for name, value in built.items():
        if isinstance(value, torch.nn.Module):
            out[str(name)] = dict(value.state_dict())
        elif isinstance(value, torch.optim.Optimizer):
            if len(models) != 1:
                raise StateDictTypeError(
                    f"{len(models)} models next to optimizer {name!r}, not the one model its "
                    "parameters belong to"
                )
            out[str(name)] = _optimizer_reference(models[0], value, optimizer_layout)
        else:
            out[str(name)] = value
    return out


def _optimizer_reference(model: Any, optimizer: Any, layout: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=layout == "flat")
    osd = dict(get_optimizer_state_dict(model, optimizer, options=options))
    return dict(optimizer.state_dict()) if layout == "ids" else osd
