"""A Lightning ``Callback`` that makes ``Trainer.fit(ckpt_path=...)`` resume a changed model.

Lightning restores a ``.ckpt`` in this order: the ``LightningModule``'s
``on_load_checkpoint``, ``module.load_state_dict(checkpoint["state_dict"],
strict=module.strict_loading)``, the callbacks' ``on_load_checkpoint``, then (after
the optimizers are built) ``optimizer.load_state_dict(checkpoint["optimizer_states"][i])``
for each optimizer, by int ids. A callback's ``on_load_checkpoint`` runs after the
model was loaded and before the optimizers exist, so :class:`ResumeCallback` merges
both through load hooks instead, installed where Lightning has the objects:

* ``setup``: :func:`~dsdmerge.integrations.install_model_load_hook` on the module, so
  ``checkpoint["state_dict"]`` is merged over the module's state (strict or not);
* ``on_fit_start``: :func:`~dsdmerge.integrations.record_param_names` and
  :func:`~dsdmerge.integrations.install_load_hook` on every optimizer, so each
  ``optimizer_states[i]`` is keyed by name and merged (and every later ``.ckpt``
  carries the names);
* ``teardown``: the hooks are removed.

Lightning is not a dependency: the class is built on first access from
``lightning.pytorch`` (or ``pytorch_lightning``), whichever is installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterable

    from dsdmerge.diff import KeyDiff
    from dsdmerge.integrations.hooks import LoadHook, ModelLoadHook
    from dsdmerge.merge import Fresh
    from dsdmerge.policy import Policy, PolicyName
    from dsdmerge.rename import Rules
    from dsdmerge.resize import OnShapeMismatch

__all__ = ["ResumeCallback"]  # noqa: F822 (built on first access, see __getattr__)


def _callback_base() -> type[Any]:
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(name).Callback  # type: ignore[no-any-return]
        except ImportError:
            continue
    raise ImportError(
        "dsdmerge.integrations.lightning.ResumeCallback needs Lightning: pip install lightning"
    )


def _build() -> type[Any]:
    from dsdmerge.integrations.hooks import (
        install_load_hook,
        install_model_load_hook,
        record_param_names,
    )

    base = _callback_base()

    class ResumeCallback(base):  # type: ignore[misc,valid-type]
        """Resume ``Trainer.fit(ckpt_path=...)`` on a changed model: see the module docstring.

        The options are those of :func:`~dsdmerge.integrations.install_load_hook`;
        ``policy``, the allow-lists, ``rename`` and ``on_shape_mismatch`` apply to
        the model's ``state_dict`` too (globs such as ``"*head*"`` match both its
        keys and the optimizer's ``state.<fqn>.*`` keys).

        Attributes:
            model_diff: The :class:`~dsdmerge.KeyDiff` of the last ``state_dict`` loaded.
            optimizer_diffs: One per optimizer, of the last ``optimizer_states[i]``.

        Examples:
            >>> from dsdmerge.integrations.lightning import ResumeCallback  # doctest: +SKIP
            >>> trainer = lightning.pytorch.Trainer(  # doctest: +SKIP
            ...     callbacks=[ResumeCallback(allow_missing="*value_head*")])
            >>> trainer.fit(module, ckpt_path="last.ckpt")  # doctest: +SKIP
        """

        def __init__(
            self,
            *,
            policy: PolicyName | Policy = "default",
            allow_missing: str | Iterable[str] = (),
            allow_unexpected: str | Iterable[str] = (),
            rename: Rules | None = None,
            on_shape_mismatch: OnShapeMismatch = "raise",
            fresh: Fresh = "as_fresh",
            names: Iterable[str] | None = None,
            by_position: bool = False,
        ) -> None:
            super().__init__()
            self._model_options: dict[str, Any] = {
                "policy": policy,
                "allow_missing": allow_missing,
                "allow_unexpected": allow_unexpected,
                "rename": rename,
                "on_shape_mismatch": on_shape_mismatch,
            }
            self._optim_options: dict[str, Any] = {
                **self._model_options,
                "fresh": fresh,
                "names": None if names is None else list(names),
                "by_position": by_position,
            }
            self._model_hook: ModelLoadHook | None = None
            self._optim_hooks: list[LoadHook] = []
            self.model_diff: KeyDiff | None = None
            self.optimizer_diffs: list[KeyDiff | None] = []

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if self._model_hook is None:
                self._model_hook = install_model_load_hook(pl_module, **self._model_options)

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            self._remove_optim_hooks()
            for optimizer in trainer.optimizers:
                record_param_names(optimizer, pl_module)
                self._optim_hooks.append(
                    install_load_hook(optimizer, pl_module, **self._optim_options)
                )

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            # the checkpoint has been restored: keep what the hooks found
            if self._model_hook is not None:
                self.model_diff = self._model_hook.diff
            self.optimizer_diffs = [h.diff for h in self._optim_hooks]

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if self._model_hook is not None:
                self._model_hook.remove()
                self._model_hook = None
            self._remove_optim_hooks()

        def _remove_optim_hooks(self) -> None:
            for hook in self._optim_hooks:
                hook.remove()
            self._optim_hooks = []

    ResumeCallback.__module__ = __name__
    return ResumeCallback


def __getattr__(name: str) -> Any:
    if name != "ResumeCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = _build()
    globals()[name] = cls
    return cls
