"""The artifact's own acceptance test, re-run wherever it is loaded.

At compile time kiln records a few inputs per entry point with the reference model's outputs (the eager model; an
INT4 artifact: the eager model with the quantized weights' values, what its kernels must compute) and, per entry, the
error the verified artifact had against them on the machine that compiled it. Entries:

- ``batch``: graphs run whole (encoders, classifiers): one batch of rows through ``Model.run``;
- ``decode_1``: a decoder's batch-1 path: the prompt's prefill, then teacher-forced decode steps of one row (every
  quantized MatMul at M = 1, the path an edge app and ``kiln generate`` take);
- ``decode_rows``: the same prompt left-padded among rows of other lengths, decoded together (M > 1);
- ``rows``: the prompt's logits in ``decode_rows`` against ``decode_1`` (no reference: one row must not depend on
  how many run beside it), to the artifact's exact bound.

An entry passes when its error (the largest ``max |out - ref| / max(1, max |ref|)`` over its rows and steps) is within
its bound, and, for a quantized artifact, its smallest row cosine (logit rows centred) keeps its floor: four times the
compile machine's cosine deficit, never looser than the precision's own bound. The error bound is four times the compile machine's own error, and never under the precision's float-rounding floor. Another
kernel path, ISA, ONNX Runtime build or thread count moves the error by rounding; a kernel that computes another
answer (a wrong M = 1 path, a damaged weight) moves it by the size of the answer.
"""

from __future__ import annotations

import platform
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.errors import ArtifactError, KilnError
from kiln.runtimes.generation import Prompt, RowRunner, runs_rows, unpadded

CANARY = "canary.npz"
MAX_BYTES = 64 << 20
"""A canary file larger than this is refused before it is read (a recorded one holds a few logit rows)."""
MAX_ROWS, MAX_STEPS = 8, 32
ENTRIES = ("batch", "decode_1", "decode_rows", "rows")
KINDS = ("batch", "decode", "seq2seq", "rows")
"""How an entry runs: ``Model.run``; a decoder's prefill and forced steps; an encoder-decoder's forced steps; the
comparison of two entries' shared row."""


class CanaryError(ArtifactError):
    """The artifact computes another answer on this machine than the one it was verified to give."""


def isa() -> str:
    """The widest x86 / Arm vector ISA this process may use (CPUID as the OS enables it, which numpy reads: AVX-512
    listed but not enabled in XCR0 is not counted), e.g. ``avx512-vnni``, ``avx2``, ``neon``."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as f  # type: ignore[import-not-found]
    except ImportError:  # numpy 1.x
        from numpy.core._multiarray_umath import __cpu_features__ as f  # type: ignore[no-redef]
    for name, tag in (("AMX_TILE", "amx"), ("AVX512VNNI", "avx512-vnni"), ("AVX512F", "avx512"),
                      ("AVX512_SPR", "avx512"), ("AVXVNNI", "avx2-vnni"), ("AVX2", "avx2"), ("AVX", "avx"),
                      ("SVE", "sve"), ("ASIMDDP", "neon-dotprod"), ("ASIMD", "neon"), ("NEON", "neon")):
        if f.get(name):
            return tag
    return platform.machine() or "unknown"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("model name", "Model name")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(backend: str, threads: int | None = None) -> str:
    """CPU, ISA, backend and its version (and the GPU's compute capability for a GPU backend): what a canary result
    holds for."""
    version = ""
    if backend.startswith("onnxruntime"):
        import onnxruntime as ort

        version = f" {ort.__version__}"
    if backend in ("tensorrt", "onnxruntime-cuda", "onnxruntime-tensorrt"):
        from kiln.runtimes.cuda import compute_capability

        version += f" on a GPU of compute capability {compute_capability() or 'unknown'}"
    return f"{cpu_name()} ({isa()}), {backend}{version}, threads {threads or 'default'}"


def error(out: np.ndarray, ref: np.ndarray) -> float:
    """Largest ``max |out - ref| / max(1, max |ref|)`` over the leading axes' rows (the last axis is one row)."""
    out = np.asarray(out, np.float64).reshape(-1, ref.shape[-1])
    r = np.asarray(ref, np.float64).reshape(-1, ref.shape[-1])
    if out.shape != r.shape:
        raise CanaryError(f"output of shape {out.shape} against a reference of {r.shape}")
    scale = np.maximum(1.0, np.abs(r).max(1))
    return float((np.abs(out - r).max(1) / scale).max()) if r.size else 0.0


def rows_error(one: np.ndarray, many: np.ndarray) -> float:
    """The shared row (row 0) decoded beside others (``many``) against alone (``one``), over the steps both ran."""
    steps = min(len(one), len(many))
    return error(many[:steps, :1], one[:steps, :1])


def forced_steps(model: Any, ids: np.ndarray, mask: np.ndarray, tokens: np.ndarray) -> Iterator[np.ndarray]:
    """A decoder fed a left-padded prompt, then the given tokens one step at a time (teacher forcing), through its KV
    cache or, without one, recomputation: the last position's logits (rows, vocab) of the prefill and of each step."""
    data = model.manifest.data
    kv = data.get("kv_cache")
    rows = ids.shape[0]
    if runs_rows(model.runtime, data):  # as Model.generate runs it
        yield from forced_rows(model, Prompt(ids, mask), tokens)
        return
    runner = model.runtime.cache_runner(kv, rows, ids.shape[1] + tokens.shape[1]) if kv else \
        model.runtime.recompute_runner(rows, (data.get("generation") or {}).get("logits_to_keep"))
    try:
        yield runner.step(ids, mask)[:, -1]
        for t in range(tokens.shape[1]):
            mask = np.concatenate([mask, np.ones((rows, 1), np.int64)], 1)
            yield runner.step(tokens[:, t:t + 1], mask)[:, -1]
    finally:
        runner.close()


def forced_rows(model: Any, prompt: Prompt, tokens: np.ndarray) -> Iterator[np.ndarray]:
    """``forced_steps`` with a row of the cache per prompt, each at its own length (``generation.RowRunner``, the
    path ``Model.generate`` and continuous batching run). A lone prompt decodes at one row (M = 1), whatever this
    machine's ``generation.row_policy``: the one-row path is what ``decode_1`` checks. The prompts share one prefill
    (each row attending to its own tokens): a graph run streams every weight, and the canary's cost is its runs."""
    runner = RowRunner(model.runtime, model.manifest.data["kv_cache"], unpadded(prompt), tokens.shape[1] + 1)
    try:
        yield runner.first()
        for t in range(tokens.shape[1]):
            yield runner.step(tokens[:, t])
    finally:
        runner.close()


def forced_seq2seq(model: Any, ids: np.ndarray, mask: np.ndarray, tokens: np.ndarray) -> Iterator[np.ndarray]:
    """An encoder-decoder: the source encoded once, then ``tokens`` (starting with the decoder's start token) fed one
    step at a time; each step's logits (rows, vocab)."""
    runner = model.seq2seq_runner(ids, mask)
    try:
        for t in range(tokens.shape[1]):
            yield runner.step(tokens[:, t:t + 1])[:, -1]
    finally:
        runner.close()


def outputs(model: Any, kind: str, arrays: dict[str, np.ndarray]) -> np.ndarray | dict[str, np.ndarray]:
    """Run one entry on ``model``: a dict of graph outputs (``batch``) or stacked step logits (steps, rows, vocab)."""
    if kind == "batch":
        feeds = {k[len("in."):]: v for k, v in arrays.items() if k.startswith("in.")}
        return model.run(feeds)
    steps = forced_seq2seq if kind == "seq2seq" else forced_steps
    return np.stack(list(steps(model, arrays["ids"], arrays["mask"], arrays["tokens"])))


def cosine(out: np.ndarray, ref: np.ndarray, centred: bool) -> float:
    """The smallest cosine similarity between rows (the last axis), each row centred first for logits (a constant
    shift leaves the softmax unchanged); 1.0 for a zero row pair."""
    a = np.asarray(out, np.float64).reshape(-1, ref.shape[-1])
    b = np.asarray(ref, np.float64).reshape(-1, ref.shape[-1])
    if centred:
        a, b = a - a.mean(1, keepdims=True), b - b.mean(1, keepdims=True)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    cos = np.where(norms > 0, (a * b).sum(1) / np.where(norms > 0, norms, 1.0), 1.0)
    return float(cos.min()) if cos.size else 1.0


def pairs(kind: str, got: np.ndarray | dict[str, np.ndarray],
          arrays: dict[str, np.ndarray]) -> list[tuple[np.ndarray, np.ndarray, bool]]:
    """(output, reference, is logits) per compared tensor of an entry."""
    if kind == "batch":
        assert isinstance(got, dict)
        refs = {k[len("out."):]: v for k, v in arrays.items() if k.startswith("out.")}
        missing = sorted(set(refs) - set(got))
        if missing:
            raise CanaryError(f"the graph gives no output {missing[0]}")
        return [(got[k], v, k == "logits") for k, v in refs.items()]
    assert isinstance(got, np.ndarray)
    return [(got, arrays["logits"], True)]


def entry_error(kind: str, got: np.ndarray | dict[str, np.ndarray], arrays: dict[str, np.ndarray]) -> tuple[float, float]:
    """(error, smallest row cosine) of an entry's outputs against its references."""
    compared = pairs(kind, got, arrays)
    return max(error(o, r) for o, r, _ in compared), min(cosine(o, r, lg) for o, r, lg in compared)


@dataclass
class Result:
    """What ``check`` found: per entry its error, bound and verdict, and where it ran."""

    machine: str
    entries: list[dict[str, Any]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(e["passed"] for e in self.entries)

    @property
    def refused(self) -> bool:
        """An entry other than ``rows`` failed: the artifact computes another answer here. ``rows`` alone failing is
        answered by decoding at least two rows (``generation.row_policy``), which every other entry covers."""
        return any(not e["passed"] for e in self.entries if e["name"] != "rows")

    @property
    def rows_agree(self) -> bool | None:
        """Whether one decoder row computes the same alone as beside others here (None: not checked)."""
        rows = next((e for e in self.entries if e["name"] == "rows"), None)
        return None if rows is None else bool(rows["passed"])

    def to_json(self) -> dict[str, Any]:
        return {"machine": self.machine, "passed": self.passed, "entries": self.entries}


def npz_bytes(path: Any) -> int:
    """The bytes the arrays of an ``.npz`` take once loaded, from each member's ``.npy`` header (shape and dtype),
    read without loading any array."""
    total = 0
    with zipfile.ZipFile(path) as z:
        for info in z.infolist()[:4096]:
            with z.open(info) as member:
                version = np.lib.format.read_magic(member)
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                shape, _, dtype = read_header(member)
                total += int(np.prod(shape, dtype=object)) * dtype.itemsize
        if len(z.infolist()) > 4096:
            raise ValueError(f"{len(z.infolist())} members")
    return total


def read(model: Any) -> dict[str, dict[str, np.ndarray]] | None:
    """The canary's arrays per entry (None: the artifact carries none), bounded and checked before use."""
    spec = model.manifest.data.get("canary")
    if not spec:
        return None
    path = model.manifest.root / spec["file"]
    if not path.is_file():
        raise ArtifactError(f"artifact {model.manifest.root} lists canary {spec['file']} but has no such file; recompile it")
    if path.stat().st_size > MAX_BYTES:
        raise ArtifactError(f"canary {path} is {path.stat().st_size} bytes, over {MAX_BYTES}; recompile the artifact")
    try:
        unpacked = npz_bytes(path)
        if unpacked > MAX_BYTES:  # a compressed member may claim any shape: bounded before numpy allocates it
            raise ArtifactError(f"canary {path} unpacks to {unpacked} bytes, over {MAX_BYTES}; recompile the artifact")
        with np.load(path, allow_pickle=False) as f:
            flat = {k: f[k] for k in f.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:  # not an npz, or an object array
        raise ArtifactError(f"canary {path} is unreadable ({e}); recompile the artifact") from e
    grouped: dict[str, dict[str, np.ndarray]] = {}
    for key, value in flat.items():
        entry, _, name = key.partition("/")
        grouped.setdefault(entry, {})[name] = value
    for entry in spec["entries"]:
        if entry["kind"] != "rows":
            problem = malformed(entry["kind"], grouped.get(entry["name"], {}))
            if problem:
                raise ArtifactError(f"canary {path} entry {entry['name']}: {problem}; recompile the artifact")
    return grouped


def malformed(kind: str, a: dict[str, np.ndarray]) -> str | None:
    if kind == "batch":
        if not any(k.startswith("in.") for k in a) or not any(k.startswith("out.") for k in a):
            return "no inputs or no reference outputs"
        return None
    want = {"ids": "iu", "mask": "iu", "tokens": "iu", "logits": "f"}
    for name, kinds in want.items():
        if name not in a or a[name].dtype.kind not in kinds:
            return f"{name} missing or not {'integer' if kinds == 'iu' else 'float'}"
    ids, mask, tokens, logits = (a[k] for k in want)
    if ids.ndim != 2 or mask.shape != ids.shape or tokens.ndim != 2 or tokens.shape[0] != ids.shape[0]:
        return f"ids {ids.shape}, mask {mask.shape}, tokens {tokens.shape} do not fit together"
    if not 0 < ids.shape[0] <= MAX_ROWS or tokens.shape[1] > MAX_STEPS:
        return f"{ids.shape[0]} rows and {tokens.shape[1]} steps (at most {MAX_ROWS} and {MAX_STEPS})"
    steps = tokens.shape[1] + (0 if kind == "seq2seq" else 1)
    if logits.ndim != 3 or logits.shape[:2] != (steps, ids.shape[0]):
        return f"logits {logits.shape} for {steps} steps of {ids.shape[0]} rows"
    return None


def check(model: Any, threads: int | None = None) -> Result | None:
    """Run the artifact's canary on ``model`` as loaded (its backend, this machine). None: it carries no canary."""
    grouped = read(model)
    if grouped is None:
        return None
    spec = model.manifest.data["canary"]
    ran = model.backend.get("kernels")
    result = Result(machine_line(model.backend["name"], threads) + (f", low-bit kernels {ran['ran']}" if ran else ""))
    got: dict[str, Any] = {}
    for entry in spec["entries"]:
        name, kind = entry["name"], entry["kind"]
        try:
            cos = 1.0
            if kind == "rows":  # the shared prompt is row 0 of decode_rows: its steps against decode_1's
                err = rows_error(got[entry["of"][0]], got[entry["of"][1]])
            else:
                got[name] = outputs(model, kind, grouped[name])
                err, cos = entry_error(kind, got[name], grouped[name])
        except KilnError as e:
            result.entries.append({"name": name, "error": None, "bound": entry["bound"], "passed": False,
                                   "failed": str(e)})
            continue
        except KeyError as e:  # a rows entry naming an entry that did not run
            result.entries.append({"name": name, "error": None, "bound": entry["bound"], "passed": False,
                                   "failed": f"needs entry {e}"})
            continue
        least = entry.get("min_cosine")
        ok = err <= entry["bound"] and (least is None or cos >= least)
        result.entries.append({"name": name, "error": err, "bound": entry["bound"], "passed": bool(ok),
                               "compiled": entry.get("measured"), **({"cosine": cos, "min_cosine": least}
                                                                      if least is not None else {})})
    return result


def refusal(model: Any, result: Result) -> CanaryError:
    """One line: the artifact, this machine, the first failing entry point and its error, and what to do."""
    bad = next(e for e in result.entries if not e["passed"] and e["name"] != "rows")
    low = bad.get("min_cosine") is not None and bad["error"] is not None and bad["error"] <= bad["bound"]
    what = bad.get("failed") or (f"row cosine {bad['cosine']:.4f} < {bad['min_cosine']:.4f}" if low else None) or \
        (f"error {bad['error']:.3g} > bound {bad['bound']:.3g} (it was "
                                 f"{bad.get('compiled') if bad.get('compiled') is not None else 'not measured'} where "
                                 "it was compiled)")
    return CanaryError(f"artifact {model.manifest.root} computes another answer on this machine ({result.machine}): "
                       f"canary entry {bad['name']}: {what}; run `kiln check {model.manifest.root}` for every entry, "
                       "recompile on this machine or another backend, or load with check=False to run it unchecked")
