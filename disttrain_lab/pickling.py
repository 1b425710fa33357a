"""What crosses between a notebook's kernel and its ranks is pickled by cloudpickle, with one addition:
float8 tensors travel as their bytes.

torch 2.13 pickles a float8 tensor's storage in a form it cannot load back (``pickle.loads(pickle.dumps(
torch.zeros(1, dtype=torch.float8_e4m3fn)))`` raises ``AttributeError: ... UntypedStorage has no attribute
'dtype'``; ``torch.save`` is not affected), so a rank that returned an FP8 tensor (Lab 13) failed in the
kernel.  Here such a tensor is sent as a ``uint8`` view of its bytes and its dtype's name, and viewed back.
"""

from __future__ import annotations

import io
import sys

import cloudpickle

__all__ = ["Pickler", "dumps"]


def _float8(data, dtype: str):
    """A float8 tensor again, from its bytes (a uint8 tensor of its shape) and its dtype's name."""
    import torch

    return data.view(getattr(torch, dtype))


class Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler; a plain float8 tensor is pickled as its bytes (``_float8`` views them back)."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")  # no tensor exists where torch was never imported
        if torch is not None and type(obj) is torch.Tensor and obj.is_floating_point() and obj.element_size() == 1:
            data = obj.detach().contiguous().view(torch.uint8)
            return _float8, (data, str(obj.dtype).removeprefix("torch."))
        return super().reducer_override(obj)


def dumps(obj) -> bytes:
    """``cloudpickle.dumps(obj)``, float8 tensors included."""
    with io.BytesIO() as file:
        Pickler(file, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
        return file.getvalue()
