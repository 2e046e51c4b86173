"""``prewarm report``: the operator's stored history replayed through the fleet simulator, as one HTML file.

:mod:`.history` reads the store (counts, catalogue, nodes) for a window; :mod:`.replay` replays it under prewarm
(the product's default forecaster and planner), the reactive autoscaler and a fixed keep-alive; :mod:`.html`
writes the self-contained page. See ``docs/report.md``.
"""
