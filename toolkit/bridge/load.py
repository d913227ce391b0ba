"""Hugging Face safetensors into a live model: each rank reads only the rectangles of the HF
tensors its own rank tensors hold (safetensors' ``get_slice``), one rank tensor at a time.

Memory per rank: its model, plus the HF rectangles of one rank tensor (their pages of the mapped
files, unmapped once it is written; plus, under ZeRO-3, that parameter gathered whole and
partitioned again as soon as it is written).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..regions import Copy, as_2d
from .live import BridgeError, LiveModel


class SafetensorsFolder:
    """The tensors of an HF folder's safetensors shards, opened lazily (safe_open maps a file,
    reads nothing until a slice is asked for)."""

    def __init__(self, hf_dir: str | Path):
        from converters.formats.hf import open_hf

        self.dir = Path(hf_dir)
        self.config, reader = open_hf(self.dir)  # the converters' checks of the index and shards
        with reader:
            self.files = {name: Path(info.path) for name, info in reader.tensors.items()}
            self.shapes = {name: tuple(info.shape) for name, info in reader.tensors.items()}
            self.dtypes = {name: info.dtype for name, info in reader.tensors.items()}
        self._open: dict[Path, Any] = {}

    def rows_cols(self, name: str, c: Copy) -> torch.Tensor:
        """Rows [src_row, +rows) and columns [src_col, +cols) of the tensor's 2-D view."""
        from safetensors import safe_open

        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        piece = self._open[path].get_slice(name)
        r = slice(c.src_row, c.src_row + c.rows)
        shape = self.shapes[name]
        if len(shape) == 1:
            return piece[r].reshape(c.rows, 1)
        if len(shape) == 2:
            return piece[r, c.src_col:c.src_col + c.cols]
        return piece[r].reshape(c.rows, -1)[:, c.src_col:c.src_col + c.cols]  # whole rows, then the columns

    def close(self) -> None:
        self._open.clear()


def check_weights(live: LiveModel, folder: SafetensorsFolder) -> None:
    """Every HF tensor the model needs is there with its shape, none is left unplaced
    (the converters' own checks), and no FP8/MXFP4 quantisation the bridge would misread."""
    from converters.convert import _check_hf_extras
    from converters.errors import MissingTensorError
    from converters.stream import check_sources

    if (folder.config.get("quantization_config") or {}).get("quant_method"):
        raise BridgeError(f"'{folder.dir}' holds quantised weights "
                          f"({folder.config['quantization_config']['quant_method']}); dequantise them with the "
                          "converters first")

    def meta(name):
        if name not in folder.shapes:
            raise MissingTensorError(f"missing tensor: {name}")
        return folder.shapes[name], folder.dtypes[name]

    own = {n: s for n, s in live.map.hf_shapes.items() if n not in live.map.aliases}
    check_sources(own, meta)
    _check_hf_extras(folder.shapes, live.map)


def load_hf(model: Any, hf_dir: str | Path, progress: Callable[[int, int], None] | None = None) -> None:
    """Load the HF folder's weights into the live model: a GPTModel or this rank's chunks, also
    partitioned by ZeRO-3's ``deepspeed.zero.Init`` (then collective over each parameter's
    data-parallel group; otherwise every rank works alone), before a DeepSpeed engine is built
    on them. ``progress(done, total)`` after each rank tensor."""
    from ..runtime.checkpoint import whole

    if hasattr(model, "optimizer") and hasattr(model, "module"):
        raise BridgeError("load_hf into a DeepSpeed engine would change the modules but not the optimizer's fp32 "
                          "master copies (the next step would undo it): load into the chunks before the engine is "
                          "built (under ZeRO-3 too: the partitioned chunks of toolkit.runtime.model)")
    folder = SafetensorsFolder(hf_dir)
    live = LiveModel(model, folder.config)
    check_weights(live, folder)
    held = list(live.held.values())
    try:
        with torch.no_grad():
            for i, h in enumerate(held):
                with whole([h.tensor] if isinstance(h.tensor, torch.nn.Parameter) else [], modify=True):
                    _fill(h.tensor, h.from_hf, folder)
                folder.close()  # unmapped: the pages read stay resident no longer than their rank tensor
                if progress is not None:
                    progress(i + 1, len(held))
    finally:
        folder.close()


def _fill(t: torch.Tensor, copies: tuple[Copy, ...], folder: SafetensorsFolder) -> None:
    rows, cols = as_2d(tuple(t.shape))
    view = t.data.view(rows, cols)
    covered = 0
    for c in copies:
        view[c.dst_row:c.dst_row + c.rows, c.dst_col:c.dst_col + c.cols].copy_(folder.rows_cols(c.src, c))
        covered += c.area
    padded = rows * cols - covered  # the vocabulary's padding rows: zero, as the converters write them
    if padded:
        _zero_uncovered(view, copies)


def _zero_uncovered(view: torch.Tensor, copies: tuple[Copy, ...]) -> None:
    """Rows no copy writes (vocabulary padding) are set to zero, as the converters write them."""
    written = torch.zeros(view.shape[0], dtype=torch.bool)
    for c in copies:
        written[c.dst_row:c.dst_row + c.rows] = True
    view[~written] = 0
