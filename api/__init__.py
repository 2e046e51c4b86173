"""HTTP surfaces of prewarm (REST API for autoscalers, dashboard); they import forecaster, never the reverse."""
