"""Weights that stay on disk while passes run: the graph's initializers are references into external data
files, read one at a time when a pass asks for a value (``Graph.constant``), and the large tensors a pass
creates are appended to a spill file at once instead of growing the protobuf.

The compiler opens a ``WeightStore`` over the directory that holds the graph's data files for the duration of
the pipeline (``with store.active():``); passes only see it through ``kiln.passes.graph.Graph``. Without an
active store every initializer must be inline (the in-memory path small models take), and nothing spills.
``compact`` writes the final graph: every live tensor above a threshold into one data file beside it, copied
tensor by tensor, whatever file it came from.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

SPILL_ABOVE = 1024
"""Tensors a pass creates of at least this many bytes go to the spill file (the threshold the final graph keeps
inline below): shapes, scalars and small tables stay in the protobuf, nothing weight-sized does."""

_ACTIVE: contextvars.ContextVar[WeightStore | None] = contextvars.ContextVar("kiln_weight_store", default=None)


def is_external(t: TensorProto) -> bool:
    return t.data_location == TensorProto.EXTERNAL


def _external(t: TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


class ExternalWeightsError(RuntimeError):
    """A pass read an external tensor with no store open: a compiler bug, never a user error."""


class WeightStore:
    """External data under ``base_dir``: reads tensors, spills new large ones into ``spill`` (a file there)."""

    def __init__(self, base_dir: Path, spill: str = "spill.kiln-data") -> None:
        self.base_dir = Path(base_dir)
        self.spill_name = spill
        self.spilled_bytes = 0
        self.read_bytes = 0

    def read(self, t: TensorProto) -> np.ndarray:
        info = _external(t)
        path = self.base_dir / info["location"]
        offset, length = int(info.get("offset", 0)), int(info["length"])
        self.read_bytes += length
        if t.data_type in (TensorProto.INT4, TensorProto.UINT4):  # packed: let onnx unpack a copy
            with open(path, "rb") as fh:
                fh.seek(offset)
                raw = fh.read(length)
            inline = TensorProto()
            inline.CopyFrom(t)
            del inline.external_data[:]
            inline.data_location = TensorProto.DEFAULT
            inline.raw_data = raw
            return numpy_helper.to_array(inline)
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
        out = np.empty(length // dtype.itemsize, dtype)
        with open(path, "rb") as fh:  # straight into the array: no second copy of a large weight
            fh.seek(offset)
            if fh.readinto(memoryview(out).cast("B")) != length:
                raise OSError(f"{path} ends before tensor {t.name}'s {length} bytes")
        return out.reshape(tuple(t.dims))

    def spill(self, t: TensorProto) -> TensorProto:
        """``t``'s bytes appended to the spill file; returns a new tensor that references them.

        A new message, not ``t`` with its bytes cleared: protobuf keeps a message's bytes in its arena until the
        whole message is freed, so clearing them frees nothing (an 8B model's INT4 codes, 4.5 GB, stayed resident
        through the pass that made them). The caller drops ``t``."""
        raw = t.raw_data if t.HasField("raw_data") else numpy_helper.from_array(numpy_helper.to_array(t)).raw_data
        path = self.base_dir / self.spill_name
        with open(path, "ab") as fh:
            offset = fh.tell()
            fh.write(raw)
        ref = TensorProto(name=t.name, dims=list(t.dims), data_type=t.data_type, data_location=TensorProto.EXTERNAL)
        for key, value in (("location", self.spill_name), ("offset", str(offset)), ("length", str(len(raw)))):
            entry = ref.external_data.add()
            entry.key, entry.value = key, value
        self.spilled_bytes += len(raw)
        return ref

    @contextlib.contextmanager
    def active(self) -> Iterator[WeightStore]:
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)


def current() -> WeightStore | None:
    return _ACTIVE.get()


def read(t: TensorProto) -> np.ndarray:
    """An initializer's value, inline or external (through the active store)."""
    if not is_external(t):
        return numpy_helper.to_array(t)
    store = current()
    if store is None:
        raise ExternalWeightsError(f"initializer {t.name} lives in external data but no weight store is open")
    return store.read(t)


def maybe_spill(t: TensorProto) -> TensorProto:
    """A tensor a pass just made: spilled when a store is open and it is large (use the returned tensor, never
    ``t`` again), else returned as it is."""
    store = current()
    if store is not None and not is_external(t) and len(t.raw_data) >= SPILL_ABOVE:
        return store.spill(t)
    return t


def compact(model: onnx.ModelProto, src_dir: Path, path: Path, threshold: int) -> int:
    """Write ``model`` to ``path`` with every tensor of at least ``threshold`` bytes (external ones always) in
    ``path.name + '.data'``, copied one tensor at a time from wherever it lives now. The data file is written
    under a temporary name and renamed last, so the sources (which may carry the final name) are read intact.
    Returns the bytes written to the data file."""
    final = path.name + ".data"
    staged = path.parent / (final + ".kiln-new")
    offset = 0
    with open(staged, "wb") as out:
        for t in model.graph.initializer:
            if is_external(t):
                info = _external(t)
                src = src_dir / info["location"]
                length = int(info["length"])
                with open(src, "rb") as fh:
                    fh.seek(int(info.get("offset", 0)))
                    remaining = length
                    while remaining:
                        chunk = fh.read(min(remaining, 64 << 20))
                        if not chunk:
                            raise OSError(f"{src} ends before tensor {t.name}'s {length} bytes")
                        out.write(chunk)
                        remaining -= len(chunk)
            elif t.HasField("raw_data") and len(t.raw_data) >= threshold:
                length = len(t.raw_data)
                out.write(t.raw_data)
                t.ClearField("raw_data")
                t.data_location = TensorProto.EXTERNAL
            else:
                continue
            del t.external_data[:]
            for key, value in (("location", final), ("offset", str(offset)), ("length", str(length))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
            offset += length
    onnx.save_model(model, str(path))
    if offset:
        os.replace(staged, path.parent / final)
    else:
        staged.unlink()
    return offset
