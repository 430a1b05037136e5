"""Web assets of the live scheduler visualizer (templates/ and static/), served by the HTTP process."""
