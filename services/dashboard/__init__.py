"""`laswrr dashboard`: the live operations page (board.py: the fold; app.py: HTTP, SSE, sources)."""
