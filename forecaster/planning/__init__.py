"""Planning: forecasts + predicted cold-start latencies + fleet state -> a plan of pre-warm actions."""
