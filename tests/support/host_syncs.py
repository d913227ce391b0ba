"""Not a test module: counts, on CPU, what would make the host wait for a GPU.

On CPU nothing waits: DeepSpeed's CPU accelerator's ``synchronize`` returns at once and
``.item()`` reads memory the host already has. What the same code does on CUDA is still
visible here as calls:
  - ``synchronize``: calls of DeepSpeed's ``get_accelerator().synchronize`` and of
    ``torch.cuda.synchronize`` (each a device-wide wait on CUDA);
  - ``reads``: ``aten._local_scalar_dense``, which every ``.item()``, ``bool(t)``, ``float(t)``
    and ``int(t)`` of a tensor dispatches to (on CUDA a copy to the host that waits for the
    stream);
  - ``square_bool_bytes``: bytes of the bool tensors of exactly s x s elements made by a
    non-view op while counting (a causal mask of a sequence of ``seq`` tokens).
Not visible: a synchronisation DeepSpeed takes only on devices that do not order their streams
themselves (``get_accelerator().resolves_data_dependency()`` is True on CPU, so e.g. ZeRO-2's
overlap_comm ``synchronize`` in ``independent_gradient_partition_epilogue`` is not reached).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class HostSyncs(TorchDispatchMode):
    """``with HostSyncs(seq) as c: ...`` then ``c.synchronize``, ``c.reads``, ``c.square_bool_bytes``."""

    def __init__(self, seq: int | None = None):
        super().__init__()
        self.seq, self.synchronize, self.reads, self.square_bool_bytes = seq, 0, 0, 0

    def __enter__(self):
        from deepspeed.accelerator import get_accelerator

        self._accelerator = get_accelerator()
        self._real = (self._accelerator.synchronize, torch.cuda.synchronize)
        self._accelerator.synchronize = self._counted(self._real[0])
        torch.cuda.synchronize = self._counted(self._real[1])
        return super().__enter__()

    def __exit__(self, *exc):
        self._accelerator.synchronize, torch.cuda.synchronize = self._real
        return super().__exit__(*exc)

    def _counted(self, fn):
        def synchronize(*args, **kwargs):
            self.synchronize += 1
            return fn(*args, **kwargs)

        return synchronize

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        elif self.seq is not None and not func.is_view:
            n = self.seq * self.seq
            self.square_bool_bytes += sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                                          and t.dtype == torch.bool and t.numel() == n)
        return out

    def counts(self) -> dict[str, int]:
        return {"synchronize": self.synchronize, "reads": self.reads, "square_bool_bytes": self.square_bool_bytes}
