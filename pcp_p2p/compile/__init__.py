"""Compiling the model: JAX programs → StableHLO → IREE artifacts with signed manifests.

May import :mod:`pcp_p2p.core` and :mod:`pcp_p2p.wire` only: a compile needs no network.

Layers, bottom to top (``tests/test_layers.py`` holds the same table and fails on
any import, at module level or inside a function, that runs up it): ``core`` <
``wire`` < ``dht`` < ``net`` < ``blob`` < ``compile`` < ``executor`` <
``diloco.algorithm`` < ``diloco.protocol`` < ``node`` < ``diloco.run`` <
``cluster`` < ``export`` < ``tui`` < ``testing`` < ``commands`` < ``cli``.
"""
