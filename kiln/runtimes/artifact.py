"""Reading an artifact directory: the manifest, its schema version and the file checksums.

The writer lives in ``kiln.compiler.manifest``; both agree on the names defined here.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import ArtifactError

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
REPORT = "report.json"


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


_REQUIRED_KEYS = ("schema_version", "model", "inputs", "outputs", "graphs", "precision", "passes", "files")


def read_manifest(root: str | Path, verify_files: bool = True) -> Manifest:
    """Load ``manifest.json`` from an artifact directory and check it against the files beside it."""
    root = Path(root)
    path = root / MANIFEST
    if not root.is_dir():
        raise ArtifactError(f"artifact {root} does not exist or is not a directory; pass the directory `kiln compile -o` wrote")
    if not path.is_file():
        raise ArtifactError(f"artifact {root} has no {MANIFEST}; it is not a kiln artifact or its build did not finish, recompile it")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path} is not valid JSON ({e}); recompile the artifact") from e
    missing = [k for k in _REQUIRED_KEYS if k not in data]
    if missing:
        raise ArtifactError(f"{path} lacks {', '.join(missing)}; recompile the artifact with this kiln")
    version = data["schema_version"]
    if version != SCHEMA_VERSION:
        raise ArtifactError(
            f"{path} has schema_version {version}, this kiln reads {SCHEMA_VERSION}; "
            "recompile the artifact or install the kiln release that wrote it"
        )
    problem = malformed(data)
    if problem:
        raise ArtifactError(f"{path} is malformed: {problem}; recompile the artifact")
    if verify_files:
        verify_checksums(root, data["files"])
    return Manifest(root, data)


_DTYPES = ("int64", "int32", "float32", "float16", "bool")
_DEFAULTS = (None, "ones", "zeros", "empty")


def _is_int(v: Any, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _tensor_problem(where: str, t: Any) -> str | None:
    if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
        return f"{where} is not a tensor with a name"
    if t.get("dtype") not in _DTYPES:
        return f"{where} {t['name']} has dtype {t.get('dtype')!r}"
    shape = t.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d, 1) or (isinstance(d, str) and d) for d in shape):
        return f"{where} {t['name']} has shape {shape!r}"
    if not isinstance(t.get("optional", False), bool) or t.get("default") not in _DEFAULTS:
        return f"{where} {t['name']} has optional/default {t.get('optional')!r}/{t.get('default')!r}"
    return None


def malformed(data: dict[str, Any]) -> str | None:
    """The first structural problem of a manifest (the sections the runtime reads), or None: a damaged manifest
    is refused with one line at load instead of failing later deep inside a run."""
    m = data.get("model")
    if not isinstance(m, dict) or m.get("kind") not in ("encoder", "decoder", "seq2seq") or \
            not isinstance(m.get("task"), str) or not _is_int(m.get("max_sequence_length"), 1):
        return "model needs kind (encoder/decoder/seq2seq), task and max_sequence_length"
    if m.get("vocab_size") is not None and not _is_int(m["vocab_size"], 1):
        return f"model.vocab_size {m['vocab_size']!r}"
    for section in ("inputs", "outputs"):
        if not isinstance(data[section], list) or not data[section]:
            return f"{section} is not a non-empty list"
        for t in data[section]:
            problem = _tensor_problem(section[:-1], t)
            if problem:
                return problem
    graphs = data["graphs"]
    want = {"encoder", "decoder"} if m["kind"] == "seq2seq" else {"model"}
    if not isinstance(graphs, dict) or set(graphs) != want or not all(
            isinstance(v, str) and v and "/" not in v and "\\" not in v for v in graphs.values()):
        return f"graphs {graphs!r} (expected {sorted(want)} -> file names)"
    files = data["files"]
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        return "files is not a {path: sha256} table"
    tok = data.get("tokenizer")
    if tok is not None and (not isinstance(tok, dict) or not isinstance(tok.get("file"), str)):
        return "tokenizer has no file"
    if tok is not None and not all(tok.get(k) is None or _is_int(tok[k]) for k in ("pad_token_id", "eos_token_id",
                                                                                   "bos_token_id")):
        return "tokenizer token ids are not integers"
    if tok is not None and tok.get("chat_template") is not None and not isinstance(tok["chat_template"], str):
        return "tokenizer.chat_template is not a file name"
    kv = data.get("kv_cache")
    if kv is not None:
        if not isinstance(kv, dict) or not all(_is_int(kv.get(k), 1)
                                               for k in ("num_kv_heads", "head_size", "capacity")):
            return "kv_cache needs num_kv_heads, head_size and capacity"
        names = [kv.get("past"), kv.get("present")] + ([kv["cross"]] if "cross" in kv else [])
        if not all(isinstance(n, list) and all(isinstance(x, str) for x in n) for n in names) or \
                len(kv["past"]) != len(kv["present"]):
            return "kv_cache past/present are not matching lists of names"
        if kv.get("logits_to_keep") is not None and not isinstance(kv["logits_to_keep"], str):
            return "kv_cache.logits_to_keep is not an input name"
    gen = data.get("generation")
    if gen is not None:
        if not isinstance(gen, dict) or not isinstance(gen.get("eos_token_ids", []), list) or \
                not all(_is_int(e) for e in gen.get("eos_token_ids", [])) or not _is_int(gen.get("pad_token_id", 0)):
            return "generation needs integer eos_token_ids and pad_token_id"
        if m["kind"] == "seq2seq" and not _is_int(gen.get("decoder_start_token_id")):
            return "generation.decoder_start_token_id is not an integer"
    if m["kind"] == "seq2seq" and (kv is None or "cross" not in kv or gen is None):
        return "an encoder-decoder needs kv_cache with cross names and generation"
    return None


def verify_checksums(root: Path, files: dict[str, str]) -> None:
    for rel, expected in files.items():
        p = root / rel
        if not p.is_file():
            raise ArtifactError(f"artifact file {p} is missing; the artifact is incomplete, recompile it")
        actual = sha256_file(p)
        if actual != expected:
            raise ArtifactError(
                f"artifact file {p} does not match its sha256 in {MANIFEST} (tampered with or corrupt); recompile the artifact"
            )
