"""Exception types shared by the compiler and the runtimes.

Every error names the input at fault and the fix, in one line: the CLI prints ``str(error)``
and exits with :attr:`KilnError.exit_code`.
"""

from __future__ import annotations


class KilnError(Exception):
    """Base class of every error kiln raises on purpose."""

    exit_code = 1


class UsageError(KilnError):
    """The command line or API call itself is wrong (exit code 2)."""

    exit_code = 2


class CheckpointError(KilnError):
    """The checkpoint is missing, incomplete or corrupt."""


class UnsupportedModelError(KilnError):
    """The architecture or task is not one kiln can compile."""


class ExportError(KilnError):
    """Tracing the model to ONNX failed."""


class ParityError(KilnError):
    """The compiled artifact does not match the eager model within tolerance."""


class ArtifactError(KilnError):
    """An artifact directory is missing, incomplete, tampered with or of an unknown schema."""


class GraphRunError(ArtifactError):
    """ONNX Runtime failed inside a graph that loaded and took its feeds: a node met a shape it cannot take."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail
        """ONNX Runtime's own words, one line."""
        self.at: str | None = None
        """The verification case that ran into it (set by the compiler's verification)."""


class InputError(KilnError):
    """Feeds given to a runtime do not match the artifact's inputs."""


class ClosedError(KilnError):
    """A loaded model was used after (or while) ``close()`` released it."""


class OutputError(KilnError):
    """Writing the artifact failed (a full disk, a read-only filesystem): nothing was written."""
