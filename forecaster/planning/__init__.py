"""Planning: forecasts + predicted cold-start latencies + fleet state -> a plan of pre-warm actions.

``plan`` (the Action/Plan/Reason contract shared with the actuator),
``forecasts`` (the forecast input protocol, an oracle and a causal source),
``fleet`` (the fleet snapshot, latency table and cost settings the planner
reads), ``planner`` (the pure planning function), ``recommendation`` (replica
recommendations for reactive autoscalers).
"""
