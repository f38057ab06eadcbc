"""``kbit analyze``: the workload report (tables + plots) from committed benchmark results."""
