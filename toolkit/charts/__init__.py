"""Pictures of runs and plans (matplotlib), each written as a PNG and as a self-contained
HTML page that carries the plotted numbers beside the figure. Nothing here is imported by
the planning commands unless a chart is asked for (matplotlib takes ~0.5 s to import)."""
from .page import Table, chart_paths, write_chart
from .plans import plan_chart
from .runs import RunMetrics, read_run, runs_chart

__all__ = ["RunMetrics", "Table", "chart_paths", "plan_chart", "read_run", "runs_chart", "write_chart"]
