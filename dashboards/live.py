"""The live dashboard as a Panel app: ``panel serve dashboards/live.py --args RUN_DIR``.

The same app is served by ``hybridlab dashboard RUN_DIR`` and shown inline by
``RLSession.dashboard()``; it is read-only (nothing on the page can change the run).
"""
import sys

from hybridlab.telemetry.dashboard import build_dashboard

if len(sys.argv) < 2:
    raise SystemExit("usage: panel serve dashboards/live.py --args RUN_DIR")
build_dashboard(sys.argv[1]).servable(title="hybridlab live")
