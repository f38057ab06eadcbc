"""The benchmark harness (issue 3): one method for every kernel, reported against the read roofline.

Layers, bottom up:

``timing``    cold-L2 CUDA-graph timing: weight copies exceeding 8 x L2, one graph call per copy, median of
              >= 15 replays / calls (events around a loop if capture fails).
``ceiling``   the read ceiling: ``x.sum()`` over 2 GiB, timed the same way.
``registry``  kbit kernels by name (``@register("name")`` on a factory ``(qw, M) -> call``); nothing else.
``candidates`` the built-in kbit kernels, registered on import.
``weights``   kbit's quantize / dequantize for the harness, stand-in weights, copies, bytes read.
``peers``     humming, tinygemm, bitsandbytes, gemlite adapters (skipped, with the reason, when missing).
``moe``       routing for the grouped benchmarks and the bf16 ``torch._grouped_mm`` baseline.
``run``       the driver (``BenchConfig`` -> header and rows); imports ``candidates``.
``report``    the JSON row schema, ``benchmarks/results/<gpu>/<name>-<date>.json``, the markdown table.
``cli``       ``kbit bench`` (and ``kbit bench --table FILE`` to render a results file).
``suite``     the model-shape suite (``suites/models.json``: published configs -> layer shapes, tune / held-out).
``summary``   a suite run's per-family summary (vs humming, vs bf16, per M), CSV and plot.
``tune``      ``kbit tune``: config search per (GPU, k, N, K, M bucket) into ``kbit.tuning.tuned`` tables.
``step_trace`` a decode step's profiler trace -> kernels in order, each named by its module, gaps, bytes, totals.
``step_profile`` one decode step profiled (module ranges, bytes each must read, graph replay) -> ``step_trace``.
``step_report`` the step profile as a table, a kernel listing, JSON and a timeline plot.
"""
