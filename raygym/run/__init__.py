"""One training run: the driver, the Ray graph, the loop (schedules as classes), preflight checks, what a run
prints, its metrics, auxiliary model groups and offline evaluation.
"""
