"""A checkpoint read one tensor at a time, and the model as an empty shell that holds none of them.

Large decoders never exist whole in memory: safetensors shards are memory-mapped, a tensor is read (and
upcast to FP32) only when a graph writer, a quantizer or the layer-by-layer reference asks for it, and
the PyTorch module tree that torch.onnx traces and the reference runs is built on the meta device
(``build_shell``), its parameters filled one layer at a time (``fill`` / ``empty``).
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import CheckpointError
from kiln.runtimes.artifact import inside

log = logging.getLogger(__name__)

TORCH_DTYPES: dict[str, Any] = {}
"""safetensors dtype name -> torch dtype, filled on first use (torch is imported lazily)."""
SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1}


@dataclass(frozen=True)
class Entry:
    file: Path
    dtype: str  # safetensors dtype name: F16, BF16, F32, ...
    shape: tuple[int, ...]
    start: int = 0
    """Byte offset of the tensor's data in the file (header included)."""

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * SAFETENSORS_DTYPES.get(self.dtype, 4)

    @property
    def fp32_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * 4


MAX_INDEX_BYTES = 64 << 20
MAX_HEADER_BYTES = 100 << 20
"""safetensors' own limit: a longer header is refused before it is read."""


def weight_map(index: Path) -> dict[str, str]:
    """A ``*.index.json``'s tensor name -> shard file, read once and bounded (the shard names are not yet confined:
    callers pass each through ``inside``)."""
    try:
        if index.stat().st_size > MAX_INDEX_BYTES:
            raise ValueError(f"{index.stat().st_size} bytes, more than {MAX_INDEX_BYTES >> 20} MiB")
        names = json.loads(index.read_text())["weight_map"]
        if not isinstance(names, dict) or not all(isinstance(v, str) for v in names.values()):
            raise ValueError("weight_map is not an object of tensor name -> shard file")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{index} is not a valid shard index ({type(e).__name__}: {str(e)[:120]}); restore it "
                              "from the original checkpoint") from e
    return names


def safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of one safetensors file and where its data starts, bounded before it is read: its length
    within the file and ``MAX_HEADER_BYTES``, an object of tensor name -> {dtype, shape, data_offsets}."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ValueError("file shorter than its 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > MAX_HEADER_BYTES:
            raise ValueError(f"header length {n} exceeds the file or {MAX_HEADER_BYTES >> 20} MiB")
        try:
            header = json.loads(fh.read(n))
        except RecursionError as e:
            raise ValueError("header nests too deeply") from e
    if not isinstance(header, dict):
        raise ValueError(f"header is a JSON {type(header).__name__}, not an object")
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not (isinstance(info, dict) and isinstance(info.get("dtype"), str) and isinstance(info.get("shape"), list)
                and all(type(d) is int and 0 <= d < 1 << 40 for d in info["shape"])
                and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
                and all(type(o) is int for o in info["data_offsets"])):
            raise ValueError(f"tensor {str(name)[:80]!r} has no valid dtype, shape and data_offsets")
        start, stop = info["data_offsets"]
        if not 0 <= start <= stop:
            raise ValueError(f"tensor {str(name)[:80]} has bad offsets {start}..{stop}")
        if 8 + n + stop > size:
            raise ValueError(f"tensors need {8 + n + stop} bytes but the file has {size} (truncated)")
    return header, 8 + n


class _Owned(np.ndarray):
    """The FP32 buffer behind every tensor ``LazyWeights`` hands out: a weak reference to it tells when the last
    tensor, parameter or array sharing its memory is gone."""


class LazyWeights:
    """Every tensor of a safetensors checkpoint by name, read on demand as FP32.

    ``live_bytes`` / ``peak_bytes`` count the FP32 data read from the checkpoint and still referenced by anything
    (a tensor, a parameter, a numpy view): each buffer is counted from its read until it is freed, so the
    streaming test can assert on what was ever in memory at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, Entry] = {}
        index = path / "model.safetensors.index.json"
        if index.is_file():
            shards: dict[str, str] | None = weight_map(index)
            files = sorted(set(shards.values()))
        elif (path / "model.safetensors").is_file():
            shards, files = None, ["model.safetensors"]
        else:
            raise CheckpointError(f"checkpoint {path} has no safetensors weights; kiln streams large checkpoints from "
                                  "safetensors only: re-save it with save_pretrained(safe_serialization=True)")
        for name in files:
            shard = inside(path, name, f"{index.name} shard", CheckpointError)
            if not shard.is_file():
                raise CheckpointError(f"checkpoint {path} lacks shard {name} named in its index; copy the missing file")
            try:
                header, base = safetensors_header(shard)
            except (ValueError, struct.error) as e:
                raise CheckpointError(f"weights file {shard} is corrupt ({e}); re-download or re-save the "
                                      "checkpoint") from e
            for key, info in header.items():
                if key != "__metadata__":
                    self.entries[key] = Entry(shard, info["dtype"], tuple(int(d) for d in info["shape"]),
                                              base + int(info["data_offsets"][0]))
        if shards is not None:
            for key, shard_name in shards.items():
                entry = self.entries.get(key)
                if entry is None or entry.file.name != shard_name:
                    raise CheckpointError(f"{index.name} of {path} names tensor {key} in {shard_name}, which does not "
                                          "hold it; restore the index or the shard from the original checkpoint")
        self._lock = threading.Lock()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.reads = 0

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def fp32_bytes(self) -> int:
        return sum(e.fp32_bytes for e in self.entries.values())

    def torch(self, key: str, transpose: bool = False) -> Any:
        """One tensor as a float32 torch tensor (counted as live until nothing references its memory); ``transpose``:
        a 2-D one transposed as it is upcast (one FP32 copy, not two: an 8B lm_head is 2.1 GB in FP32).

        Read with plain file reads, not safetensors' memory map: mapped pages of the checkpoint would count in
        the process's resident memory until the map closes (2.2 GB for a 1.1B FP16 checkpoint)."""
        entry = self.entries.get(key)
        if entry is None:
            raise CheckpointError(f"checkpoint {self.path} has no tensor {key}; it is incomplete or of another "
                                  "architecture than its config.json says")
        return self.read(entry, key, transpose)

    def read(self, entry: Entry, key: str, transpose: bool = False) -> Any:
        """``entry``'s tensor: floating point ones as counted FP32, others as stored."""
        import torch

        if not TORCH_DTYPES:
            TORCH_DTYPES.update(F64=torch.float64, F32=torch.float32, F16=torch.float16, BF16=torch.bfloat16,
                                I64=torch.int64, I32=torch.int32, I16=torch.int16, I8=torch.int8, U8=torch.uint8,
                                BOOL=torch.bool)
        buf = bytearray(entry.nbytes)
        with open(entry.file, "rb") as fh:
            fh.seek(entry.start)
            got = fh.readinto(buf)
        if got != entry.nbytes:
            raise CheckpointError(f"weights file {entry.file} ends inside tensor {key}; re-download or re-save the "
                                  "checkpoint")
        t = torch.frombuffer(buf, dtype=TORCH_DTYPES[entry.dtype]).reshape(entry.shape) if buf else \
            torch.empty(entry.shape, dtype=TORCH_DTYPES[entry.dtype])
        if transpose:
            t = t.T
        if not t.is_floating_point():
            return t.contiguous()
        return self.own(t)

    def own(self, value: Any) -> Any:
        """An FP32 torch tensor holding a copy of ``value`` (torch or numpy), counted until its memory is freed."""
        import torch

        owned = np.empty(tuple(value.shape), np.float32).view(_Owned)
        out = torch.from_numpy(owned)
        out.copy_(value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value)))
        self._count(owned.nbytes)
        weakref.finalize(owned, self._free, owned.nbytes)
        return out

    def numpy(self, key: str) -> np.ndarray:
        return self.torch(key).numpy()

    def _count(self, n: int) -> None:
        with self._lock:
            self.reads += 1
            self.live_bytes += n
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _free(self, nbytes: int) -> None:
        with self._lock:
            self.live_bytes -= nbytes



def return_freed_memory() -> bool:
    """Make glibc give large freed blocks back to the system at once (a fixed 1 MiB mmap threshold).

    glibc raises its mmap threshold to 32 MiB after the first large free, so a streamed compile's stream of
    16-46 MB tensors (read, used, dropped, one at a time) would then come from the heap and stay resident: the
    1.1B reference pass grew by 1.6 GB over 22 layers that were each freed. Process-wide and harmless for a
    compile; returns whether it applied (glibc only)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 20))
    except (OSError, AttributeError):
        return False


def fp32_weight_bytes(path: Path) -> int | None:
    """FP32 size of a safetensors checkpoint's tensors from the headers alone (None: not safetensors). A damaged
    one (a shard missing, an index naming what no shard holds) raises CheckpointError."""
    if not ((path / "model.safetensors.index.json").is_file() or (path / "model.safetensors").is_file()):
        return None
    return LazyWeights(path).fp32_bytes()


# --- the empty shell ---------------------------------------------------------------------------------------


def build_shell(config: Any, task: str, attention: str) -> tuple[Any, dict[str, Any]]:
    """The model with every parameter on the meta device and its computed buffers (rotary frequencies) real.

    Returns the shell and those buffers by name: the export turns the shell into a graph without weights, and the
    buffers become the graph's only computed constants."""
    import torch
    import transformers
    from accelerate import init_empty_weights

    auto = {"feature-extraction": transformers.AutoModel, "causal-lm": transformers.AutoModelForCausalLM,
            "sequence-classification": transformers.AutoModelForSequenceClassification,
            "token-classification": transformers.AutoModelForTokenClassification}[task]
    with init_empty_weights(include_buffers=False):
        shell = auto.from_config(config, dtype=torch.float32, attn_implementation=attention)
    shell.eval()
    shell.tie_weights()  # what from_pretrained does after loading: tied parameters become one object again
    buffers = {n: b.detach().clone() for n, b in shell.named_buffers()}
    return shell, buffers


def parameter_keys(shell: Any, weights: LazyWeights) -> dict[str, str]:
    """Module parameter name -> checkpoint tensor name; tied parameters read the tensor they are tied to."""
    keys: dict[str, str] = {}
    by_id: dict[int, str] = {}
    for name, p in shell.named_parameters(remove_duplicate=False):
        if name in weights:
            by_id.setdefault(id(p), name)
    missing = []
    for name, p in shell.named_parameters(remove_duplicate=False):
        if name in weights:
            keys[name] = name
        elif id(p) in by_id:
            keys[name] = by_id[id(p)]
        else:
            missing.append(name)
    if missing:
        raise CheckpointError(f"checkpoint {weights.path} lacks {len(missing)} weight(s) its config implies "
                              f"({', '.join(missing[:3])}); it would run with random weights: pass a complete checkpoint")
    return keys


def layer_stack(shell: Any) -> tuple[Any, str]:
    """The model's ModuleList of layers and its name (the longest ModuleList of the config's layer count)."""
    import torch

    count = int(getattr(shell.config, "num_hidden_layers", 0) or 0)
    for name, module in shell.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count and count:
            return module, name
    raise CheckpointError(f"{type(shell).__name__} has no list of {count} layers kiln can stream one at a time")


def to_meta(module: Any) -> None:
    """Every parameter of ``module`` replaced by a meta tensor of its shape (tied ones stay one object); buffers
    are left as they are. Frees what ``fill`` gave it, whatever device or fake mode it held."""
    import torch

    made: dict[int, Any] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32, device="meta"),
                                                     requires_grad=False)
                sub._parameters[name] = made[id(p)]
