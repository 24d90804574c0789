"""`make bench` / `python -m bench [section ...]`: poddaemon numbers beside same-run baselines."""
