"""``raygym report RUN_DIR [RUN_DIR ...]``: one self-contained HTML file comparing runs.

No server and no CDN: the data, the styles and the script that draws the charts are inlined in the
file. Sections: the runs, their config differences, curves (reward, eval reward and pass@k, KL,
entropy, clip fraction, grad norm, response length, phase timings, weight-sync bytes and seconds) and
a browser of sampled traces (training traces from ``capture_trace`` and ``raygym eval`` samples).

>>> from raygym.report import write_report                       # doctest: +SKIP
>>> write_report(["runs/a", "runs/b"], "report.html")           # doctest: +SKIP
'report.html'
"""

from __future__ import annotations

from raygym.report.build import build_report, watch_report, write_report

__all__ = ["build_report", "watch_report", "write_report"]
