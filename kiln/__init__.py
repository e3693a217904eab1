"""kiln: turn a trained Transformer into a fast, verified deployment artifact.

Importing ``kiln`` or ``kiln.runtimes`` never imports torch; ``kiln.compiler`` needs the
``compile`` extra.
"""

__version__ = "0.1.0"
