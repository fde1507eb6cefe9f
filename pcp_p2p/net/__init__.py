"""How peers reach each other, who is in the swarm, and what a peer may make us spend.

- :mod:`.budget` — per-peer and total budgets for streams and bytes;
- :mod:`.yamux_credit`, :mod:`.traffic` — libp2p stream credit and byte counting;
- :mod:`.connectivity`, :mod:`.reachability` — relays, hole punching, the reachability verdict;
- :mod:`.membership` — SWIM membership over signed member records;
- :mod:`.capabilities` — what this machine can do (in every member record);
- :mod:`.swarm_key` — private swarms' pre-shared key.

May import :mod:`pcp_p2p.core`, :mod:`pcp_p2p.wire` and :mod:`pcp_p2p.dht` (a member
record is a signed DHT record). Direct messages (:mod:`pcp_p2p.node.messaging`) sit
in the node: they dial through its relays and account refusals on it.

Layers, bottom to top (``tests/test_layers.py`` holds the same table and fails on
any import, at module level or inside a function, that runs up it): ``core`` <
``wire`` < ``dht`` < ``net`` < ``blob`` < ``compile`` < ``executor`` <
``diloco.algorithm`` < ``diloco.protocol`` < ``node`` < ``diloco.run`` <
``cluster`` < ``export`` < ``tui`` < ``testing`` < ``commands`` < ``cli``.
"""
