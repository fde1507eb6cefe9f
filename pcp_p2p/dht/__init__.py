"""The DHT's ``pcp`` namespace: signed records, Kademlia lookups, who sits in the table.

Which record kinds a node accepts is a table passed in (the node's is
:data:`pcp_p2p.node.record_kinds.RECORD_KINDS`). May import :mod:`pcp_p2p.core` and
:mod:`pcp_p2p.wire` only.

Layers, bottom to top (``tests/test_layers.py`` holds the same table and fails on
any import, at module level or inside a function, that runs up it): ``core`` <
``wire`` < ``dht`` < ``net`` < ``blob`` < ``compile`` < ``executor`` <
``diloco.algorithm`` < ``diloco.protocol`` < ``node`` < ``diloco.run`` <
``cluster`` < ``export`` < ``tui`` < ``testing`` < ``commands`` < ``cli``.
"""
