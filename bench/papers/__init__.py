"""The papers' defenses audited at their own settings: does each headline claim survive an
adaptive attacker?

``python -m bench.papers --docs papers`` runs every row of :data:`~bench.papers.rows.ROWS`
(one headline figure of CENSOR, SVDefense, the Bayes framework or Refiner) through the audit
engine and writes ``docs/papers.md``. Per row: the paper's setting (with its table or section), the
row's own, and one label, "at the paper's setting" (everything but the data set equal) or
"scaled: <what differs>"; then the paper's number, our run of the paper's own attack at the
paper's settings, the planner's attacks (``auto``, each at its own preset, in an audit of
its own) and the paper's named adaptive attack, each as mean PSNR / SSIM / LPIPS and
identification among K candidates with its exact 95% interval and the cell's chance; and a
conclusion by the rule of :mod:`bench.papers.verdict`.

Profiles (``--profile``): ``cpu`` (default) runs what a CPU reaches at the paper's setting
(ResNet-18 at width 8, ATS and Refiner on fewer images); ``gpu`` the rest at the papers'
settings, in slices that each fit one GPU call (below); ``quick`` (2 images, tiny budgets,
never writes docs) checks the plumbing.

Every finished cell is kept in ``bench/papers_results/<profile>-<data>/<row>.json`` with the
key of the audit call that made it: the page renders from these files, a rerun skips stored
keys, and a changed row setting reruns only that row's cells.
A cell runs in slices (:func:`~bench.papers.slices.cell_slices`) whose results stay in
``<row>.partial/`` until it finishes, so it resumes from a fresh clone. ``--render`` writes the
page from the stored cells.

A lent GPU call runs the gpu profile slice by slice: :data:`~bench.papers.gpu.GPU_CALL` (also
``--help``).
"""
