"""The live dashboard as a Panel app: ``panel serve dashboards/live.py --args RUN_DIR``.

The same app is served by ``hybridlab dashboard RUN_DIR`` and shown inline by
``RLSession.dashboard()``. Given a folder of runs instead, it serves the runs page. Its run
controls (pause, resume, stop, the workers' stacks) show for a browser on this machine or a logged-in user;
serve it elsewhere with Panel's own login (``--basic-auth``, ``--oauth-provider``).
"""
import sys

from hybridlab.telemetry.dashboard import build_dashboard
from hybridlab.telemetry.runs import build_runs_page
from hybridlab.telemetry.serving import control_allowed, is_runs_root

if len(sys.argv) < 2:
    raise SystemExit("usage: panel serve dashboards/live.py --args RUN_DIR_OR_RUNS_ROOT")
if is_runs_root(sys.argv[1]):
    build_runs_page(sys.argv[1], template=True).servable(title="hybridlab runs")
else:
    build_dashboard(sys.argv[1], control=control_allowed(), template=True).servable(title="hybridlab live")
