"""``python -m audit.integrations.flower ROUND_DIR``: the background audit of one round
(:func:`audit.integrations.flower.worker.main`)."""
from audit.integrations.flower.worker import main

main()
