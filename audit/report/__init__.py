"""Results and what is made of them: the result store, the risk verdicts, and the report
(JSON, Markdown, self-contained HTML, plots, image grids). Imports only ``audit.core``."""

from audit.report import plan_reasons  # noqa: F401,E402  (registers the words for why each attack runs)
