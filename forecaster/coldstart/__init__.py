"""Cold-start latency: predict the seconds a new replica pays, per phase and in total.

``physics``: the bandwidth arithmetic (bytes / shared bandwidth + fixed start-up
phases), used as a prior feature and as the planner's fallback. ``model``: the
learned model (tree members per phase on features, a time-series member on
recent observed cold starts, pull/fetch rates from transfers), trained from the
``cold_starts`` and ``transfers`` tables or from simulator events. ``service``:
the one latency model of the running system (trained nightly, saved in the
registry, loaded per version by the plan job and the API). ``lambda_perf``: the
check on AWS Lambda's measured cold starts.
"""
