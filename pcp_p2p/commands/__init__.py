"""The ``pcp`` commands that assemble a whole node or a whole swarm.

- :mod:`.node_commands` — ``pcp node join`` (a node, its training, a worker group, the
  metrics endpoint), ``pcp bootstrap``, ``pcp status`` (the dashboard), ``pcp swarm-key``;
- :mod:`.swarm_command` — ``pcp swarm``: a bootstrap server and N nodes on one machine.

Other subcommands live beside what they drive (``compile_command``, ``export_command``,
``diloco.run.owner_commands``, ``node.doctor``, ``testing.sim_command``); these two
drive everything, so they sit on top, under :mod:`pcp_p2p.cli` alone. May import any
layer; nothing but the CLI imports them.

Layers, bottom to top (``tests/test_layers.py`` holds the same table and fails on
any import, at module level or inside a function, that runs up it): ``core`` <
``wire`` < ``dht`` < ``net`` < ``blob`` < ``compile`` < ``executor`` <
``diloco.algorithm`` < ``diloco.protocol`` < ``node`` < ``diloco.run`` <
``cluster`` < ``export`` < ``tui`` < ``testing`` < ``commands`` < ``cli``.
"""
