"""The numbers of DiLoCo: what a round computes, with no messages and no I/O.

- :mod:`.params` — parameter bundles as bytes: θ exact, Δ compressed;
- :mod:`.sparse` — top-k 2-bit pseudo-gradients with error feedback;
- :mod:`.outer` — the outer Nesterov step; :mod:`.checkpoint` — the outer state as a blob;
- :mod:`.robust` — robust combining of the workers' Δ and the policy that tunes it;
- :mod:`.data` — the corpus, its split and per-worker batch assignment.

May import :mod:`pcp_p2p.core`, :mod:`pcp_p2p.wire`, :mod:`pcp_p2p.blob` (the tensor byte
format) and :mod:`pcp_p2p.compile` (the tokenizer).

Layers, bottom to top (``tests/test_layers.py`` holds the same table and fails on
any import, at module level or inside a function, that runs up it): ``core`` <
``wire`` < ``dht`` < ``net`` < ``blob`` < ``compile`` < ``executor`` <
``diloco.algorithm`` < ``diloco.protocol`` < ``node`` < ``diloco.run`` <
``cluster`` < ``export`` < ``tui`` < ``testing`` < ``commands`` < ``cli``.
"""
