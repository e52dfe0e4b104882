"""The papers' defenses audited at their own settings: does each headline claim survive an
adaptive attacker?

``python -m bench.papers --docs papers`` runs every row of :data:`~bench.papers.rows.ROWS` (a
headline figure of CENSOR, SVDefense, the Bayes framework or Refiner) through the audit engine
and writes ``docs/papers.md``: per row the paper's setting and ours, labelled "at the paper's
setting" or "scaled: <what differs>"; the paper's number; the paper's own attack, the planner's
attacks at their presets and the paper's adaptive attack, each as PSNR / SSIM / LPIPS and
identification among K candidates with its 95% interval and chance; and a conclusion by the
rules of :mod:`bench.papers.verdict`.

Profiles (``--profile``): ``cpu`` (default) runs what a CPU reaches (ResNet-18 at width 8, ATS
and Refiner on fewer images); ``gpu`` the papers' settings, in slices that each fit one GPU call
(:mod:`bench.papers.gpu`); ``quick`` (2 images, tiny budgets, never writes docs) checks the
plumbing.

Every finished cell is kept in ``bench/results/papers/results.jsonl`` (the row's line, keyed
``<profile>-<data>/<row>``) with the key of the audit call that made it: the page renders from
that store, a rerun skips stored keys, and a changed row setting reruns only that row's cells. A
cell runs in slices (:func:`~bench.papers.slices.cell_slices`) kept in
``<profile>-<data>/<row>.partial/`` until it finishes, so it resumes from a fresh clone.
``--render`` writes the page from the stored cells alone.
"""
