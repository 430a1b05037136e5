"""The visualizer's page assets (installed as `minisgl.web`): templates/ (jinja2) and static/ (plain JS + CSS)."""
