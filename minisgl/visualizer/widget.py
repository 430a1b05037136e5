"""SchedulerWidget (visualizer, Jupyter side). In: an in-process `minisgl.Engine`. Out: ipywidgets panels.

The notebook twin of the live page: the same panels (render.py, same CSS as
web/static/visualizer.css), drawn from `engine.step()` / `engine.snapshot()` instead
of an SSE stream. Buttons drive the Engine:

    Step         one scheduler iteration (engine.step())
    Run N steps  N iterations (stops early when nothing is left to do)
    Add request  queue a request of `prompt len` tokens (token ids, so lengths are exact)
    Reset        abort everything in flight, drop uncollected results, flush the radix cache,
                 clear the timeline

Everything shown is inspectable from Python, so nbval can assert on it:
`.last_snapshot` (the dict the panels show), `.step_count` (steps run by this
widget), `.timeline` (step summaries), `.finished` (finished records, oldest first),
`.panels` (panel name -> HTML string).
"""

from __future__ import annotations

import html
from typing import Any, Dict, List, Optional

from minisgl.visualizer.render import PANEL_NAMES, mode_label, render_panels, scope_css, web_dir
from minisgl.visualizer.snapshot import merge_step_summaries, step_summary

# Token ids for generated prompts: 10..249 exist in every byte-level vocabulary.
_ID_LOW, _ID_SPAN = 10, 240


def demo_input_ids(n: int, seed: int) -> List[int]:
    """`n` deterministic pseudo-random token ids (the page's demo uses the same generator)."""
    out, x = [], seed * 7919 + 17
    for _ in range(n):
        x = (x * 1103515245 + 12345) % 2147483648
        out.append(_ID_LOW + x % _ID_SPAN)
    return out


class SchedulerWidget:
    """`SchedulerWidget(engine)`; display it as the last expression of a cell."""

    def __init__(self, engine: Any, max_timeline: int = 200, max_finished: int = 60) -> None:
        import ipywidgets as w

        self.engine = engine
        self.max_timeline = max_timeline
        self.max_finished = max_finished  # rows drawn (as the page's MAX_FINISHED); .finished keeps all
        self.step_count = 0
        self.timeline: List[Dict[str, Any]] = []
        self.finished: List[Dict[str, Any]] = []
        self.last_snapshot: Dict[str, Any] = engine.snapshot()
        self.panels: Dict[str, str] = {}
        self._num_added = 0

        self.n_steps = w.BoundedIntText(value=5, min=1, max=10_000, description="N", layout=w.Layout(width="120px"))
        self.prompt_len = w.BoundedIntText(value=40, min=1, max=100_000, description="prompt len", layout=w.Layout(width="170px"))
        self.max_new_tokens = w.BoundedIntText(value=8, min=1, max=100_000, description="max new", layout=w.Layout(width="160px"))
        buttons = {"Step": self.step, "Run N steps": lambda: self.run(self.n_steps.value),
                   "Add request": lambda: self.add_request(self.prompt_len.value, self.max_new_tokens.value),
                   "Reset": self.reset}  # fmt: skip
        self.buttons: Dict[str, Any] = {}
        for label, action in buttons.items():
            button = w.Button(description=label)
            button.on_click(lambda _b, act=action: self._press(act))
            self.buttons[label] = button
        # the page's own stylesheet, confined to this widget (it styles `body`, `*`, `.row`, ...)
        style = scope_css((web_dir() / "static" / "visualizer.css").read_text(), ".minisgl-viz")
        self._style = w.HTML(f"<style>{style}</style>")
        self._header = w.HTML()
        self._panel_widgets = {name: w.HTML() for name in PANEL_NAMES}
        pw = self._panel_widgets
        grid = w.GridBox(
            [pw[n] for n in ("waiting", "batch", "running", "adder", "memory", "events")],
            layout=w.Layout(grid_template_columns="repeat(3, minmax(0, 1fr))", grid_gap="8px"),
        )
        controls = w.HBox([self.buttons["Step"], self.n_steps, self.buttons["Run N steps"], self.prompt_len,
                           self.max_new_tokens, self.buttons["Add request"], self.buttons["Reset"]])  # fmt: skip
        self.widget = w.VBox([self._style, self._header, controls, grid, pw["timeline"], pw["finished"]])
        self.widget.add_class("minisgl-viz")
        self._show(self.last_snapshot)

    # ------------------------------------------------------------------ actions
    def _press(self, action: Any) -> None:
        """A button's action. Its error (a prompt longer than the context, say) is shown above the
        panels: raised from a click callback it would reach only the ipywidgets log, unseen."""
        try:
            action()
        except (ValueError, RuntimeError) as e:
            self._header.value = f'<div class="minisgl-viz-header"><b>error</b> {html.escape(str(e))}</div>'

    def step(self) -> Dict[str, Any]:
        """One scheduler iteration; returns the snapshot now shown."""
        try:
            snap = self.engine.step()
        except KeyboardInterrupt:
            # Ctrl-C lands once the step has run (Engine.step): show that step, then stop
            snap = self.engine.snapshot()
            if snap["step"] != self.last_snapshot.get("step"):
                self.step_count += 1
                self._record(snap)
                self._show(snap)
            raise
        self.step_count += 1
        self._record(snap)
        self._show(snap)
        return snap

    def run(self, n: int) -> Dict[str, Any]:
        """Up to `n` iterations; stops early once every request has finished."""
        for _ in range(n):
            if not self.engine.has_unfinished_requests():
                break
            self.step()
        return self.last_snapshot

    def add_request(self, prompt_len: int, max_new_tokens: int, rid: Optional[str] = None) -> str:
        """Queue a request of exactly `prompt_len` tokens; returns its rid. Shown at once in waiting_queue."""
        self._num_added += 1
        rid = self.engine.add_request(
            input_ids=demo_input_ids(prompt_len, self._num_added),
            sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
            rid=rid or f"r{self._num_added}",
        )
        self._show(self.engine.snapshot())
        return rid

    def reset(self) -> Dict[str, Any]:
        """Abort what is in flight, drain, flush the radix cache and clear the widget's history."""
        for rid, state in list(self.engine.rid_to_state.items()):
            if not state.finished:
                self.engine.abort(rid)
        self.engine.run_until_idle()
        for rid in list(self.engine.rid_to_state):
            self.engine.get_result(rid)  # forget every result, so rids can be reused
        self.engine.flush_cache()
        self.step_count = 0
        self.timeline.clear()
        self.finished.clear()
        self._show(self.engine.snapshot())
        return self.last_snapshot

    # ------------------------------------------------------------------ display
    def _record(self, snap: Dict[str, Any]) -> None:
        # a step published again (an idle Step press, an abort between steps) is one bar, as on the page
        self.timeline[:] = merge_step_summaries(self.timeline, [step_summary(snap)])
        del self.timeline[: max(0, len(self.timeline) - self.max_timeline)]
        self.finished.extend(snap["finished"])

    def _show(self, snap: Dict[str, Any]) -> None:
        self.last_snapshot = snap
        # the newest rows only: every press re-sends the panels to the notebook front end
        newest = list(reversed(self.finished[-self.max_finished :])) if self.max_finished > 0 else []
        self.panels = render_panels(snap, self.timeline, newest)
        for name, panel in self.panels.items():
            self._panel_widgets[name].value = panel
        mode = snap["forward_mode"]
        self._header.value = (f'<div class="minisgl-viz-header"><b>step {snap["step"]}</b> '
                              f'<span class="mode-tag" data-mode="{mode}">{mode_label(mode)}</span> '
                              f'<span class="detail">{self.step_count} steps run here</span></div>')  # fmt: skip

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
