"""The node: one libp2p host, its DHT, gossipsub, membership and blob service, wired.

- :mod:`.node` — :func:`~.node.open_node` and :class:`~.node.Node`;
- :mod:`.record_kinds` — the one table of DHT record kinds the node stores and serves;
- :mod:`.messaging` — direct messages (``/pcp/msg``); :mod:`.status` — ``/pcp/status``;
- :mod:`.doctor` — ``pcp doctor``; :mod:`.metrics` — Prometheus from the status;
- :mod:`.config_file` — ``--config`` files; :mod:`.local_swarm` — node processes on loopback.

May import the network layers and DiLoCo's protocol (for the record kinds), never a
run: :mod:`pcp_p2p.diloco.run` sits on the node, not in it.

Layers, bottom to top (``tests/test_layers.py`` holds the same table and fails on
any import, at module level or inside a function, that runs up it): ``core`` <
``wire`` < ``dht`` < ``net`` < ``blob`` < ``compile`` < ``executor`` <
``diloco.algorithm`` < ``diloco.protocol`` < ``node`` < ``diloco.run`` <
``cluster`` < ``export`` < ``tui`` < ``testing`` < ``commands`` < ``cli``.
"""
