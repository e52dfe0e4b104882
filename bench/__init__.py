"""Benchmarks, run on purpose from the repository root: ``python -m bench.<script>``.

Every bench process keeps freed heap memory as the CLI does (:mod:`audit.core.allocator`),
so its timings, ours and a peer's in the same process alike, are those a user sees."""
from audit.core.allocator import keep_freed_memory

keep_freed_memory()
