"""``pcp status`` as a live terminal dashboard (urwid).

- :mod:`.fmt` — reading a status dict defensively, and formatting its numbers;
- :mod:`.chart` — the loss / validation-loss chart as plain text;
- :mod:`.panels` — the six panels (swarm, shepherd, run, training, artifacts,
  network) as pure functions of a status dict, and the scrollable box widget;
- :mod:`.view` — the top-level widget: layout, keys, connection state, help,
  too-small terminal; renders to text with no terminal, which is how it is tested;
- :mod:`.fetcher` — polls the node once a second in a thread of its own;
- :mod:`.app` — glues the view, the fetcher and urwid's main loop together.
"""
