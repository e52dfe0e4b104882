"""``python -m bench.papers``: the papers bench's command line (:mod:`bench.papers.cli`)."""
from bench.papers.cli import main

main()
