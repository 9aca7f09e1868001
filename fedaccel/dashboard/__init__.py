"""``fedaccel-dashboard``: watch runs live, compare them and launch new ones
from a browser (docs/dashboard.md).

Modules: :mod:`.runs` reads run folders, :mod:`.schema` builds and checks the
launch form, :mod:`.launcher` starts and stops runs, :mod:`.flower_runs`
lists runs of a SuperLink, :mod:`.app` is the web app and :mod:`.cli` the
command.
"""
