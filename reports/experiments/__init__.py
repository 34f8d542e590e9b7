"""Experiments: sweep and plan files, the process pool, running sweeps and plans, capacity search and the
analysis of their results. Imports nothing from reports.presentation."""
