"""Results and what is made of them: the result store, the risk verdicts, and the report
(JSON, Markdown, self-contained HTML, plots, image grids). Imports only ``audit.core``."""
