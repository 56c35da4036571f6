"""Deployment planning (``quantize plan``): how many GPUs, which variant, which engine, co-located or
disaggregated, against TTFT and TPOT targets (docs/plan.md)."""
