"""Verification: the inputs (``cases``), parity and latency between two runners (``parity``), the
KV-cache generation check (``generation``) and the metrics every consumer shares (``metrics``)."""
