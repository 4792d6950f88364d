"""Runs: a job from its config, baseline and steered generation, extraction, select, metrics, sweeps and reports."""
