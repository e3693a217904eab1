"""What a release pipeline calls: ``bench`` (latency and throughput), ``report`` (accuracy against the
reference checkpoint, rendered by ``render``) and ``gate`` (thresholds -> exit code)."""
