"""Routing analysis: closed-form calc, router-pick traces, skew and balance metrics, EPLB, plots."""
