"""Your own model: any ``torch.nn.Module`` whose ``forward(x, edge_index)`` returns logits, as PyG's models do.

ladle names such a model ``custom`` in a recipe and a run; the class itself is given by the user at every
command (``--model-class package.module:Class``) or library call (``model=``), never read from a file, so no
recipe or run directory names code to run. ladle's own fast paths (cached sparse aggregation, layer-wise
inference) are for its built-in models: a custom model is trained and scored by whole-graph (or sampled
sub-graph) forwards of ``edge_index``.
"""
from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from torch import Tensor, nn

from ladle.core.errors import LadleError
from ladle.graph.inputs import GraphInputs

ModelFactory = Callable[[int, int], nn.Module]  # (in_channels, out_channels) -> a module


class CustomModel(nn.Module):
    """A user's module behind ladle's ``forward(inputs)``: ``module(inputs.x, inputs.adj)``, ``adj`` being
    ``edge_index``. Its state dict is the module's, under ``module.``."""

    model = "custom"

    def __init__(self, factory: ModelFactory, in_channels: int, out_channels: int) -> None:
        super().__init__()
        module = factory(in_channels, out_channels)
        if not isinstance(module, nn.Module):
            raise LadleError(f"the model class {_name(factory)} returned a {type(module).__name__}, not a torch.nn.Module")
        self.module, self.in_channels = module, in_channels
        for name, buffer in module.named_buffers():
            if not buffer.is_floating_point() and not name.endswith("num_batches_tracked"):
                raise LadleError(f"the model's buffer {name!r} is {buffer.dtype}: a soup averages floating-point "
                                 "tensors, so ladle cannot merge it (make it a float or leave it out of the state dict)")

    def forward(self, inputs: GraphInputs) -> Tensor:
        """Logits for every node of ``inputs``."""
        return self.module(inputs.x, inputs.adj)

    def has_batch_norm(self) -> bool:
        """Whether running statistics must be recomputed after merging weights."""
        return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.modules())


def check_model_class(model: str, model_class: ModelFactory | None) -> None:
    """Refuse a model class for a run of a built-in ``model`` (a run of ``model: custom`` without one fails when
    built)."""
    if model_class is not None and model != "custom":
        raise LadleError(f"this run trained ladle's built-in {model}; --model-class (model=) is only for runs "
                         "trained with your own class")


def import_model_class(spec: str) -> ModelFactory:
    """The class (or factory) named ``package.module:Class``, importable from the working directory as well."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise LadleError(f"--model-class takes package.module:Class, got {spec!r}")
    if os.getcwd() not in sys.path:  # as `python -m` does: the user's own modules beside them
        sys.path.insert(0, os.getcwd())
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as error:
        raise LadleError(f"--model-class {spec}: cannot import {module_name} ({error})") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise LadleError(f"--model-class {spec}: {module_name} has no {attribute}")
        target = getattr(target, part)
    if not callable(target):
        raise LadleError(f"--model-class {spec} is not a class or a function")
    return target  # type: ignore[return-value]


def _name(factory: ModelFactory) -> str:
    return f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', repr(factory))}"
