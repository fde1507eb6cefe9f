"""Running verified artifacts: the IREE executor, its crashable child, the CPU it runs on.

- :mod:`.executor` — :class:`~.executor.Executor`, the parent side;
- :mod:`.executor_child` — the child process (started by path: IREE and numpy only);
- :mod:`.cpu` — which CPU artifacts this machine can run, and the fastest.

May import :mod:`pcp_p2p.core`, :mod:`pcp_p2p.wire` and :mod:`pcp_p2p.compile` (manifests,
signatures, targets); nothing about runs or the network.

Layers, bottom to top (``tests/test_layers.py`` holds the same table and fails on
any import, at module level or inside a function, that runs up it): ``core`` <
``wire`` < ``dht`` < ``net`` < ``blob`` < ``compile`` < ``executor`` <
``diloco.algorithm`` < ``diloco.protocol`` < ``node`` < ``diloco.run`` <
``cluster`` < ``export`` < ``tui`` < ``testing`` < ``commands`` < ``cli``.
"""
