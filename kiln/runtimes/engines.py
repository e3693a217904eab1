"""TensorRT engine bookkeeping that needs no GPU: optimization profiles from the manifest's dynamic axes (and
``--profile``), the engine cache key, and why a stored engine must not run. Pure functions, tested here; the
builder and the TensorRT backend (a GPU machine, the ``gpu`` extra) call them.

An engine is valid only for the TensorRT version that built it, the GPU compute capability it was built on, its
optimization profiles, its precision recipe and the exact graph (sha256). The cache key hashes all five; the
record stored beside the plan keeps them readable so a refusal can say which one changed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from kiln.errors import ArtifactError, UsageError

Range = tuple[int, int, int]
"""(min, opt, max) of one axis."""
Shapes = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""(min, opt, max) shape of one input: what ``IOptimizationProfile.set_shape`` takes."""

ALIASES = {"batch": "batch", "seq": "sequence", "sequence": "sequence", "past": "past_sequence",
           "past_sequence": "past_sequence", "total": "total_sequence", "total_sequence": "total_sequence"}
DEFAULT_MAX_BATCH = 8
DEFAULT_OPT_SEQUENCE = 128


def parse_profile(text: str) -> dict[str, Range]:
    """``batch=1:4:8,seq=1:128:512[,past=0:128:1024]`` -> {axis: (min, opt, max)}; one line per mistake."""
    out: dict[str, Range] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, spec = part.partition("=")
        axis = ALIASES.get(name.strip())
        values = spec.split(":")
        if axis is None or len(values) != 3 or not all(v.strip().isdigit() for v in values):
            raise UsageError(f"--profile {text!r}: give AXIS=MIN:OPT:MAX pairs, axes batch, seq, past, total "
                             "(e.g. batch=1:4:8,seq=1:128:512)")
        lo, opt, hi = (int(v) for v in values)
        if not lo <= opt <= hi or hi < 1:
            raise UsageError(f"--profile {part}: need MIN <= OPT <= MAX and MAX >= 1")
        out[axis] = (lo, opt, hi)
    return out


def axis_ranges(manifest: dict[str, Any], given: dict[str, Range] | None = None) -> dict[str, Range]:
    """Every dynamic axis of the artifact's inputs with its (min, opt, max): the manifest's limits, narrowed by
    ``given``. Decoders get one profile for prefill and decode: ``past_sequence`` from 0 (the empty past of a
    prefill) to capacity - 1, ``total_sequence`` (past + new) up to the capacity."""
    axes = manifest.get("dynamic_axes", {})
    seq_max = int(axes.get("sequence", {}).get("max") or manifest["model"]["max_sequence_length"])
    limits: dict[str, tuple[int, int]] = {"batch": (1, int(axes.get("batch", {}).get("max") or 1024)),
                                         "sequence": (1, seq_max)}
    defaults: dict[str, Range] = {"batch": (1, 1, min(DEFAULT_MAX_BATCH, limits["batch"][1])),
                                  "sequence": (1, min(DEFAULT_OPT_SEQUENCE, seq_max), seq_max)}
    kv = manifest.get("kv_cache")
    if kv:
        cap = int(kv["capacity"])
        limits |= {"past_sequence": (0, cap - 1), "total_sequence": (1, cap)}
        opt_past = min(DEFAULT_OPT_SEQUENCE, cap - 1)
        # the optimum is a decode step (one new token after opt_past): consistent, as TensorRT's shape checks need
        defaults |= {"sequence": (1, 1, seq_max), "past_sequence": (0, opt_past, cap - 1),
                     "total_sequence": (1, opt_past + 1, cap)}
    used = {d for spec in manifest["inputs"] for d in spec["shape"] if isinstance(d, str)}
    out = {axis: r for axis, r in defaults.items() if axis in used}
    for axis, (lo, opt, hi) in (given or {}).items():
        if axis not in out:
            raise UsageError(f"--profile {axis}: this artifact's inputs have no {axis} axis; "
                             f"its axes are {', '.join(sorted(out))}")
        low, high = limits[axis]
        if lo < low or hi > high:
            raise UsageError(f"--profile {axis}={lo}:{opt}:{hi} is outside what the artifact allows ({low}..{high}); "
                             "recompile with --max-length for longer sequences")
        out[axis] = (lo, opt, hi)
    if kv and {"sequence", "past_sequence", "total_sequence"} <= set(out):
        seq, past, total = out["sequence"][1], out["past_sequence"][1], out["total_sequence"][1]
        if seq + past != total:
            raise UsageError(f"--profile: the optimum must be one consistent step, seq + past = total "
                             f"({seq} + {past} != {total}); e.g. seq=1:1:{out['sequence'][2]},past=0:{total - 1}:"
                             f"{out['past_sequence'][2]},total=1:{total}:{out['total_sequence'][2]}")
    missing = used - set(out)
    if missing:
        raise ArtifactError(f"the artifact's inputs use axes {', '.join(sorted(missing))} kiln has no profile rule "
                            "for; recompile it with this kiln")
    return out


def input_profiles(manifest: dict[str, Any], ranges: dict[str, Range]) -> dict[str, Shapes]:
    """(min, opt, max) shape of every input from the axis ranges (static dims as they are)."""
    out: dict[str, Shapes] = {}
    for spec in manifest["inputs"]:
        lo, opt, hi = (tuple(d if isinstance(d, int) else ranges[d][i] for d in spec["shape"]) for i in range(3))
        out[spec["name"]] = (lo, opt, hi)
    return out


@dataclass(frozen=True)
class EngineRecord:
    """What an engine was built for; stored as ``engines/<key>.json`` beside ``engines/<key>.plan``."""

    tensorrt: str
    compute_capability: str
    profiles: dict[str, Shapes]
    precision: str
    graph_sha256: str

    @property
    def key(self) -> str:
        return cache_key(self.tensorrt, self.compute_capability, self.profiles, self.precision, self.graph_sha256)

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"key": self.key, "profiles": _plain(self.profiles)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineRecord:
        try:
            profiles = {k: tuple(tuple(int(x) for x in s) for s in v) for k, v in data["profiles"].items()}
            return cls(str(data["tensorrt"]), str(data["compute_capability"]), profiles,  # type: ignore[arg-type]
                       str(data["precision"]), str(data["graph_sha256"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ArtifactError(f"engine record is malformed ({e!r}); rebuild it with kiln build-engine") from e


def _plain(profiles: dict[str, Shapes]) -> dict[str, list[list[int]]]:
    return {k: [list(s) for s in v] for k, v in sorted(profiles.items())}


def cache_key(tensorrt: str, compute_capability: str, profiles: dict[str, Shapes], precision: str,
              graph_sha256: str) -> str:
    """sha256 (first 16 hex digits) of the canonical JSON of all five: equal keys, interchangeable engines."""
    blob = json.dumps({"tensorrt": tensorrt, "cc": compute_capability, "profiles": _plain(profiles),
                       "precision": precision, "graph": graph_sha256}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def refusal(record: EngineRecord, wanted: EngineRecord, profiles: bool = True) -> str | None:
    """Why the stored engine must not run here (None: it may). Names the first difference, most fundamental first.
    ``profiles=False`` (loading to run, where any profile that covers the feeds will do) skips the profile check."""
    checks = (("graph_sha256", "it was built from a different graph (the artifact was recompiled)"),
              ("tensorrt", "it was built by TensorRT {old}, this is TensorRT {new} (engines do not carry over)"),
              ("compute_capability", "it was built for compute capability {old}, this GPU is {new}"),
              ("precision", "it was built with precision recipe {old}, asked for {new}"),
              ("profiles", "its optimization profiles differ from the ones asked for"))
    for field, why in checks:
        if field == "profiles" and not profiles:
            continue
        old, new = getattr(record, field), getattr(wanted, field)
        if (_plain(old) != _plain(new)) if field == "profiles" else old != new:
            return why.format(old=old, new=new) + "; rebuild it with kiln build-engine --force"
    return None


def pick(stored: list[tuple[str, EngineRecord]], wanted: EngineRecord) -> tuple[str | None, list[str]]:
    """The first stored engine (name, record) that may run for ``wanted`` (its profiles aside), and why each one
    before it may not: a stale or foreign engine is refused with its reason, never run."""
    refused: list[str] = []
    for name, record in stored:
        why = refusal(record, wanted, profiles=False)
        if why is None:
            return name, refused
        refused.append(f"{name}: {why}")
    return None, refused


def outside_profile(shapes: dict[str, tuple[int, ...]], profiles: dict[str, Shapes]) -> str | None:
    """The first fed input whose shape the engine's profile does not cover, said with the profile's range."""
    for name, shape in shapes.items():
        if name not in profiles:
            continue
        lo, _, hi = profiles[name]
        if len(shape) != len(lo) or any(s < a or s > b for s, a, b in zip(shape, lo, hi)):
            return (f"input {name} has shape {list(shape)}, outside the engine's profile {list(lo)}..{list(hi)}; "
                    "rebuild with kiln build-engine --profile covering it")
    return None
