"""Cold-start latency: predict the seconds a new replica pays, per phase and in total.

``physics``: the bandwidth arithmetic (bytes / shared bandwidth + fixed start-up
phases), used as a prior feature and as the planner's fallback. ``model``: the
learned model (tree members per phase on features, a time-series member on
recent observed cold starts), trained from the ``cold_starts`` table or from
simulator events. ``lambda_perf``: the check on AWS Lambda's measured cold starts.
"""
