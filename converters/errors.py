"""Typed conversion errors: each message is one line naming the tensor, file or number at fault.

Layout problems (tp not dividing heads, pp not dividing layers, ...) are the spine's
``PlanError`` (exit 2); an unsupported architecture is the registry's
``UnsupportedArchitectureError`` (exit 2). Everything about the files is a CheckpointError (exit 1).
"""
from __future__ import annotations

from toolkit.errors import ConversionSetupError, InputFileError, ToolkitError, UnsupportedModelError

__all__ = ["CheckpointError", "ConversionError", "ConversionSetupError", "CorruptFileError", "LayoutMismatchError",
           "MissingTensorError", "TensorShapeError", "UnsupportedModelError"]


class CheckpointError(InputFileError):
    """A checkpoint (HF or Megatron) is incomplete, inconsistent or unreadable."""


class MissingTensorError(CheckpointError):
    """A tensor the model needs is not in the checkpoint (named in the message)."""


class TensorShapeError(CheckpointError):
    """A tensor has another shape than the model needs (expected vs got)."""


class CorruptFileError(CheckpointError):
    """A checkpoint file is truncated or not in the format its name says."""


class LayoutMismatchError(CheckpointError):
    """The files of a Megatron checkpoint disagree with its args or with each other."""


class ConversionError(ToolkitError):
    """A conversion that could not be completed for another reason than its input (a
    worker process died)."""
