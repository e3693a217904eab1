"""Graph passes: ONNX model in, ONNX model out, each reporting what it changed and what it skipped.

Passes never import the compiler or a runtime; calibration data and options are handed to them.
"""

from kiln.passes.base import NoMatch, Pass, PassError, PassResult, Reason, check_disabled, run_passes

__all__ = ["NoMatch", "Pass", "PassError", "PassResult", "Reason", "check_disabled", "run_passes"]
