"""Reading an artifact directory: the manifest, its schema version and the file checksums.

The writer lives in ``kiln.compiler.manifest``; both agree on the names defined here.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from kiln.errors import ArtifactError, KilnError
from kiln.runtimes.schema import first_error, manifest_schema

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
REPORT = "report.json"
MAX_MANIFEST_BYTES = 64 << 20
MAX_ROW_CACHE_BYTES = 64 << 30
"""The largest KV cache one sequence may need at the manifest's capacity (an 8B model at 128k positions needs 17 GiB
in FP32): a hostile or damaged manifest is refused before any slot is allocated."""


def inside(root: Path, rel: Any, what: str, error: type[KilnError] = ArtifactError) -> Path:
    """``root / rel`` where ``rel`` (read from an untrusted manifest or index) names a file inside ``root``: a
    non-empty relative POSIX path with no ``..``, no backslash and no NUL, that still lies inside ``root`` once
    symbolic links are resolved. Anything else is refused with one line naming the path: a manifest or index is
    never a way to read a file elsewhere on the machine (or to learn whether one exists)."""
    shown = json.dumps(rel)[:120] if isinstance(rel, str) else repr(rel)[:120]
    where = f"{what} {shown} in {root}"
    if not isinstance(rel, str) or not rel or len(rel) > 4096 or any(c in rel for c in "\\\0"):
        raise error(f"{where} is not a file name; it must name a file inside that directory")
    path = PurePosixPath(rel)
    if path.is_absolute() or ".." in path.parts or path.as_posix() != rel.rstrip("/") or rel.endswith("/"):
        raise error(f"{where} is not a plain relative path (absolute, '..', or not normalised); refusing to read "
                    "outside the directory: restore the original file")
    full = root / path
    try:
        escaped = not full.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise error(f"{where} cannot be resolved ({e}); restore the original file") from e
    if escaped:
        raise error(f"{where} is a symbolic link out of the directory; refusing to read it: replace the link with "
                    "the file itself")
    return full


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output. ``shape`` holds ints (static) and names (dynamic axes)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]
    optional: bool = False
    default: str | None = None  # how a missing optional input is filled: "ones" or "zeros"

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TensorSpec":
        return cls(d["name"], d["dtype"], tuple(d["shape"]), d.get("optional", False), d.get("default"))

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.optional:
            d["optional"] = True
            d["default"] = self.default
        return d


@dataclass(frozen=True)
class Manifest:
    root: Path
    data: dict[str, Any]

    @property
    def kind(self) -> str:
        return self.data["model"]["kind"]

    @property
    def max_sequence_length(self) -> int:
        return int(self.data["model"]["max_sequence_length"])

    @property
    def inputs(self) -> list[TensorSpec]:
        return [TensorSpec.from_json(d) for d in self.data["inputs"]]

    @property
    def outputs(self) -> list[TensorSpec]:
        return [TensorSpec.from_json(d) for d in self.data["outputs"]]

    def graph_path(self, name: str = "model") -> Path:
        return self.root / self.data["graphs"][name]

    @property
    def tokenizer(self) -> dict[str, Any] | None:
        return self.data.get("tokenizer")


def cache_shape(kv: dict[str, Any], name: str, batch: int, positions: int) -> tuple[int, int, int, int]:
    """(batch, kv heads, positions, features) of one KV-cache tensor: values may have fewer features than keys
    (``value_head_size``: multi-head latent attention), and layers may differ (``layer_shapes``: each past tensor's
    (kv heads, features), in the order of ``past``; a present tensor takes its past's)."""
    shapes = kv.get("layer_shapes")
    if shapes:
        names = kv["past"] if name in kv["past"] else kv["present"]
        heads, size = shapes[names.index(name)]
        return batch, int(heads), positions, int(size)
    size = kv.get("value_head_size", kv["head_size"]) if name.endswith(".value") else kv["head_size"]
    return batch, int(kv["num_kv_heads"]), positions, int(size)


def read_manifest(root: str | Path, verify_files: bool = True) -> Manifest:
    """Load ``manifest.json`` from an artifact directory and check it against the files beside it."""
    root = Path(root)
    path = root / MANIFEST
    if not root.is_dir():
        raise ArtifactError(f"artifact {root} does not exist or is not a directory; pass the directory `kiln compile -o` wrote")
    if not path.is_file():
        raise ArtifactError(f"artifact {root} has no {MANIFEST}; it is not a kiln artifact or its build did not finish, recompile it")
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise ArtifactError(f"{path} is {size} bytes, more than a manifest's {MAX_MANIFEST_BYTES >> 20} MiB; "
                            "recompile the artifact")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path} is not valid JSON ({e}); recompile the artifact") from e
    except RecursionError as e:
        raise ArtifactError(f"{path} nests its JSON too deeply to be a manifest; recompile the artifact") from e
    if not isinstance(data, dict):
        raise ArtifactError(f"{path} holds a JSON {type(data).__name__}, not an object; recompile the artifact")
    missing = [k for k in manifest_schema()["required"] if k not in data]  # before the version: a clearer line
    if missing:
        raise ArtifactError(f"{path} lacks {', '.join(missing)}; recompile the artifact with this kiln")
    version = data["schema_version"]
    if type(version) is not int or version != SCHEMA_VERSION:  # the string "1" is not version 1
        raise ArtifactError(
            f"{path} has schema_version {json.dumps(version)[:40]}, this kiln reads {SCHEMA_VERSION} (an integer); "
            "recompile the artifact or install the kiln release that wrote it"
        )
    problem = malformed(data)
    if problem:
        raise ArtifactError(f"{path} is malformed: {problem}; recompile the artifact")
    confine(root, data)
    if verify_files:
        verify_checksums(root, data["files"])
    return Manifest(root, data)


def named_files(data: dict[str, Any]) -> dict[str, Any]:
    """Every file the runtime reads by a name from the manifest, as where-it-is-named -> name."""
    out = {f"graphs.{k}": v for k, v in data["graphs"].items()}
    tok = data.get("tokenizer") or {}
    out |= {f"tokenizer.{k}": tok[k] for k in ("file", "chat_template") if tok.get(k) is not None}
    if data.get("canary"):
        out["canary.file"] = data["canary"]["file"]
    kernels = data.get("kernels") or {}
    out |= {f"kernels.fallback.{k}": v for k, v in (kernels.get("fallback") or {}).items()}
    return out


def confine(root: Path, data: dict[str, Any]) -> None:
    """Every path the manifest names lies inside the artifact, and every file the runtime reads by name is in
    ``files`` (so it is checksummed): a graph or template left out of ``files`` would be read unchecked."""
    if not data["files"]:
        raise ArtifactError(f"{root / MANIFEST} lists no files, so nothing it loads would be checksummed; recompile "
                            "the artifact")
    for rel in data["files"]:
        inside(root, rel, "files entry")
    for entry in root.iterdir():  # ONNX Runtime reads a graph's external data by the names inside the graph
        if entry.is_symlink():
            inside(root, entry.name, "symbolic link")
    for where, rel in named_files(data).items():
        inside(root, rel, where)
        if rel not in data["files"]:
            raise ArtifactError(f"{where} {json.dumps(rel)[:120]} in {root} is not in the manifest's files, so it "
                                "would be read without its checksum; recompile the artifact")


def malformed(data: dict[str, Any]) -> str | None:
    """The first structural problem of a manifest, or None: a damaged manifest is refused with one line at load
    instead of failing later deep inside a run. First the JSON Schema (``manifest.schema.json``: types, ranges,
    names), then the rules that relate one section to another, which a schema does not express."""
    problem = first_error(data)
    if problem:
        return problem
    kind = data["model"]["kind"]
    want = {"encoder", "decoder"} if kind == "seq2seq" else {"model"}
    if set(data["graphs"]) != want:
        return f"graphs {sorted(data['graphs'])} (a {kind} has {sorted(want)})"
    kv, gen = data.get("kv_cache"), data.get("generation")
    if kv is not None and len(kv["past"]) != len(kv["present"]):
        return f"kv_cache has {len(kv['past'])} past names but {len(kv['present'])} present names"
    shapes = (kv or {}).get("layer_shapes")
    if shapes is not None and (len(shapes) != len(kv["past"]) or any(len(x) != 2 for x in shapes)):
        return f"kv_cache.layer_shapes holds {len(shapes)} entries for {len(kv['past'])} past names (each [heads, size])"
    if kv is not None:
        if kv["capacity"] > data["model"]["max_sequence_length"]:
            return (f"kv_cache.capacity {kv['capacity']} exceeds model.max_sequence_length "
                    f"{data['model']['max_sequence_length']}")
        row = kv["capacity"] * sum(h * s for h, s in (cache_shape(kv, n, 1, 1)[1::2] for n in kv["past"])) * 4
        if row > MAX_ROW_CACHE_BYTES:  # bounded before a runtime allocates a slot of it
            return (f"kv_cache needs {row / 2 ** 30:.0f} GiB per sequence at its capacity, more than "
                    f"{MAX_ROW_CACHE_BYTES >> 30} GiB")
    if kind == "seq2seq" and (kv is None or "cross" not in kv or gen is None):
        return "an encoder-decoder needs kv_cache with cross names and generation"
    if kind == "seq2seq" and "decoder_start_token_id" not in gen:
        return "generation lacks decoder_start_token_id"
    return None


def verify_checksums(root: Path, files: dict[str, str]) -> None:
    for rel, expected in files.items():
        p = inside(root, rel, "files entry")
        if not p.is_file():
            raise ArtifactError(f"artifact file {p} is missing; the artifact is incomplete, recompile it")
        actual = sha256_file(p)
        if actual != expected:
            raise ArtifactError(
                f"artifact file {p} does not match its sha256 in {MANIFEST} (tampered with or corrupt); recompile the artifact"
            )
