"""Presentation: figures, the run, sweep, plan and validation reports, HTML and Markdown rendering and
terminal tables. Reads what experiments and runs wrote; may import reports.experiments, never the reverse."""
