"""What the ranks did, drawn (plotly; nothing here runs in a rank).

plots.py     every figure parlab draws (timelines, shard diagrams) and the one palette they share
live.py      a live timeline: the figure redraws itself from the events ranks stream while they run
replay.py    a recorded run played back with play / pause / speed
widgets.py   `interact` for the lessons: ipywidgets' own, and notebooks that still execute headless
"""
