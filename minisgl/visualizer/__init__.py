"""The scheduler visualizer (stage 6): reads only `Scheduler.snapshot()` dicts (docs/snapshot.md).

    snapshot.py  pure helpers: validate, merge (coalescing), KV bar segments, timeline summaries
    sse.py       SnapshotHub (ZMQ SUB -> ring buffer) and the /visualizer routes (SSE)
    render.py    the panels as HTML strings (used by the ipywidgets twin)
    widget.py    SchedulerWidget(engine): the same panels in Jupyter, driving engine.step()
"""
