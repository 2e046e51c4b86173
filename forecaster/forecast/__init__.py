"""Demand forecasting: members, ensemble with calibrated quantiles, and the rolling-origin backtest.

Pure code on long frames ``unique_id, ds, y``; no database access here.
"""
