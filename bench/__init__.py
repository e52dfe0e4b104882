"""Benchmarks, run on purpose from the repository root: ``python -m bench.<script>``."""
