"""The trace-driven fleet simulator, its policies, the minute-level protocol, and the model/image catalogue.

``workload`` (traces -> request times), ``engine`` (the simulator), ``policies``
(keep-alive, hybrid histogram, Knative-style reactive, the planner), ``minute``
(EVALUATION.md section 2), ``catalog`` (real open models and serving images),
``config`` (fleet and phase defaults with their sources), ``runner`` (wiring
shared by ``prewarm simulate`` and ``bench/policies.py``).
"""
